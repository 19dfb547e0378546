"""GRPOSystem: the GRPO trainer as a System (typed frozen state, pure step keyed per rollout).

It must log the rows of :class:`jaxflow.rl.grpo.GRPOTrainer` bit for bit (same stream), its
state must round-trip through a checkpoint and resume to the same state, and its programs are
built through public signatures.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.checkpoint import Checkpointer, abstract_like
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.rl.policy_loss import PolicyLossConfig
from jaxflow.rl.step_metrics import deterministic_fields
from jaxflow.rl.system import GRPOSetup, GRPOState, GRPOSystem
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.sync.replica import tree_digest
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.system import check_system, is_system_state
from jaxflow.train.lm_state import OptimConfig, init_params
from tests._cli import persistent_compile_cache

MODEL = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=64, max_seq_len=32)
RL = GRPOConfig(prompts_per_rollout=4, group_size=4, max_new_tokens=3, sis_topk=4, lag=2,
                kl_coef=0.1, loss=PolicyLossConfig(correction="sis"))


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The tests build the same system's programs again (each test's own init and step, the
    trainer beside it, sync on or off): each program with the same HLO is compiled once and
    loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


@pytest.fixture(scope="module")
def meshes():
    return role_meshes({"trainer": 4, "rollout": 4})


def _setup(**overrides):
    return dataclasses.replace(
        GRPOSetup(MODEL, RL, OptimConfig(lr=3e-3, warmup_steps=0), AdditionRLTask(max_digits=1),
                  CharTokenizer(), seed=3, total_rollouts=4, sync=SyncConfig(codec="coo"),
                  eval_prompts=4, eval_samples=2), **overrides)


def _keys(seed, n):
    return [jax.random.fold_in(jax.random.key(seed), r) for r in range(n)]


def test_system_is_a_system_with_a_typed_frozen_state(meshes):
    system = GRPOSystem()
    assert check_system(system, "GRPOSystem") == []
    state = system.init(_setup(), meshes, jax.random.key(0))
    assert isinstance(state, GRPOState) and is_system_state(state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.rollout = 1  # type: ignore[misc]
    assert state.reference is not None  # kl_coef > 0: the frozen copy
    with pytest.raises(ValueError, match="batch must be None"):
        system.step(state, {"tokens": np.zeros(3)}, key=jax.random.key(0))


def test_system_rows_and_state_equal_the_trainers(meshes):
    system, setup = GRPOSystem(), _setup()
    trainer = system.trainer(setup, meshes)
    params = init_params(trainer.fns, MODEL, jax.random.key(7))
    state = system.init(setup, meshes, jax.random.key(0), params=params)
    tstate = trainer.init_state(jax.tree.map(jnp.copy, params))
    rows, trows = [], []
    for key in _keys(setup.seed, 1):
        state, m = system.step(state, None, key=key)
        tstate, tm, sent = trainer.step_with_sync(tstate)
        rows.append(m)
        trows.append({**tm, **({"sync/dense_bytes": float(sent.stats.dense_bytes)} if sent else {})})
    assert [deterministic_fields(r) for r in rows] == [deterministic_fields(r) for r in trows]
    assert "sync/dense_bytes" in rows[0]
    assert int(state.rollout) == 1 and int(state.policy.step) == RL.lag
    assert tree_digest(state.policy.params) == tree_digest(tstate["policy"].params)
    pass1 = system.evaluate(state)["heldout_pass_at_1"]
    assert pass1 == trainer.heldout_accuracy(tstate, 4, samples=2)


def test_checkpointed_state_resumes_to_the_same_state(meshes, tmp_path):
    system, setup = GRPOSystem(), _setup(sync=None)
    keys = _keys(setup.seed, 2)
    state = system.init(setup, meshes, jax.random.key(1))
    for key in keys:
        state, _ = system.step(state, None, key=key)
    state2 = system.init(setup, meshes, jax.random.key(1))
    state2, _ = system.step(state2, None, key=keys[0])
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=1)
    ckpt.save(1, state2, force=True)
    ckpt.wait()
    template = system.init(setup, meshes, jax.random.key(5))  # another start, as a new process
    restored = Checkpointer(tmp_path / "ckpt").restore(1, abstract_like(template))
    assert isinstance(restored, GRPOState) and int(restored.rollout) == 1
    for key in keys[1:]:
        restored, _ = system.step(restored, None, key=key)
    assert tree_digest(restored.policy) == tree_digest(state.policy)
    assert tree_digest(restored.published) == tree_digest(state.published)


def test_programs_are_the_steps_programs(meshes):
    names = [p.name for p in GRPOSystem().programs(_setup(), meshes)]
    assert names == ["trainer/old_stats", "trainer/update", "rollout/sample", "sync/cast_and_count",
                     "sync/compact_largest_leaf", "sync/replica_scatter_largest_leaf"]
