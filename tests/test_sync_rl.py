"""RL integration: publish_weights through a WeightSync, the per-rollout version check, and a
tiny real GRPO run (the sparse_sync study's loop) whose rollouts are served by the trainer's own
synced bf16 replica, bit-exact each sync. The trainer's sync itself: test_sync_rl_trainer.py."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.sis_offpolicy import WARM_START
from configs.sparse_sync import Config
from jaxflow.bench.sparse_sync import run_interval
from jaxflow.experiment import standalone_context
from jaxflow.mesh import role_meshes
from jaxflow.rl.publish import publish_weights
from jaxflow.sync import SyncConfig, VersionMismatch, WeightSync, to_bf16, tree_digest
from jaxflow.train.lm_state import init_params, lm_functions
from tests.test_rl_grpo import MODEL
from tests.test_sync_transport import trainer_tree, trajectory


@pytest.fixture(scope="module")
def meshes():
    return role_meshes({"trainer": 4, "rollout": 4})


def _shardings(mesh):
    return jax.tree.map(lambda x: NamedSharding(mesh, P("data") if x.ndim == 2 else P()),
                        trainer_tree())


def test_publish_weights_through_sync_is_trainer_bf16_cast(meshes):
    shardings = _shardings(meshes["rollout"])
    ws = WeightSync(trainer_tree(), shardings, SyncConfig(codec="entropy", replicas=2))
    for v, tree in enumerate(trajectory(3), start=1):
        out = publish_weights(tree, shardings, sync=ws)
        assert ws.version == v and ws.records[-1].bit_exact
        assert tree_digest(out) == tree_digest(to_bf16(tree))
        assert out["layer"]["w"].sharding == shardings["layer"]["w"]
    dense = publish_weights(trajectory(1)[0], shardings)  # the old dense path is unchanged
    assert dense["layer"]["w"].dtype == np.float32


@pytest.mark.parametrize("on_mismatch", ["error", "resync"])
def test_rollout_version_check(meshes, on_mismatch):
    ws = WeightSync(trainer_tree(), _shardings(meshes["rollout"]),
                    SyncConfig(codec="auto", on_mismatch=on_mismatch))
    tree = trajectory(1)[0]
    ws.sender.publish(tree, version=1)  # published, but the replica never received it
    if on_mismatch == "error":
        with pytest.raises(VersionMismatch, match="at version 0, the trainer published 1"):
            ws.rollout_params()
    else:
        assert tree_digest(ws.rollout_params()) == tree_digest(to_bf16(tree))
        assert ws.replicas[0].version == 1


def test_sync_config_errors_name_the_key():
    with pytest.raises(ValueError, match="sync.codec='zip'"):
        SyncConfig(codec="zip")
    with pytest.raises(ValueError, match="sync.every=0"):
        SyncConfig(every=0)
    # no weight sync is sync=None in the RL configs, not a codec: the message says so
    with pytest.raises(ValueError, match=r"sync.codec='none'.*set sync=none"):
        SyncConfig(codec="none")


def test_tiny_grpo_run_syncs_bit_exactly(meshes):
    cfg = dataclasses.replace(
        Config(), pretrain=dataclasses.replace(WARM_START, model=MODEL), steps=2,
        intervals=(1,), codecs=("dense", "entropy"), sync=SyncConfig(codec="entropy"),
        tcp_replicas=0)
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(
        cfg.rl, prompts_per_rollout=4, group_size=4, max_new_tokens=3, sis_topk=4,
        entropy_coef=0.01))  # a random-init policy earns no reward: the bonus makes a gradient
    params = init_params(lm_functions(MODEL, meshes["trainer"]), MODEL, jax.random.key(0))
    run = standalone_context("sparse_sync", out_dir=None)
    try:
        rows = run_interval(1, cfg, run, meshes=meshes, warm_params=params)
    finally:
        run.close()
    assert [(r["step"], r["codec"]) for r in rows] == [
        (1, "entropy"), (1, "dense"), (2, "entropy"), (2, "dense")]
    assert all(r["bit_exact"] for r in rows)
    entropy = [r for r in rows if r["codec"] == "entropy"]
    assert all(0 < r["changed_fraction"] < 1 and r["ratio_vs_dense"] > 1 for r in entropy)
    assert all(r["bytes_over_bound"] >= 1 for r in entropy)  # no codec beats the bound
