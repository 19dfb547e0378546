"""The jitted programs of one GRPO trainer, with abstract arguments, for ``--compile-only``.

:func:`grpo_programs` takes a constructed :class:`jaxflow.rl.grpo.GRPOTrainer` (constructing one
allocates nothing: its jitted functions and shardings only) and returns the programs one RL
step runs, each the trainer's own jitted function: pi_old's statistics and the update on the
trainer mesh, the sampler on the rollout mesh (the static prefill + decode scan, or with
``rl.sampler=engine`` the paged engine's prefill and decode calls on the published weights:
:func:`jaxflow.rollout.programs.engine_programs`), and SparseRL-Sync's
device diff (cast + count over the whole tree, then the in-mesh compaction of the largest leaf)
and the replica's scatter of that leaf's changes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program, count_params, transformer_train_flops
from jaxflow.rl.grpo_step import MiniBatch, OldStats
from jaxflow.rl.rollout import batch_sharding
from jaxflow.train.state import TrainState

#: The changed fraction of a leaf's bf16 bit patterns per publish the sync programs are sized
#: for (the compaction capacity): an assumption, about 2x the flagship's measured ~1-3% per
#: rollout at lr 1e-4 (experiments/README.md, flagship).
CHANGED_FRACTION = 0.05


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _sharding_note(mesh) -> str:
    shape = dict(mesh.shape)
    tp = shape.get("model", 1)
    return (" x ".join(f"{k} {v}" for k, v in shape.items())
            + (": TP over heads / kv heads / mlp / vocab" if tp > 1 else ": data parallel"))


def grpo_programs(trainer, *, prefix: str = "") -> list[Program]:
    """[old_stats, update, sample, sync cast+count, sync compact, replica scatter] of
    ``trainer`` (a GRPOTrainer), named ``prefix + "trainer/update"`` etc."""
    cfg, fns = trainer.config, trainer.fns
    tm, rm = trainer.trainer_mesh, trainer.rollout_mesh
    model = trainer.model_cfg
    params = fns.abstract_params()
    n_params = count_params(params)
    policy = TrainState.abstract(trainer.tx, params, fns.param_shardings)
    b, n = cfg.minibatch_size, cfg.max_new_tokens
    width = trainer.worker.prompt_width
    k = min(cfg.sis_topk, model.vocab_size)
    row = batch_sharding(tm, b)
    f32, i32 = jnp.float32, jnp.int32
    mb = MiniBatch(_sds((b, width), i32, row), _sds((b,), i32, row), _sds((b, n), i32, row),
                   _sds((b, n), f32, row), _sds((b, n), f32, row), _sds((b,), f32, row))
    old = OldStats(_sds((b, n), f32, row), _sds((b, n, k), f32, row),
                   _sds((b, n, k), i32, row), _sds((b, n), f32, row))
    rep_t = NamedSharding(tm, P())
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = _sds(key.shape, key.dtype, rep_t)
    ref = params if cfg.kl_coef > 0 else None
    seq = width + n
    d_attn = model.n_heads * model.head_dim
    train_flops = transformer_train_flops(n_params, b * seq, n_layers=model.n_layers,
                                          seq_len=seq, d_attn=d_attn)
    note_t, note_r = _sharding_note(tm), _sharding_note(rm)
    programs = [
        Program(prefix + "trainer/old_stats", trainer._old_stats, (policy.params, ref, mb), tm,
                kind="forward", model_flops=train_flops / 3, tokens=b * seq, note=note_t),
        Program(prefix + "trainer/update", trainer._update, (policy, mb, old), tm,
                kwargs={"key": key}, kind="train", model_flops=train_flops, tokens=b * seq,
                note=note_t),
    ]
    worker = trainer.worker
    rows = cfg.prompts_per_gen_batch * cfg.group_size
    rrow = batch_sharding(rm, rows)
    # what the run hands the sampler: the published params on the rollout mesh (f32 leaves:
    # a synced replica's bf16 values upcast, exact)
    state = worker._sampler_fns.nnx_state(worker.fns.abstract_params())
    rkey = _sds(key.shape, key.dtype, NamedSharding(rm, P()))
    sample_flops = 2.0 * n_params * rows * seq + 2.0 * model.n_layers * rows * seq * seq * d_attn
    if worker.spec.sampler == "engine":  # the paged engine's prefill and decode calls
        from jaxflow.rollout.programs import engine_programs

        engine_cfg = worker.spec.engine.engine_config(rows, width, n)
        programs += engine_programs(worker._sampler_cfg, rm, engine_cfg, worker._sampling,
                                    prompt_len=width, param_dtype=None,
                                    prefix=prefix + "rollout/engine/")
    else:
        programs.append(Program(
            prefix + "rollout/sample", worker._sample,
            (state, _sds((rows, width), i32, rrow), _sds((rows,), i32, rrow), rkey), rm,
            kind="sample", model_flops=sample_flops, tokens=rows * n,
            note=note_r + f"; prefill + {n - 1}-step decode scan, {rows} sequences"))
    if trainer.sync_config is not None:
        programs += _sync_programs(params, fns.param_shardings, worker.param_shardings, tm, rm,
                                   prefix)
    return programs


def _sync_programs(params, shardings, rollout_shardings, tm, rm, prefix) -> list[Program]:
    from jaxflow.sync import device_diff, receiver, tracker

    leaves = jax.tree.leaves(params)
    sh_leaves = jax.tree.leaves(shardings)
    snapshot = tuple(_sds(a.shape, jnp.bfloat16 if jnp.issubdtype(a.dtype, jnp.floating)
                          else a.dtype, s) for a, s in zip(leaves, sh_leaves))
    new = tuple(_sds(a.shape, a.dtype, s) for a, s in zip(leaves, sh_leaves))
    total = sum(math.prod(a.shape) for a in leaves)
    out = [Program(prefix + "sync/cast_and_count", device_diff._cast_and_count, (snapshot, new),
                   tm, kind="sync", tokens=total,
                   note="every leaf cast to bf16 and its changed elements counted on its shards")]
    big = max(range(len(leaves)), key=lambda i: math.prod(leaves[i].shape))
    leaf, sharding = leaves[big], sh_leaves[big]
    local = math.prod(sharding.shard_shape(tuple(leaf.shape)))
    capacity = device_diff.capacity_for(int(local * CHANGED_FRACTION))
    # the verdict as a run takes it: the kernel alone on one device of the trainer's chip
    # (inside the compaction's shard_map each device compacts its own shard)
    with jax.set_mesh(Mesh(np.asarray(tm.devices.flat[:1]), ("_chip",))):
        kernel = device_diff._use_kernel("auto", local, capacity, False, single_device=True)
    compact = tracker.shard_compact_fn(tm, sharding.spec, tuple(leaf.shape), capacity,
                                       "pallas" if kernel else "xla", False)
    bf16 = (_sds(leaf.shape, jnp.bfloat16, sharding),) * 2
    out.append(Program(prefix + "sync/compact_largest_leaf", compact, bf16, tm, kind="sync",
                       tokens=math.prod(leaf.shape),
                       note=f"leaf {tuple(leaf.shape)} spec {sharding.spec}; capacity {capacity} "
                            f"per shard ({CHANGED_FRACTION:.0%} changed assumed)"))
    r_sh = jax.tree.leaves(rollout_shardings)[big]
    changes = receiver._capacity(int(math.prod(leaf.shape) * CHANGED_FRACTION))
    rep = NamedSharding(rm, P())
    index = tuple(_sds((changes,), jnp.int32, rep) for _ in leaf.shape)
    scatter = functools.partial(receiver._device_scatter, delta=True, gathered=None, kept=None)
    out.append(Program(prefix + "sync/replica_scatter_largest_leaf", jax.jit(scatter),
                       (_sds(leaf.shape, jnp.bfloat16, r_sh), index,
                        _sds((changes,), jnp.uint16, rep)), rm, kind="sync", tokens=changes,
                       note=f"{changes} bf16 deltas scattered into the replica's leaf"))
    return out
