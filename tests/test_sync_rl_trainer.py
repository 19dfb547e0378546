"""The GRPO trainer's own weight sync: bf16 replica serves every rollout (bit-exact to the
trainer's bf16 cast), ``sync.every`` in rollouts, the per-rollout version check, CLI config and
bit-exact resume. Trainer and rollout on disjoint sub-meshes of the 8 fake CPU devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.checkpoint import Checkpointer, abstract_like
from jaxflow.config import ConfigError, apply_overrides
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.mesh import role_meshes
from jaxflow.rl.grpo import GRPOTrainer
from jaxflow.rl.step_metrics import deterministic_fields
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.sync import CODECS, Replica, SyncConfig, VersionMismatch, to_bf16, tree_digest
from jaxflow.sync.transport.inprocess import InProcessLink
from jaxflow.train.lm_state import OptimConfig, init_params
from tests._cli import persistent_compile_cache
from tests.test_rl_grpo import BASE, MODEL


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """Each test's trainer jits its programs anew (codecs and checks differ, the update does
    not): each program with the same HLO is compiled once and loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


@pytest.fixture(scope="module")
def meshes():
    return role_meshes({"trainer": 4, "rollout": 4})


def _trainer(meshes, sync, **overrides):
    # entropy bonus: a random-init policy earns no reward, the bonus still moves the weights;
    # lag 2 everywhere so the tests share one compilation
    cfg = dataclasses.replace(BASE, **{"entropy_coef": 0.05, "lag": 2, **overrides})
    return GRPOTrainer(MODEL, cfg, OptimConfig(lr=3e-3, warmup_steps=0),
                       AdditionRLTask(max_digits=1), CharTokenizer(), meshes, seed=0,
                       total_rollouts=8, sync=sync)


def _params(trainer, seed=0):
    return init_params(trainer.fns, MODEL, jax.random.key(seed))


def _bf16_digest(tree) -> str:
    return tree_digest(to_bf16(tree))


def test_rollouts_sample_the_trainer_bf16_cast_at_every_sync(meshes):
    trainer = _trainer(meshes, SyncConfig(codec="entropy"))
    state = trainer.init_state(_params(trainer))
    casts = {0: _bf16_digest(state["policy"].params)}
    f32 = {0: tree_digest(state["policy"].params)}
    for r in range(2):
        version = r * 2  # every=1: synced after every rollout, at the trainer's step count
        served = trainer.rollout_params(state)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(served))
        assert _bf16_digest(served) == casts[version]  # bf16 values, upcast exactly
        # the test could fail: the trainer's f32 weights are not bf16-representable
        assert tree_digest(served) != f32[version]
        if r == 1:  # generate really samples from the served replica
            batch = trainer.generate(state)
            key, _ = trainer._keys(state, r)
            want = trainer.worker.generate(served, trainer.rollout_prompts(r), key, version=version)
            assert all(np.array_equal(a, b) for a, b in zip(batch, want))
        state, metrics = trainer.step(state)
        assert metrics["version/sampler"] == version and metrics["sync/synced"] == 1.0
        assert metrics["sync/bit_exact"] == 1.0 and 0 < metrics["sync/changed_fraction"] < 1
        rec = trainer.weight_sync.records[-1]
        assert rec.bit_exact and rec.stats.version == (r + 1) * 2
        casts[(r + 1) * 2] = _bf16_digest(state["policy"].params)
        f32[(r + 1) * 2] = tree_digest(state["policy"].params)
        assert trainer.weight_sync.replicas[0].digest() == casts[(r + 1) * 2]
    assert len(set(casts.values())) == len(casts)  # every sync changed the bf16 weights


def test_every_two_rollouts_between_syncs_sample_the_older_version(meshes):
    trainer = _trainer(meshes, SyncConfig(codec="auto", every=2))
    state = trainer.init_state(_params(trainer))
    casts = {0: _bf16_digest(state["policy"].params)}
    seen = []
    for r in range(4):
        served = _bf16_digest(trainer.rollout_params(state))
        state, m = trainer.step(state)
        seen.append((m["version/sampler"], m["version/trainer"], m["sync/synced"]))
        assert served == casts[m["version/sampler"]]
        casts[(r + 1) * 2] = _bf16_digest(state["policy"].params)
    # every counts rollouts (2 optimizer steps each): syncs after rollouts 2 and 4, at versions
    # 4 and 8; the 2nd and 4th rollouts still sample the last synced version (0, then 4) while
    # the trainer is at 2, then 6
    assert seen == [(0, 0, 0.0), (0, 2, 1.0), (4, 4, 0.0), (4, 6, 1.0)]
    assert casts[2] != casts[0] and casts[6] != casts[4]  # the skipped versions did differ
    assert trainer.weight_sync.version == 8 == int(state["published_version"][0])


class FailOnce:
    """A link whose next sync dies before anything is delivered (a dropped connection)."""

    def __init__(self, link):
        self.link, self.armed = link, True

    def status(self):
        return self.link.status()

    def sync(self, plan):
        if self.armed:
            self.armed = False
            raise OSError("connection reset (injected)")
        return self.link.sync(plan)


@pytest.mark.parametrize("on_mismatch", ["resync", "error"])
def test_version_check_catches_a_replica_that_fell_behind(meshes, on_mismatch):
    trainer = _trainer(meshes, SyncConfig(codec="entropy", on_mismatch=on_mismatch))
    state = trainer.init_state(_params(trainer))
    ws = trainer.weight_sync
    old = ws.replicas[0].params  # version 0, bf16 on the rollout mesh
    if on_mismatch == "resync":
        # a sync that fails mid-fan-out: the replica stays at 0, the check catches it up
        ws.links[0] = FailOnce(ws.links[0])
        state, m = trainer.step(state)
        rec = ws.records[-1]
        assert not rec.report[0]["ok"] and "injected" in rec.report[0]["error"]
        assert ws.replicas[0].version == 2
        assert ws.replicas[0].digest() == _bf16_digest(state["policy"].params)
    else:
        state, m = trainer.step(state)
    assert m["version/sampler"] == 0
    # the serving replica restarts from an old snapshot (version 0) after the sync to 2
    ws.replicas[0] = Replica(old, version=0)
    ws.links[0] = InProcessLink(ws.replicas[0])
    if on_mismatch == "error":
        with pytest.raises(VersionMismatch, match="at version 0, the trainer published 2"):
            trainer.step(state)
        return
    want = _bf16_digest(state["policy"].params)
    assert _bf16_digest(trainer.rollout_params(state)) == want  # caught up by the check
    assert ws.sender.routes[-1] == "chain" and ws.replicas[0].version == 2
    state, m = trainer.step(state)
    assert m["version/sampler"] == 2 and m["sync/bit_exact"] == 1.0


def test_staleness_with_sync_is_rejected_naming_the_values(meshes):
    with pytest.raises(ValueError, match="sync.codec='entropy' with staleness=2"):
        _trainer(meshes, SyncConfig(codec="entropy"), staleness=2)
    _trainer(meshes, None, staleness=2)  # sync off: the dense queue


def test_cli_overrides_set_the_sync_sub_config(capsys):
    from configs import sis_offpolicy, sparse_sync
    from jaxflow.run import main

    cfg = apply_overrides(sis_offpolicy.get_config("quick"),
                          ["sync.codec=entropy", "sync.every=4"])
    assert cfg.sync == SyncConfig(codec="entropy", every=4)
    assert sis_offpolicy.get_config("quick").sync is None  # default: dense publish
    cfg = apply_overrides(cfg, ["sync=none"])  # and back off
    assert cfg.sync is None
    cfg = apply_overrides(sparse_sync.get_config("quick"), ["sync.codec=gap", "sync.every=4"])
    assert cfg.sync.codec == "gap" and cfg.sweep == (4,)
    assert sparse_sync.get_config("quick").sweep == (1, 4, 16)
    with pytest.raises(ConfigError, match="sync.codec='zip'.*valid.*'entropy'"):
        apply_overrides(sis_offpolicy.get_config("quick"), ["sync.codec=zip"])
    with pytest.raises(ConfigError, match="stalenesses"):
        apply_overrides(sis_offpolicy.get_config("full"), ["sync.codec=entropy"])
    with pytest.raises(ConfigError, match="sync.codec='none'.*set sync=none"):
        apply_overrides(sparse_sync.get_config("quick"), ["sync.codec=none"])
    with pytest.raises(ConfigError, match="--set sync: is a group; set one of bound, codec"):
        apply_overrides(sparse_sync.get_config("quick"), ["sync=none"])  # not optional there
    assert main(["--exp=sis_offpolicy", "--variant=quick", "--set", "sync.codec=zip"]) == 2
    err = capsys.readouterr().err
    assert "sync.codec='zip'" in err and all(c in err for c in CODECS), err


def test_resume_with_sync_between_syncs_is_bit_identical(meshes, tmp_path):
    # every=2 with 2 optimizer steps per rollout: the checkpoint after rollout 1 holds the
    # replica at version 0 while the trainer is at step 2, so the resumed trainer must rebuild
    # its replica from the checkpointed rollout params, not from the trainer's params; the
    # next sync (version 4) is then encoded against the rebuilt sender's snapshot.
    sync = SyncConfig(codec="entropy", every=2)
    trainer = _trainer(meshes, sync)
    params = _params(trainer)

    state = trainer.init_state(params)
    straight = []
    for _ in range(3):
        state, m = trainer.step(state)
        straight.append(m)
    want = tree_digest(state)
    assert [m["version/sampler"] for m in straight] == [0, 0, 4]

    state = trainer.init_state(params)
    state, _ = trainer.step(state)
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=1)
    ckpt.save(1, state, force=True)
    ckpt.wait()
    fresh = _trainer(meshes, sync)  # a new trainer, as in a new process
    template = fresh.init_state(_params(fresh, seed=5))
    restored = Checkpointer(tmp_path / "ckpt").restore(1, abstract_like(template))
    assert {x.dtype for x in jax.tree.leaves(restored["published"][0])} == {jnp.dtype("bfloat16")}
    resumed = []
    for _ in range(2):
        restored, m = fresh.step(restored)
        resumed.append(m)
    assert tree_digest(restored) == want  # whole state incl. the bf16 rollout params
    # incl. sync payload bytes and changed fraction (timing_s/* and perf/* are measurements)
    assert [deterministic_fields(m) for m in resumed] == [deterministic_fields(m) for m in straight[1:]]
    assert fresh.weight_sync.version == 4 and fresh.weight_sync.records[-1].bit_exact
