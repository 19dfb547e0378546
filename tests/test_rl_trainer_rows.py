"""The GRPO trainer's boundary and rows: one-line errors for a wrong mesh / tokenizer / task
before anything compiles; verl's row names; pi_old's log-probs from the update's own forward
equal to the separate pi_old pass; batched and truncated scoring; the seeded prompt stream;
response-length statistics; counters as TensorBoard text."""

import dataclasses
import types

import numpy as np
import pytest
from etils import epath

from jaxflow.data.tokenizer import CharTokenizer, TokenizerError
from jaxflow.mesh import role_meshes
from jaxflow.metric_writers import TensorBoardWriter
from jaxflow.rl.grpo import GRPOTrainer, MeshRoleError
from jaxflow.rl.step_metrics import deterministic_fields, renamed, response_length_metrics
from jaxflow.rl.tasks import AdditionRLTask, score_with_truncation
from jaxflow.sync.replica import tree_digest
from jaxflow.train.lm_state import OptimConfig
from tests.test_rl_grpo import BASE, MODEL, StopTask, _params, _trainer


@pytest.fixture(scope="module")
def meshes():
    return role_meshes({"trainer": 4, "rollout": 4})


def _build(roles, **kw):
    args = dict(model_cfg=MODEL, config=BASE, optim=OptimConfig(lr=3e-3, warmup_steps=0),
                task=AdditionRLTask(max_digits=1), tokenizer=CharTokenizer(), meshes=roles, seed=0)
    args.update(kw)
    return GRPOTrainer(**args)


def test_wrong_meshes_tokenizer_or_task_is_one_line_before_any_compile(meshes, monkeypatch):
    import jaxflow.rl.grpo as grpo

    monkeypatch.setattr(grpo, "compiled_functions", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(MeshRoleError, match=r"^meshes has no 'rollout' role \(it has \['trainer'\]\)"):
        _build(meshes, meshes={"trainer": meshes["trainer"]})
    with pytest.raises(MeshRoleError, match=r"meshes\['rollout'\] is a str; valid: a jax.sharding.Mesh"):
        _build(meshes, meshes={"trainer": meshes["trainer"], "rollout": "cpu:4"})
    legacy = types.SimpleNamespace(encode=str.split, decode=str, eos_id=2, pad_id=0, vocab_size=9)
    with pytest.raises(TokenizerError, match=r"^tokenizer SimpleNamespace has no eos_ids, bos_id; valid"):
        _build(meshes, tokenizer=legacy)
    with pytest.raises(TypeError, match=r"task dict is not a jaxflow.rl.tasks.Task \(missing: name, "):
        _build(meshes, task={"prompt": "1+1="})
    errs = [pytest.raises(MeshRoleError, _build, meshes, meshes={}).value,
            pytest.raises(TokenizerError, _build, meshes, tokenizer=legacy).value]
    assert all("\n" not in str(e) and not str(e).startswith(("'", '"')) for e in errs)


def test_update_from_its_own_forward_equals_the_separate_pi_old_pass(meshes):
    # lag 1, no SIS, no KL: pi_old is the current policy, so the old log-probs can be the
    # stop-gradient of the update's forward; the row and the params must not change
    kw = dict(task=StopTask(), entropy_coef=0.05)
    fused, separate = _trainer(meshes, **kw), _trainer(meshes, reuse_forward=False, **kw)
    assert fused.config.old_from_update and not separate.config.old_from_update
    assert not _trainer(meshes, lag=2).config.old_from_update  # later mini-batches need pi_old
    params = _params(fused)
    rows, digests = [], []
    for trainer in (fused, separate):
        state = trainer.init_state(params)
        for _ in range(2):
            state, row = trainer.step(state)
        rows.append(row)
        digests.append(tree_digest(state["policy"].params))
    assert rows[0]["actor/max_abs_log_ratio_first"] == 0.0  # ratio == 1 exactly
    assert deterministic_fields(rows[0]) == deterministic_fields(rows[1])  # bit for bit
    assert digests[0] == digests[1]
    assert rows[0]["actor/grad_norm"] > 0  # it did update
    names = set(rows[0])
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "actor/lr", "actor/entropy",
            "critic/rewards/mean", "critic/score/mean", "response_length/mean",
            "response_length/max", "response_length/clip_ratio", "version/sampler",
            "version/trainer", "timing_s/generate", "timing_s/reward", "timing_s/update",
            "timing_s/sync", "perf/step_s", "perf/tokens_per_s", "perf/mfu"} <= names
    assert not any(k in names for k in ("policy_loss", "reward_mean", "sampler_version"))
    assert rows[0]["actor/lr"] == pytest.approx(3e-3) and 0 < rows[0]["perf/mfu"] < 1
    assert rows[0]["perf/step_s"] >= rows[0]["timing_s/update"] > 0
    assert renamed("reward_mean") == "critic/rewards/mean" and renamed("d_sis") == "actor/d_sis"


@dataclasses.dataclass(frozen=True)
class BatchTask(StopTask):
    """Scores a batch at once: the completion's length, and records the truncated flags."""

    def score_batch(self, prompts, completions, truncated):
        self.seen.append(np.asarray(truncated).tolist())
        return np.array([len(c) for c in completions], np.float32)

    @property
    def seen(self):
        return _SEEN


_SEEN: list = []


def test_truncated_completions_are_scored_under_score_and_zero_under_zero():
    tok = CharTokenizer()
    rows = np.array([tok.encode("12") + [2, 0], tok.encode("3456")], np.int32)  # row 1: no EOS
    prompts = ["1+1=", "2+2="]
    _SEEN.clear()
    for policy, want in (("zero", [2.0, 0.0]), ("score", [2.0, 4.0])):
        rewards, truncated = score_with_truncation(BatchTask(), tok, prompts, rows,
                                                   truncated_reward=policy)
        assert rewards.tolist() == want and truncated.tolist() == [False, True]
    assert _SEEN == [[False, True], [False, True]]  # one call per batch, truncated rows flagged
    per_row = score_with_truncation(StopTask(), tok, prompts, rows, truncated_reward="score")[0]
    assert per_row.tolist() == [1.0, 1.0]  # StopTask.score is 1 for any text it is given
    with pytest.raises(ValueError, match=r"truncated_reward='drop'; valid: \('zero', 'score'\)"):
        score_with_truncation(StopTask(), tok, prompts, rows, truncated_reward="drop")
    with pytest.raises(ValueError, match="truncated_reward='clip'"):
        dataclasses.replace(BASE, truncated_reward="clip")


@dataclasses.dataclass(frozen=True)
class StreamTask(StopTask):
    """A seeded stream: the prompt at position i of seed s is "s:i"."""

    def prompts_at(self, start, n, seed):
        return [f"{seed}:{i}" for i in range(start, start + n)]


def test_prompts_come_from_the_stream_at_the_rollout_counter(meshes):
    trainer = _trainer(meshes, task=StreamTask(), prompts_per_rollout=3)
    assert trainer.rollout_prompts(0) == ["0:0", "0:1", "0:2"]
    assert trainer.rollout_prompts(5) == ["0:15", "0:16", "0:17"]  # resume: position from r
    other = trainer.rollout_prompts(5, gen_batch=1)
    assert other[0].endswith(":15") and not other[0].startswith("0:")  # another seeded stream
    assert trainer.rollout_prompts(5, gen_batch=1) == other


def test_response_length_metrics_count_truncation_without_eos():
    tokens = np.array([[5, 2, 0], [5, 6, 7], [5, 6, 2], [9, 0, 0]])
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], np.float32)
    m = response_length_metrics(tokens, mask, 3, stop_ids=(2,))
    assert m == {"response_length/mean": 2.25, "response_length/max": 3.0,
                 "response_length/clip_ratio": 0.25}  # row 2 ended on EOS at the cap
    assert response_length_metrics(tokens, mask, 3, stop_ids=(2, 7))["response_length/clip_ratio"] == 0


def test_counters_go_to_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(epath.Path(tmp_path))
    for step in (1, 2):
        writer.write(step, {"step": step, "actor/pg_loss": 0.5 / step, "version/sampler": 3 * step})
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    assert acc.Tags()["scalars"] == ["actor/pg_loss"] and acc.Tags()["tensors"] == ["version/sampler"]
    assert [(e.step, e.tensor_proto.string_val) for e in acc.Tensors("version/sampler")] == \
        [(1, [b"3"]), (2, [b"6"])]
    assert len(acc.Scalars("actor/pg_loss")) == 2  # the measured series stays a scalar
