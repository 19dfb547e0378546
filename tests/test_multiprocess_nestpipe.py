"""NestPipe as 2 real processes x 4 devices == 1 process x 8 devices (the same global mesh), every
pipeline, on tiny shapes: each process places, reads and writes back only its own devices'
owner buffers, the host thread's key routing launches at a fixed point of every process's
sequence (``pipelines.LaunchOrder``), and on the CPU the dense sums are an all-gather plus a
device-order sum (``device_stages.all_reduce_sum``), so every figure but the timings is
bit-identical; the same code path forced in one process equals the default one."""

import jax
import numpy as np
import pytest

from tests._multiprocess import single_and_two_processes

NAMES = ("sync", "sparse_dist", "dbp", "fwp", "dbp+fwp", "sync_accum", "semi_sync")
TINY = ["--set", "vocab_sizes=600,400,250,90", "--set", "multi_hot=3", "--set", "embed_dim=8",
        "--set", "bottom=16", "--set", "top=16", "--set", "batch_size=128",
        "--set", "micro_batches=2", "--set", "steps=3", "--set", "step_check_steps=1",
        "--set", "eval_batches=1", "--set", "warmup=1", "--set", "timing_steps=2",
        "--set", "pairs=1", "--set", "auto=false"]
#: every summary figure that is not a timing (or derived from one)
EXACT = ("final_train_loss_by_pipeline", "logloss_by_pipeline", "auc_by_pipeline",
         "max_param_diff_vs_sync", "max_leafwise_diff_vs_sync", "max_one_step_diff_vs_sync",
         "patched_rows_per_step", "owner_rows_per_step", "capacities", "frozen_exchange",
         "duplicate_transfer_reduction_by_method", "micro_batch_rows_moved")


@pytest.mark.multiprocess
def test_nestpipe_two_processes_equal_one(tmp_path):
    (s1, _), (s2, _) = single_and_two_processes(["--exp=nestpipe", "--variant=quick", *TINY],
                                                tmp_path)
    for key in EXACT:
        assert s1[key] == s2[key], key  # bit-identical
    assert set(s2["final_train_loss_by_pipeline"]) == set(NAMES)
    # the exact pipelines equal sync, the stale one does not (the comparison can fail)
    assert all(s2["max_param_diff_vs_sync"][p] == 0.0 for p in ("sparse_dist", "dbp"))
    assert s2["max_param_diff_vs_sync"]["semi_sync"] > 1e-3
    assert s2["patched_rows_per_step"]["dbp"] > 0  # the dual-buffer patch ran across processes
    assert set(s2["step_seconds"]) == set(NAMES)


def test_forced_multiprocess_path_equals_default_in_one_process():
    """The multi-process path (per-shard placement, replicated routing outputs, the launch
    order, the table merge) run in one process: the two threaded schedules' states after 2
    steps equal the default path's, bit for bit (seconds; no gloo)."""
    import dataclasses

    from configs.nestpipe import Config
    from jaxflow.nestpipe import NestPipeSystem
    from jaxflow.nestpipe.exactness import snapshot
    from jaxflow.nestpipe.model import resolve_meshes
    from jaxflow.nestpipe.sharded import MeshStages
    from jaxflow.nestpipe.system import NestPipeRuntime

    cfg = Config(vocab_sizes=(60, 40, 25, 9), multi_hot=3, embed_dim=8, bottom=(16,), top=(16,),
                 batch_size=64, micro_batches=2, steps=2)
    state0 = NestPipeSystem().init(cfg, resolve_meshes(cfg))
    rt = state0.runtime
    forced_stages = {key: MeshStages(
        rt.specs, base.mesh, base.optimizer, rt.apply, batch_size=cfg.batch_size,
        multi_hot=cfg.multi_hot, micro_batches=base.n, capacity=base.capacity,
        bucket_capacity=base.bucket_capacity, owner_capacity=base.owner_capacity,
        frozen_exchange=base.frozen_exchange, pooling_backend=cfg.pooling_backend,
        multiprocess=True) for key, base in rt.stages.items()}
    forced = dataclasses.replace(state0, runtime=NestPipeRuntime(cfg, rt.mesh, rt.gen, rt.specs,
                                                                 rt.apply, forced_stages))
    for pipeline in ("sparse_dist", "dbp"):
        base, other = rt.stages_for(pipeline), forced.runtime.stages_for(pipeline)
        assert other.multiprocess and not base.multiprocess
        s1, st1 = NestPipeSystem(pipeline).train(state0, 2)
        s2, st2 = NestPipeSystem(pipeline).train(forced, 2)
        assert st1["losses"] == st2["losses"], pipeline
        a, b = jax.tree.leaves(snapshot(s1)), jax.tree.leaves(snapshot(s2))
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), pipeline
