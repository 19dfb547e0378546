"""SparseRL-Sync's device programs with abstract arguments, for ``--compile-only``.

:func:`sync_programs` returns what one publish runs on the devices: the sender's cast to bf16
and changed-element count over the whole tree (:mod:`jaxflow.sync.device_diff`) and the
in-mesh compaction of the largest leaf (:mod:`jaxflow.sync.tracker`) on the trainer mesh, then
the replica's scatter of that leaf's changes (:mod:`jaxflow.sync.receiver`) on the rollout mesh.
Nothing is allocated.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program
from jaxflow.sync import device_diff, receiver, tracker

__all__ = ["CHANGED_FRACTION", "sync_programs"]

#: The changed fraction of a leaf's bf16 bit patterns per publish the sync programs are sized
#: for (the compaction capacity): an assumption, about 2x the flagship's measured ~1-3% per
#: rollout at lr 1e-4 (experiments/README.md, flagship).
CHANGED_FRACTION = 0.05


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def sync_programs(params: Any, shardings: Any, rollout_shardings: Any, trainer_mesh: Mesh,
                  rollout_mesh: Mesh, *, prefix: str = "",
                  changed_fraction: float = CHANGED_FRACTION) -> list[Program]:
    """[cast + count, compact largest leaf, replica scatter of that leaf] for publishing the
    trainer's ``params`` (a tree of ``jax.ShapeDtypeStruct``, laid out by ``shardings`` on
    ``trainer_mesh``) to a bf16 replica laid out by ``rollout_shardings`` on ``rollout_mesh``;
    the compaction and scatter are sized for ``changed_fraction`` of the leaf's elements
    changed. Named ``prefix + "sync/cast_and_count"`` etc."""
    tm, rm = trainer_mesh, rollout_mesh
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
    capacity = device_diff.capacity_for(int(local * changed_fraction))
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
                            f"per shard ({changed_fraction:.0%} changed assumed)"))
    r_sh = jax.tree.leaves(rollout_shardings)[big]
    kernel_scatter = _sharded_scatter_program(prefix, leaf.shape, r_sh, rm, changed_fraction)
    if kernel_scatter is not None:
        return out + [kernel_scatter]
    changes = receiver._capacity(int(math.prod(leaf.shape) * changed_fraction))
    rep = NamedSharding(rm, P())
    index = tuple(_sds((changes,), jnp.int32, rep) for _ in leaf.shape)
    scatter = functools.partial(receiver._device_scatter, delta=True, gathered=None, kept=None)
    out.append(Program(prefix + "sync/replica_scatter_largest_leaf", jax.jit(scatter),
                       (_sds(leaf.shape, jnp.bfloat16, r_sh), index,
                        _sds((changes,), jnp.uint16, rep)), rm, kind="sync", tokens=changes,
                       note=f"{changes} bf16 deltas scattered into the replica's leaf"))
    return out


def _sharded_scatter_program(prefix: str, shape: tuple[int, ...], sharding, rm: Mesh,
                             changed_fraction: float) -> Program | None:
    """The replica scatter as a multi-chip replica runs it where ``auto`` takes the kernel
    (``receiver.apply``: ``sync_scatter_apply`` per shard in a shard_map, each device on its
    own update list of ``changed_fraction`` of its shard); None where it would not."""
    if not isinstance(sharding, NamedSharding) or rm.devices.size < 2:
        return None
    local = sharding.shard_shape(tuple(shape))
    capacity = receiver._capacity(int(math.prod(local) * changed_fraction))
    # the verdict as a run takes it: the kernel alone on one device of the replica's chip
    with jax.set_mesh(Mesh(np.asarray(rm.devices.flat[:1]), ("_chip",))):
        if not receiver._use_scatter_kernel("auto", local, capacity, False):
            return None
    rows = NamedSharding(rm, P(*rm.axis_names, None))
    lists = rm.devices.shape + (capacity,)
    fn = functools.partial(receiver._sharded_kernel_scatter, mesh=rm, spec=sharding.spec,
                           delta=True, interpret=False)
    return Program(prefix + "sync/replica_scatter_largest_leaf", jax.jit(fn),
                   (_sds(shape, jnp.bfloat16, sharding), _sds(lists, jnp.int32, rows),
                    _sds(lists, jnp.uint16, rows)), rm, kind="sync",
                   tokens=capacity * rm.devices.size,
                   note=f"{capacity} bf16 deltas per device scattered into its shard {local} "
                        "of the replica's leaf by the Pallas kernel (no collective)")
