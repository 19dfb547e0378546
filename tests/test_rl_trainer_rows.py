"""The GRPO trainer's boundary and rows: one-line errors for a wrong mesh / tokenizer / task
before anything compiles (the row names and pi_old's log-probs from the update's own forward:
tests/test_rl_grpo.py); batched and truncated scoring; the seeded prompt stream;
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
from jaxflow.rl.step_metrics import renamed, response_length_metrics
from jaxflow.rl.tasks import AdditionRLTask, score_with_truncation
from jaxflow.train.lm_state import OptimConfig
from tests.test_rl_grpo import BASE, MODEL, StopTask, _trainer


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


def test_earlier_flat_names_map_to_verls():
    assert renamed("reward_mean") == "critic/rewards/mean" and renamed("d_sis") == "actor/d_sis"
    assert renamed("sampler_version") == "version/sampler" and renamed("clip_fraction") == "actor/pg_clipfrac"


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
