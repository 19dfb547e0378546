"""GRPO trainer: on-policy first mini-batch, lag / staleness versions, learning, exact resume.

Trainer and rollout sampler run on disjoint sub-meshes of the 8 fake CPU devices (4 + 4).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.checkpoint import Checkpointer, abstract_like
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import GRPOConfig, GRPOTrainer, grpo_loss
from jaxflow.rl.policy_loss import PolicyLossConfig
from jaxflow.rl.reward_shaping import OverlongBufferConfig
from jaxflow.rl.rollout import RolloutBatch
from jaxflow.rl.step_metrics import deterministic_fields
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.sync.replica import tree_digest
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig, init_params
from tests._cli import persistent_compile_cache

MODEL = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=64, max_seq_len=32)
BASE = GRPOConfig(prompts_per_rollout=4, group_size=4, max_new_tokens=3, sis_topk=4)
#: SIS, KL and an entropy bonus at lag 2: the on-policy and the resume tests share its programs
RESUME_KW = dict(loss=PolicyLossConfig(correction="sis"), lag=2, kl_coef=0.1, entropy_coef=0.05)


@dataclasses.dataclass(frozen=True)
class StopTask:
    """A trivial task: reward 1 for any completion that stops (emits EOS) in time."""

    name: str = "stop"
    max_prompt_len: int = 6
    max_completion_len: int = 2

    def prompts(self, rng, n):
        return [f"{int(a)}+{int(b)}=" for a, b in rng.integers(0, 10, size=(n, 2))]

    def heldout_prompts(self, n, seed=1234):
        return self.prompts(np.random.default_rng(seed), n)

    def score(self, prompt, completion):
        return 1.0  # score_completions already gives 0 to completions without EOS


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The tests' trainers differ in config fields that leave most programs unchanged
    (staleness, the task, reward shaping, a fresh trainer on resume): each program with the same
    HLO is compiled once and loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


@pytest.fixture(scope="module")
def meshes():
    m = role_meshes({"trainer": 4, "rollout": 4})
    assert not set(m["trainer"].devices.flat) & set(m["rollout"].devices.flat)
    return m


def _trainer(meshes, task=None, optim=None, **overrides):
    cfg = dataclasses.replace(BASE, **overrides)
    return GRPOTrainer(MODEL, cfg, optim or OptimConfig(lr=3e-3, warmup_steps=0), task or
                       AdditionRLTask(max_digits=1), CharTokenizer(), meshes, seed=0,
                       total_rollouts=8)


def _params(trainer, seed=0):
    return init_params(trainer.fns, MODEL, jax.random.key(seed))


def test_first_minibatch_is_exactly_on_policy_and_later_ones_are_not(meshes):
    # entropy bonus: gradients are non-zero even when every reward (hence advantage) is 0;
    # the loss and lag of test_resume_from_checkpoint_is_bit_identical (its programs reused)
    trainer = _trainer(meshes, **RESUME_KW)
    state = trainer.init_state(_params(trainer))
    for _ in range(2):
        batch = trainer.generate(state)
        state, history, sent = trainer.train_on_rollout(state, batch)
        assert sent is None  # sync off: nothing went through a weight sync
        rows = jax.device_get(history)
        assert float(rows[0]["max_abs_log_ratio"]) == 0.0   # ratio == 1 bit for bit
        assert float(rows[0]["accept_rate"]) == 1.0         # SIS accepts every token
        assert float(rows[0]["d_original"]) == 0.0
        # the test could fail: after an update the policy has moved, so ratios differ from 1
        assert all(float(r["max_abs_log_ratio"]) > 0 for r in rows[1:])
        assert all(0.0 < float(r["accept_rate"]) < 1.0 for r in rows[1:])


@pytest.mark.parametrize("lag,staleness", [(2, 2), (3, 0)])
def test_lag_and_staleness_give_the_intended_parameter_versions(meshes, lag, staleness):
    # lag 2: the config of test_step_with_sync_returns_what_the_publish_sent (its programs
    # reused); lag 3 needs a rollout of 3 x 4 rows to split into 3 mini-batches
    trainer = _trainer(meshes, lag=lag, staleness=staleness, prompts_per_rollout=3 if lag == 3 else 4,
                       entropy_coef=0.05)
    state = trainer.init_state(_params(trainer))
    snapshots = {0: tree_digest(state["policy"].params)}  # version -> params
    for r in range(4):
        expected = max(0, r - staleness) * lag
        assert int(state["published_version"][0]) == expected
        # the weights the sampler uses are bit-identical to the trainer's at that version
        assert tree_digest(state["published"][0]) == snapshots[expected]
        state, metrics = trainer.step(state)
        assert metrics["version/sampler"] == expected
        assert metrics["version/trainer"] == r * lag
        assert int(state["policy"].step) == (r + 1) * lag  # N optimizer steps per rollout
        snapshots[(r + 1) * lag] = tree_digest(state["policy"].params)
    assert len(set(snapshots.values())) == len(snapshots)  # every update changed the params


def _first_token_prob(trainer, params, token_id):
    prompts = trainer.task.heldout_prompts(32)
    tok = CharTokenizer()
    from jaxflow.rl.tasks import encode_prompts

    ids, lengths = encode_prompts(tok, prompts, trainer.worker.prompt_width)
    return float(np.mean(_first_token_probs(trainer.fns)(params, ids, lengths)[:, token_id]))


_PROBS_FNS: dict = {}  # id(fns) -> (fns, jitted probs); fns kept alive so its id stays its own


def _first_token_probs(fns):
    """Jitted ``(params, ids [B, P], lengths [B]) -> [B, V]`` next-token probabilities after
    each prompt: one compile per model (before / after a run), not an op-by-op forward."""

    def probs(params, ids, lengths):
        logits = fns.model(params)(ids)
        return jax.nn.softmax(logits[jnp.arange(ids.shape[0]), lengths - 1], axis=-1)
    if id(fns) not in _PROBS_FNS:
        _PROBS_FNS[id(fns)] = (fns, jax.jit(probs))
    return _PROBS_FNS[id(fns)][1]


def test_two_step_run_learns_a_trivial_task(meshes):
    task = StopTask()
    trainer = _trainer(meshes, task=task, prompts_per_rollout=8, group_size=8, lag=1,
                       optim=OptimConfig(lr=3e-2, warmup_steps=0))
    eos = CharTokenizer().eos_id
    state = trainer.init_state(_params(trainer, seed=1))
    before = _first_token_prob(trainer, state["policy"].params, eos)
    rewards = []
    for _ in range(2):
        state, metrics = trainer.step(state)
        rewards.append(metrics["critic/rewards/mean"])
    after = _first_token_prob(trainer, state["policy"].params, eos)
    assert 0 < rewards[0] < 1  # some signal in the first groups
    assert after > 2 * before, (before, after)
    # lag 1 without SIS or KL: pi_old's log-probs came from the update's own forward
    assert trainer.config.old_from_update and metrics["actor/max_abs_log_ratio_first"] == 0.0
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "actor/lr",
            "critic/rewards/mean", "critic/score/mean", "response_length/mean",
            "response_length/max", "response_length/clip_ratio", "version/sampler",
            "version/trainer", "timing_s/generate", "timing_s/reward", "timing_s/update",
            "timing_s/sync", "perf/step_s", "perf/tokens_per_s", "perf/mfu"} <= set(metrics)
    assert not {"policy_loss", "reward_mean", "sampler_version"} & set(metrics)  # verl's names only
    assert metrics["actor/lr"] == pytest.approx(3e-2) and 0 < metrics["perf/mfu"] < 1
    assert metrics["perf/step_s"] >= metrics["timing_s/update"] > 0


def _rollout(trainer, seed=0):
    """A synthetic rollout batch of the trainer's shapes (no sampler to compile)."""
    cfg, rng = trainer.config, np.random.default_rng(seed)
    b, n, p = cfg.rollout_size, cfg.max_new_tokens, trainer.worker.prompt_width
    lengths = rng.integers(2, p + 1, b).astype(np.int32)
    prompts = np.where(np.arange(p) < lengths[:, None], rng.integers(3, 23, (b, p)), 0).astype(np.int32)
    resp = rng.integers(1, n + 1, b)
    mask = (np.arange(n) < resp[:, None]).astype(np.float32)
    tokens = (rng.integers(3, 23, (b, n)) * mask).astype(np.int32)
    return RolloutBatch(prompts, lengths, tokens, mask, np.zeros((b, n), np.float32),
                        rng.integers(0, 2, b).astype(np.float32))


def test_update_from_its_own_forward_equals_the_separate_pi_old_pass(meshes):
    # lag 1, no SIS, no KL: pi_old is the current policy, so the old log-probs can be the
    # stop-gradient of the update's forward; metrics and params equal the separate pass's bit
    # for bit (the same forward ops on the same params, so old_logp == logp exactly)
    # the config of test_two_step_run_learns_a_trivial_task: its compiled update is reused
    fused, separate = (_trainer(meshes, task=StopTask(), prompts_per_rollout=8, group_size=8,
                                optim=OptimConfig(lr=3e-2, warmup_steps=0), reuse_forward=r)
                       for r in (True, False))
    assert fused.config.old_from_update and not separate.config.old_from_update
    assert not _trainer(meshes, lag=2).config.old_from_update  # later mini-batches need pi_old
    params = _params(fused)
    policies = [t.init_state(params)["policy"] for t in (fused, separate)]
    for it in range(2):  # two iterations: the second from updated params
        (mb,) = fused.minibatches(_rollout(fused, seed=it))
        key = jax.random.key(it)
        policies[0], m_fused = fused._update(policies[0], mb, None, key=key)
        old = separate._old_stats(policies[1].params, None, mb)
        policies[1], m_sep = separate._update(policies[1], mb, old, key=key)
        m_fused, m_sep = jax.device_get((m_fused, m_sep))
        assert m_fused == m_sep and m_fused["max_abs_log_ratio"] == 0.0
        assert m_fused["grad_norm"] > 0 and m_fused["policy_loss"] != 0
    assert tree_digest(policies[0].params) == tree_digest(policies[1].params)
    with pytest.raises(ValueError, match=r"grpo_loss\(old=None\) needs config.old_from_update"):
        grpo_loss(params, mb, None, fns=separate.fns, config=separate.config, key=key)


def test_resume_from_checkpoint_is_bit_identical(meshes, tmp_path):
    kw = dict(RESUME_KW, staleness=1)
    trainer = _trainer(meshes, **kw)
    params = _params(trainer)

    state = trainer.init_state(params)
    straight = []
    for _ in range(4):
        state, m = trainer.step(state)
        straight.append(m)
    want = tree_digest(state)

    state = trainer.init_state(params)
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=1)
    for _ in range(2):
        state, _ = trainer.step(state)
    ckpt.save(2, state, force=True)
    ckpt.wait()
    fresh = _trainer(meshes, **kw)  # a new trainer, as in a new process
    template = fresh.init_state(_params(fresh, seed=5))
    restored = Checkpointer(tmp_path / "ckpt").restore(2, abstract_like(template))
    assert jax.tree.structure(restored) == jax.tree.structure(template)
    resumed = []
    for _ in range(2):
        restored, m = fresh.step(restored)
        resumed.append(m)
    assert tree_digest(restored) == want  # whole state: params, opt, queue, ref, rng
    assert [deterministic_fields(m) for m in resumed] == \
        [deterministic_fields(m) for m in straight[2:]]


def test_step_with_sync_returns_what_the_publish_sent(meshes):
    # sync every 2 rollouts: the step reports the record of its own publish, or None
    trainer = GRPOTrainer(MODEL, dataclasses.replace(BASE, entropy_coef=0.05, lag=2),
                          OptimConfig(lr=3e-3, warmup_steps=0), AdditionRLTask(max_digits=1),
                          CharTokenizer(), meshes, seed=0, total_rollouts=8,
                          sync=SyncConfig(codec="auto", every=2))
    state = trainer.init_state(_params(trainer))
    for r in range(3):
        state, metrics, sent = trainer.step_with_sync(state)
        if r % 2 == 0:
            assert sent is None and metrics["sync/synced"] == 0.0 and "sync/payload_bytes" not in metrics
            continue
        assert sent is trainer.weight_sync.records[-1] and len(trainer.weight_sync.records) == 1
        assert sent.stats.version == int(state["policy"].step) == 4 and sent.bit_exact
        assert metrics["sync/synced"] == 1.0 and metrics["sync/bit_exact"] == 1.0
        assert metrics["sync/payload_bytes"] == sent.stats.payload_bytes > 0
        assert metrics["sync/changed_fraction"] == sent.stats.changed_fraction


@dataclasses.dataclass(frozen=True)
class HalfSolvedTask(StopTask):
    """Prompts "a+b=": a < 5 scores 0 whatever the completion (an all-equal group, no signal);
    otherwise 1 for an even-length completion (mixed groups)."""

    name: str = "half"

    def score(self, prompt, completion):
        return 0.0 if int(prompt[0]) < 5 else float(len(completion) % 2 == 0)


def test_dynamic_sampling_refills_the_rollout_with_groups_that_have_signal(meshes):
    task = HalfSolvedTask()
    trainer = _trainer(meshes, task=task, filter_groups=True, max_num_gen_batches=0)
    state = trainer.init_state(_params(trainer))
    batch, stats = trainer.generate_with_stats(state)
    cfg = trainer.config
    assert batch.rewards.shape == (cfg.rollout_size,) and len(batch.tokens) == cfg.rollout_size
    groups = batch.rewards.reshape(cfg.prompts_per_rollout, cfg.group_size)
    assert np.all(groups.std(axis=1) > 0)  # every kept group has signal
    # about half the prompts are all-zero groups, so more than one generation batch was needed
    assert stats["batch/num_gen_batches"] > 1 and stats["batch/kept_group_fraction"] < 1
    unfiltered = trainer.worker.generate(trainer.rollout_params(state),
                                         trainer.rollout_prompts(0), trainer._keys(state, 0)[0])
    assert unfiltered.rewards.shape == (cfg.rollout_size,)
    assert np.any(unfiltered.rewards.reshape(-1, cfg.group_size).std(axis=1) == 0)
    # generation batch 0 is the unfiltered rollout: its groups with signal lead the batch
    kept = np.flatnonzero(unfiltered.rewards.reshape(-1, cfg.group_size).std(axis=1) > 0)
    np.testing.assert_array_equal(batch.tokens[:len(kept) * cfg.group_size],
                                  unfiltered.tokens.reshape(-1, cfg.group_size,
                                                            cfg.max_new_tokens)[kept]
                                  .reshape(-1, cfg.max_new_tokens))


def test_overlong_shaping_adds_the_length_penalty_to_the_score(meshes):
    plain = _trainer(meshes, task=StopTask())
    shaped = _trainer(meshes, task=StopTask(), overlong_buffer=OverlongBufferConfig(len=2))
    params = _params(plain)
    a = plain.generate(plain.init_state(params))
    b, stats = shaped.generate_with_stats(shaped.init_state(params))
    np.testing.assert_array_equal(a.tokens, b.tokens)  # same samples: shaping is reward-side
    # max_new_tokens 3, buffer 2: length 1 -> 0, 2 -> -0.5, 3 -> -1
    lengths = b.mask.sum(axis=1)
    np.testing.assert_allclose(b.rewards - a.rewards, np.select(
        [lengths == 1, lengths == 2, lengths == 3], [0.0, -0.5, -1.0], np.nan))
    assert len(set(lengths.tolist())) > 1 and stats["critic/score/mean"] == pytest.approx(a.rewards.mean())


def test_rs_rejection_equals_removing_the_tokens_from_the_mask(meshes):
    # RS rejects every token of rows 0 and 3 (pi_old / mu = e^-5 < 0.5): the policy loss, the
    # KL and the entropy terms must equal those of the same loss (RS finding nothing to reject,
    # mu = pi_old) on a mask without those rows
    trainer = _trainer(meshes, kl_coef=0.1, entropy_coef=0.05,
                       loss=PolicyLossConfig(correction="rs"))
    state = trainer.init_state(_params(trainer))
    mb = trainer.minibatches(trainer.generate(state))[0]
    params, ref = state["policy"].params, _params(trainer, seed=3)
    old = trainer._old_stats(params, ref, mb)
    reject = np.zeros(mb.mask.shape[0], bool)
    reject[[0, 3]] = True
    loss_fn = jax.jit(functools.partial(grpo_loss, fns=trainer.fns, config=trainer.config))
    rejected = jax.device_get(loss_fn(params, mb._replace(
        behaviour_logp=jnp.where(reject[:, None], old.logp + 5.0, old.logp)), old,
        key=jax.random.key(0)))[1]
    masked = jax.device_get(loss_fn(params, mb._replace(
        behaviour_logp=old.logp, mask=mb.mask * (~reject[:, None])), old,
        key=jax.random.key(0)))[1]
    assert rejected["rs_masked_fraction"] == pytest.approx(
        float(mb.mask[reject].sum() / mb.mask.sum())) and masked["rs_masked_fraction"] == 0
    for k in ("loss", "policy_loss", "kl", "entropy"):
        np.testing.assert_allclose(rejected[k], masked[k], rtol=1e-6, err_msg=k)
    assert rejected["kl"] > 0


def test_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="lag=3 must divide"):
        dataclasses.replace(BASE, lag=3)
    with pytest.raises(ValueError, match="noise"):
        dataclasses.replace(BASE, mismatch="fp8")
    with pytest.raises(ValueError, match="kl_estimator"):
        dataclasses.replace(BASE, kl_estimator="k2")
    with pytest.raises(ValueError, match=r"overlong_buffer.len=4 exceeds max_new_tokens=3"):
        dataclasses.replace(BASE, overlong_buffer=OverlongBufferConfig(len=4))
    with pytest.raises(ValueError, match=r"gen_batch_size=8 applies with filter_groups=True"):
        dataclasses.replace(BASE, gen_batch_size=8)
    with pytest.raises(ValueError, match=r"filter_groups_metric='score'; valid"):
        dataclasses.replace(BASE, filter_groups_metric="score")
