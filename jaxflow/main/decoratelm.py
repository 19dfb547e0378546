"""The ``decoratelm`` experiment (DecorateLM, Zhao et al., EMNLP 2024) end to end.

1. Corpus (:func:`jaxflow.decorate.mixture.build_corpus`): real passages (a held-out part is
   never selectable), templated multi-topic documents, degraded copies, keyword-salad noise.
   Written to ``corpus.jsonl`` in the run directory.
2. The programmatic teacher annotates a sample (pairwise comparisons -> Bradley-Terry, tags,
   edits); the student (:class:`jaxflow.decorate.system.DecorateStudentSystem`) is distilled on
   part of it with ``run_steps``; agreement on the rest (``DecorateStudentSystem.agreement``).
3. The student decorates the whole pool (streamed, sharded, resumable tensorstore table).
4. Arms (:mod:`jaxflow.decorate.lm_arms`), each selecting <= ``token_budget`` tokens, one LM
   per arm and seed; perplexity on the held-out real passages and on the probe set.
Plus the Bradley-Terry recovery study (known scores vs comparisons per item).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxflow.compile_only.program import Program
from jaxflow.config import ConfigError
from jaxflow.decorate import corpus as C
from jaxflow.decorate import decorate as D
from jaxflow.decorate.lm_arms import ARMS, ArmInputs, LMRunner, arm_table, run_arms
from jaxflow.decorate.mixture import build_corpus, composition
from jaxflow.decorate.rating import CRITERIA, recovery_study, spearman
from jaxflow.decorate.student import batch_order, encode_texts, host_floats, pad_ops, zscore
from jaxflow.decorate.system import DecorateStudentSystem, StudentBatches, StudentHeldout
from jaxflow.decorate.tagging import default_hierarchy, hierarchical_accuracy
from jaxflow.decorate.teacher import ProgrammaticTeacher, annotate
from jaxflow.experiment import RunContext
from jaxflow.train.loop import last_row, run_steps


def main(config, run: RunContext) -> dict:
    t_start = time.time()
    hierarchy, tokenizer = default_hierarchy(), C.text_tokenizer()
    mesh = config.mesh.make()
    cc, tc, sc = config.corpus, config.teacher, config.student
    T = cc.max_chars

    # 1. corpus ----------------------------------------------------------------------------
    pool, heldout, probe, fingerprint = build_corpus(cc, hierarchy, config.seed)
    pool_tokens = sum(C.count_tokens(d.text) for d in pool)
    if config.selection.token_budget > pool_tokens:
        raise ConfigError(f"selection.token_budget={config.selection.token_budget} exceeds the corpus's "
                          f"{pool_tokens} tokens; lower it or enlarge the corpus")
    corpus_path = run.out_dir / "corpus.jsonl"
    run.out_dir.mkdir(parents=True, exist_ok=True)
    C.write_jsonl(pool, corpus_path)
    run.info(f"corpus: {len(pool)} pool docs, {len(heldout)} held-out real, {len(probe)} probe; "
             f"real text sha256 {fingerprint['sha256'][:12]} (python {fingerprint['python']})")

    # 2. teacher annotation + distillation --------------------------------------------------
    teacher = ProgrammaticTeacher(hierarchy, judge_noise=tc.judge_noise, seed=config.seed)
    key = jax.random.key(config.seed)
    k_ann, k_full, k_student, k_sel = jax.random.split(key, 4)
    sample_idx = np.random.default_rng(config.seed + 7).permutation(len(pool))[: tc.n_annotate]
    sample = [pool[i].text for i in sample_idx]
    t0 = time.time()
    ann = annotate(teacher, sample, min_comparisons=tc.min_comparisons, key=k_ann, l2=tc.l2)
    annotate_s = time.time() - t0
    n_hold = max(int(round(tc.heldout_fraction * len(sample))), 1)
    hold, train = np.arange(n_hold), np.arange(n_hold, len(sample))
    if sc.batch_size > len(train):
        raise ValueError(f"student batch_size={sc.batch_size} exceeds the {len(train)} annotated texts")
    tokens, valid = encode_texts(sample, tokenizer, T)
    ops = pad_ops(ann["ops"], T)
    data = StudentBatches(tokens[train], valid[train], zscore(ann["scores"][train])[0],
                          ann["tags"][train], ops[train])
    system = DecorateStudentSystem(StudentHeldout(
        tokens[hold], valid[hold], ann["scores"][hold], ann["tags"][hold],
        [sample[i] for i in hold], [ann["edits"][i] for i in hold], config.decorate.batch_size))
    k_init, k_data = jax.random.split(k_student)
    t0 = time.time()
    run.set_total_steps(sc.steps, "student")
    batches = batch_order(k_data, len(train), sc.batch_size)

    def log_student(done, state, row):
        if done % 50 == 0 or done == sc.steps:
            run.log(done, {f"student_{k}": v for k, v in host_floats(row).items()})

    result = run_steps(lambda state, step: system.step(state, data.batch(next(batches))),
                       system.init(config, {"mesh": mesh}, k_init), steps=sc.steps,
                       summarize=last_row, hooks=[log_student])
    student, last = result.state, host_floats(result.last_metrics or {})
    distill_s = time.time() - t0
    agree = system.agreement(student)
    run.info(f"agreement: spearman mean {agree['spearman_mean']:.3f}, tag acc "
             f"{agree['tag_accuracy']}, edit similarity {agree['edit_similarity']:.3f} "
             f"(unedited {agree['edit_similarity_unedited']:.3f})")

    # 3. decoration of the whole pool -------------------------------------------------------
    dec = D.decorate_corpus(corpus_path, run.out_dir / "decorated", predict=student.predict,
                            params=student.train.params, tokenizer=tokenizer, seq_len=T,
                            batch_size=config.decorate.batch_size,
                            checkpoint_every=config.decorate.checkpoint_every)
    table = D.read_table(run.out_dir / "decorated")
    run.info(f"decorated {dec.rows} texts at {dec.texts_per_second:.0f} texts/s")

    # 4. teacher labels of the whole pool (arm e) ------------------------------------------
    t0 = time.time()
    full = annotate(teacher, [d.text for d in pool], min_comparisons=tc.min_comparisons, key=k_full, l2=tc.l2)
    teacher_full_s = time.time() - t0

    # 5. selections and one LM per arm and seed ----------------------------------------------
    runner = LMRunner(config.lm, config.optim, mesh, tokenizer,
                      {"heldout_real": [d.text for d in heldout], "probe": [d.text for d in probe]}, T)
    run.set_total_steps(sc.steps + len(ARMS) * config.seeds, "lm arms")
    t0 = time.time()
    results, selections = run_arms(ArmInputs(pool, table, full), runner, config, hierarchy, k_sel,
                                   log=lambda done, row: run.log(sc.steps + done, row))
    lm_s = time.time() - t0
    table_rows = arm_table(results, selections)
    # Student vs teacher over the whole pool (the teacher's full-pool labels are exact there).
    pool_agree = {
        "spearman": dict(zip(CRITERIA, map(float, spearman(table["ratings"], full["scores"])))),
        "tag_accuracy": hierarchical_accuracy(table["tags"], full["tags"]),
    }
    recovery = recovery_study(config.recovery.n_items, config.recovery.comparisons,
                              spread=config.recovery.spread, repeats=config.recovery.repeats,
                              key=jax.random.fold_in(key, 99))
    return {
        "arms": table_rows,
        "per_seed": results,
        "selections": selections,
        "agreement_heldout": agree,
        "agreement_pool": pool_agree,
        "student_final_metrics": last,
        "decoration": dataclasses.asdict(dec),
        "decoration_texts_per_second": dec.texts_per_second,
        "bt_recovery": {str(k): v for k, v in recovery.items()},
        "bt_recovery_spread": config.recovery.spread,
        "corpus": {"pool": len(pool), "heldout_real": len(heldout), "probe": len(probe),
                   "pool_tokens": int(table["lengths"].sum()), "real_text": fingerprint,
                   "tokenizer": C.TOKENIZER_NAME, "composition": composition(pool)},
        "timings_s": {"annotate_sample": annotate_s, "distill": distill_s, "decorate": dec.seconds,
                      "teacher_full_pool": teacher_full_s, "lm_arms": lm_s,
                      "total": time.time() - t_start},
        "heldout_real_ppl": {arm: table_rows[arm]["heldout_real_ppl_mean"] for arm in ARMS},
        "probe_ppl": {arm: table_rows[arm]["probe_ppl_mean"] for arm in ARMS},
    }


def compile_programs(config, meshes) -> list[Program]:
    """The student's programs on ``meshes["mesh"]``: :meth:`DecorateStudentSystem.programs`."""
    return DecorateStudentSystem().programs(config, meshes)
