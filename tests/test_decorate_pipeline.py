"""Student distillation, sharded decoration resumed bit-identically, TPU/GPU lowering."""
import dataclasses

import jax
import numpy as np
import pytest

from configs import decoratelm as cfg_mod
from jaxflow.config import ConfigError
from jaxflow.decorate import corpus as C
from jaxflow.decorate import decorate as D
from jaxflow.decorate import student as ST
from jaxflow.decorate.tagging import default_hierarchy
from jaxflow.decorate.teacher import ProgrammaticTeacher
from jaxflow.experiment import standalone_context
from jaxflow.mesh import make_mesh
from jaxflow.models.transformer import TransformerConfig
from tests._cli import persistent_compile_cache


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The tests build the student's programs again (a new ``jax.jit`` of the same
    function): each is compiled once and loaded after (jax's persistent cache)."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


H = default_hierarchy()
T = 48
TRUNK = TransformerConfig(vocab_size=99, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                          max_seq_len=T)


@pytest.fixture(scope="module")
def student():
    mesh = make_mesh({"data": 8})
    fns = ST.student_functions(TRUNK, H, mesh)
    docs = C.TemplateGenerator(H, max_chars=T).generate(43, seed=0)
    texts = [d.text for d in docs]
    teacher = ProgrammaticTeacher(H)  # features stand in for Bradley-Terry scores here
    tok = C.text_tokenizer()
    tokens, valid = ST.encode_texts(texts, tok, T)
    params, last = ST.distill(fns, tokens=tokens, valid=valid, ratings=teacher.features(texts),
                              tags=teacher.tag(texts), ops=ST.pad_ops(teacher.edit_ops(texts), T),
                              steps=20, batch_size=8, lr=1e-2, key=jax.random.key(1))
    return fns, params, docs, tok, last, ST.make_predict(fns)


def test_distillation_trains_all_heads(student):
    fns, params, docs, tok, last, predict = student
    assert np.isfinite([last["rating_mse"], last["tag_ce"], last["edit_ce"]]).all()
    assert last["tag_ce"] < np.log(84)  # below a uniform guess over leaves
    pred = ST.predict_in_batches(predict, params, *ST.encode_texts(
        [d.text for d in docs], tok, T), batch_size=8)
    assert pred["ratings"].shape == (43, 8) and pred["ops"].shape == (43, T)
    from jaxflow.decorate.tagging import validate_tags
    validate_tags(pred["tags"], H)  # decoded tags are always valid paths


def test_decoration_resumes_bit_identically(student, tmp_path):
    fns, params, docs, tok, _, predict = student
    path = tmp_path / "corpus.jsonl"
    C.write_jsonl(docs, path)
    kw = dict(predict=predict, params=params, tokenizer=tok, seq_len=T, batch_size=8)
    full = D.decorate_corpus(path, tmp_path / "full", **kw)
    assert full.rows == 43 and full.batches == 6  # 43 texts > one batch of 8
    part = D.decorate_corpus(path, tmp_path / "part", stop_after_batches=2, **kw)
    assert part.batches == 2
    rest = D.decorate_corpus(path, tmp_path / "part", **kw)
    assert rest.resumed_from_batch == 2 and rest.rows == 43
    a, b = D.read_table(tmp_path / "full"), D.read_table(tmp_path / "part")
    for col in D.COLUMNS:
        assert a[col].tobytes() == b[col].tobytes(), col
    np.testing.assert_array_equal(a["lengths"], [len(d.text) + 1 for d in docs])
    with pytest.raises(ValueError, match=r"document \d+ \('tpl:\d+'\) has \d+ characters > seq_len=16"):
        D.decorate_corpus(path, tmp_path / "short", **{**kw, "seq_len": 16})
    assert not (tmp_path / "short").exists()  # rejected before anything was written


def test_student_predict_lowers_for_tpu_and_gpu():
    fns = ST.student_functions(TRUNK, H, make_mesh({"data": 1}, jax.devices()[:1]))
    params = jax.eval_shape(lambda: ST.init_student(fns, jax.random.key(0)))

    fn = jax.jit(_predict_body(fns))
    args = (params, jax.ShapeDtypeStruct((4, T), np.int32), jax.ShapeDtypeStruct((4, T), bool))
    exp = jax.export.export(fn, platforms=("tpu", "cuda"))(*args)
    assert exp.platforms == ("tpu", "cuda")


def _predict_body(fns):
    def body(params, tokens, valid):
        out = fns.model(params)(tokens, valid)
        return {"ratings": out["ratings"], "ops": out["edit_logits"].argmax(-1)}
    return body


def test_budget_larger_than_corpus_is_a_config_error(tmp_path):
    from jaxflow.main.decoratelm import main

    cfg = cfg_mod.get_config("quick")
    cfg = dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, token_budget=10**9))
    with pytest.raises(ConfigError, match="token_budget=1000000000 exceeds the corpus's"):
        main(cfg, standalone_context("decoratelm", out_dir=str(tmp_path)))


def test_student_system_steps_are_distills(student):
    """``DecorateStudentSystem`` run by ``run_steps`` on ``StudentBatches`` reproduces
    ``distill`` bit for bit (same key, batches and steps); its programs lower and ``evaluate``
    scores the held-out texts."""
    from jaxflow.decorate.system import DecorateStudentSystem, StudentBatches, StudentHeldout
    from jaxflow.system import check_system, is_system_state
    from jaxflow.train.loop import last_row, run_steps

    _, params, docs, tok, last, _ = student
    base = cfg_mod.get_config("quick")
    config = dataclasses.replace(
        base, corpus=dataclasses.replace(base.corpus, max_chars=T),
        student=dataclasses.replace(base.student, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                                    steps=20, batch_size=8, lr=1e-2))
    texts = [d.text for d in docs]
    teacher = ProgrammaticTeacher(H)
    tokens, valid = ST.encode_texts(texts, tok, T)
    data = StudentBatches(tokens, valid, ST.zscore(teacher.features(texts))[0], teacher.tag(texts),
                          ST.pad_ops(teacher.edit_ops(texts), T))
    held = StudentHeldout(tokens[:8], valid[:8], teacher.features(texts[:8]), teacher.tag(texts[:8]),
                          texts[:8], teacher.edit(texts[:8]), batch_size=8)
    system = DecorateStudentSystem(held)
    assert check_system(system) == []
    meshes = {"mesh": make_mesh({"data": 8})}
    k_init, k_data = jax.random.split(jax.random.key(1))
    state = system.init(config, meshes, k_init)
    assert is_system_state(state)
    batches = ST.batch_order(k_data, len(texts), 8)
    result = run_steps(lambda s, step: system.step(s, data.batch(next(batches))), state, steps=20,
                       summarize=last_row)
    for x, y in zip(jax.tree.leaves(result.state.train.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert ST.host_floats(result.last_metrics) == last
    scores = system.evaluate(result.state)
    assert set(scores) >= {"spearman_mean", "edit_similarity", "tag_accuracy/level1"}
    assert all(isinstance(v, float) for v in scores.values())
    programs = system.programs(config, meshes)
    assert [p.name for p in programs] == ["student/step", "student/predict"]
    for p in programs:
        p.fn.lower(*p.args)
