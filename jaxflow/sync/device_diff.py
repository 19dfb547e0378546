"""The sender's diff on the device: cast, compare, compact, and send only the changes home.

SparseRL-Sync detects changes right after the fp32 -> bf16 cast by comparing bit patterns with
the last synced bf16 snapshot. Done on the host, that pulls the whole fp32 tree (4 bytes per
parameter) to numpy first. Here the trainer's leaves stay on their devices:

  1. one jitted pass casts every floating leaf to bf16 (the wire dtype; other leaves as they
     are) and counts, per leaf, the elements whose bits differ from the snapshot's;
  2. per changed bf16 leaf, a jitted compaction (``pallas_kernels.sync_diff_compact`` on
     GPU/TPU where ``pallas_kernels.dispatch`` says it builds, its XLA reference elsewhere)
     writes the changed flat positions (int32) and ONE uint16 value stream -- the new bit
     patterns for the coo / gap codecs, the differences new - old (mod 2**16) for entropy /
     auto -- into a static capacity (the count rounded up to 1/16 of its power of two), plus
     the two digest lanes' change (``jaxflow.sync.digest.device_lanes_delta``);
  3. only those arrays and the counts cross to the host (6 bytes per change, + 12.5% at most
     for the capacity), where ``encoder.encode_diffs`` makes the same payload bytes the host
     path makes. Changed non-bf16 leaves (step counters) are fetched whole, as the format
     carries them whole; a leaf that the ``auto`` codec sends dense is fetched only then.

    snapshot = cast_tree(params0)                      # bf16, on the trainer's devices
    diff = device_diff(snapshot, params, values="deltas")
    payload = encode_diffs(diff.treedef, diff.specs, diff.diffs, ...)
    snapshot = diff.new                                # the next publish's base

A leaf spread over several devices (a NamedSharding) is compacted shard by shard inside
``jax.shard_map`` (``ChangeTracker``'s in-mesh functions: each device compacts its own shard
into the same capacity, positions in the logical leaf), so no leaf is gathered; the host
merges the shards' sorted runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxflow.sync import bits, digest, tracker
from jaxflow.sync.codec_registry import sends_new_values
from jaxflow.sync.diff import LeafDiff, check_same_layout, tree_layout
from jaxflow.sync.payload import LeafSpec, Payload
from pallas_kernels import dispatch
from pallas_kernels.sync_diff_compact import diff_compact, diff_compact_reference

VALUE_MODES = ("new", "deltas", "both")
BACKENDS = ("auto", "xla", "pallas")
_MAX_POSITIONS = 2**31  # int32 positions


def values_for_codec(codec: str, with_bound: bool = False) -> str:
    """The value stream a codec needs: "new" (coo, gap), "deltas" (entropy, auto) or "both"
    (old and new bits: the entropy bound, which is defined on int32 differences)."""
    if with_bound:
        return "both"
    return "new" if sends_new_values(codec) else "deltas"


def capacity_for(count: int, minimum: int = 128) -> int:
    """Static compaction length for ``count`` changes: rounded up to a multiple of 1/16 of
    its power of two (< 12.5% slack, 8 compiled sizes per doubling), at least ``minimum``."""
    count = max(int(count), 1)
    step = max(1, (1 << (count - 1).bit_length()) // 16)
    return max(minimum, -(-count // step) * step)


def _wire_cast(x):
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _bit_view(x):
    """Unsigned view of a leaf's elements (same itemsize), for bit-pattern compares."""
    itemsize = np.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * itemsize}"))


@jax.jit
def cast_tree(params):
    """The wire-dtype copy of ``params`` on their devices: floating leaves as bf16."""
    return jax.tree.map(_wire_cast, params)


@jax.jit
def _cast_and_count(snapshot_leaves: tuple, param_leaves: tuple):
    new = tuple(_wire_cast(x) for x in param_leaves)
    counts = [jnp.sum(_bit_view(o) != _bit_view(n), dtype=jnp.int32)
              for o, n in zip(snapshot_leaves, new)]
    return new, jnp.stack(counts) if counts else jnp.zeros((0,), jnp.int32)


@functools.partial(jax.jit, static_argnames=("capacity", "values", "kernel", "interpret"))
def _compact_leaf(old, new, *, capacity: int, values: str, kernel: bool, interpret: bool):
    old_b = jax.lax.bitcast_convert_type(old, jnp.uint16).reshape(-1)
    new_b = jax.lax.bitcast_convert_type(new, jnp.uint16).reshape(-1)
    if kernel:
        _, pos, o, n = diff_compact(old_b, new_b, capacity=capacity, interpret=interpret)
    else:
        _, pos, o, n = diff_compact_reference(old_b, new_b, capacity=capacity)
    lanes = digest.device_lanes_delta(pos, o, n)
    if values == "new":
        out = (n,)
    elif values == "deltas":
        out = ((n - o).astype(jnp.uint16),)  # uint16 arithmetic wraps mod 2**16
    else:
        out = (o, n)
    return pos, out, lanes


@dataclasses.dataclass(frozen=True)
class DeviceDiff:
    """One publish's changes, found on the device.

    Attributes:
      treedef, specs: the tree's layout (as ``diff.tree_layout``).
      new: the wire-dtype (bf16) tree, still on the devices: the next snapshot.
      diffs: one LeafDiff per leaf (positions int64 sorted; ``new_bits`` / ``deltas`` /
        ``old_bits`` as ``values`` asked; ``full_new`` for changed non-bf16 leaves; bf16
        leaves fetch themselves whole only through ``load_full``).
      lanes_delta: uint32[n_leaves, 2] change of every bf16 leaf's digest lanes (zero rows
        for other leaves, whose lanes the caller recomputes from ``full_new``).
      host_bytes: bytes this diff moved device -> host (counts, compacted arrays, lanes,
        whole non-bf16 leaves; not ``load_full`` fetches: see ``loaded_bytes``).
    """

    treedef: str
    specs: tuple[LeafSpec, ...]
    new: Any
    diffs: list[LeafDiff]
    lanes_delta: np.ndarray
    host_bytes: int


def loaded_bytes(diff: DeviceDiff, payload: Payload) -> int:
    """Bytes the encoder fetched whole through ``load_full`` to make ``payload`` from ``diff``.

    The encoder reads a leaf whole exactly when it carries it whole (a "dense" or "exact"
    section: the ``dense`` codec, ``auto``'s dense fallback); of those, the leaves whose diff
    has no ``full_new`` came through ``load_full``. So the count follows from the payload (no
    counter in the loaders). ``diff.host_bytes + loaded_bytes(diff, payload)`` is everything
    the publish moved device -> host."""
    total = 0
    for section in payload.sections:
        if section.kind not in ("dense", "exact"):
            continue
        for i in section.leaves:
            if diff.diffs[i].full_new is None and diff.diffs[i].load_full is not None:
                spec = diff.specs[i]
                total += np.dtype(spec.dtype).itemsize * spec.size
    return total


@functools.partial(jax.jit, static_argnames=("values",))
def _finish_shards(pos, old, new, *, values: str):
    """Value stream and lanes change of the in-mesh compaction's (pos, old, new) slots."""
    lanes = digest.device_lanes_delta(pos, old, new)
    if values == "new":
        return pos, (new,), lanes
    if values == "deltas":
        return pos, ((new - old).astype(jnp.uint16),), lanes
    return pos, (old, new), lanes


def _in_mesh(leaf) -> bool:
    return isinstance(leaf.sharding, NamedSharding) and len(leaf.sharding.device_set) > 1


def _owner_blocks(sharding: NamedSharding) -> list[int]:
    """Flat mesh positions of the devices that report their shard (index 0 on every mesh
    axis the leaf is not sharded over): the in-mesh compaction's other blocks are padding."""
    mesh = sharding.mesh
    used: set[str] = set()
    for entry in sharding.spec:
        used.update((entry,) if isinstance(entry, str) else (entry or ()))
    coords = np.indices(mesh.devices.shape).reshape(len(mesh.axis_names), -1)
    keep = np.ones(coords.shape[1], bool)
    for axis, name in enumerate(mesh.axis_names):
        if name not in used:
            keep &= coords[axis] == 0
    return np.flatnonzero(keep).tolist()


def _compact_sharded(old, new, *, values, backend, interpret, min_capacity):
    sharding = new.sharding
    old = jax.device_put(old, sharding)  # a no-op when the snapshot is laid out alike
    args = (sharding.mesh, sharding.spec, tuple(new.shape))
    per_shard = np.asarray(jax.device_get(tracker.shard_count_fn(*args)(old, new)))
    capacity = capacity_for(int(per_shard.max()), min_capacity)
    local = int(np.prod(sharding.shard_shape(tuple(new.shape))))
    kernel = _use_kernel(backend, local, capacity, interpret, single_device=True)
    pos, o, n = tracker.shard_compact_fn(*args, capacity, "pallas" if kernel else "xla",
                                    interpret and kernel)(old, new)
    pos, vals, lanes = _finish_shards(pos, o, n, values=values)
    # only the reporting devices' blocks cross to the host (replicas hold -1 padding)
    owners = set(_owner_blocks(sharding))
    flat_devices = list(sharding.mesh.devices.flat)

    def blocks(x):
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        return [by_device[flat_devices[b]] for b in sorted(owners)]

    return (blocks(pos), [blocks(v) for v in vals], lanes), int(per_shard.nbytes)


def _use_kernel(backend: str, size: int, capacity: int, interpret: bool, *,
                single_device: bool) -> bool:
    if backend == "xla" or not single_device:
        return False
    if backend == "pallas" and interpret:
        return True
    shape = jax.ShapeDtypeStruct((size,), jnp.uint16)
    return dispatch.choose_kernel(
        "sync_diff_compact", backend, functools.partial(diff_compact, capacity=capacity),
        (shape, shape), options=(capacity,))


def device_diff(snapshot: Any, params: Any, *, values: str = "deltas", backend: str = "auto",
                interpret: bool = False, min_capacity: int = 16) -> DeviceDiff:
    """Casts ``params`` to the wire dtype and diffs it against ``snapshot`` on the devices.

    Args:
      snapshot: the last published wire-dtype tree (jax Arrays, e.g. from ``cast_tree``).
      params: the trainer's tree, same structure (floating leaves any float dtype).
      values: "new", "deltas" or "both" (see ``values_for_codec``).
      backend: "auto" (the Pallas compaction on GPU/TPU where it builds, XLA otherwise),
        "xla", or "pallas" (forced; ``KernelUnavailable`` where it does not build).
      interpret: run a forced Pallas kernel in interpret mode (CPU tests).
      min_capacity: smallest compaction length.
    Returns:
      A DeviceDiff; raises ValueError on a layout mismatch or a bf16 leaf of 2**31 or more
      elements (int32 positions).
    """
    if values not in VALUE_MODES:
        raise ValueError(f"values={values!r}; valid: {VALUE_MODES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; valid: {BACKENDS}")
    old_def, old_leaves, old_specs = tree_layout(snapshot)
    flat, treedef = jax.tree_util.tree_flatten(params)
    if str(treedef) != old_def or len(flat) != len(old_leaves):
        raise ValueError(f"params differ in structure from the snapshot: {treedef} vs {old_def}")
    new_leaves, counts = _cast_and_count(tuple(old_leaves), tuple(flat))
    new_tree = jax.tree_util.tree_unflatten(treedef, list(new_leaves))
    _, _, specs = tree_layout(new_tree)
    check_same_layout(old_specs, specs, old_def, str(treedef))
    counts = np.asarray(jax.device_get(counts))
    host_bytes = counts.nbytes
    pending, fetch_whole, sharded = {}, {}, set()
    for i, (spec, old, new, count) in enumerate(zip(specs, old_leaves, new_leaves, counts)):
        if not count:
            continue
        if spec.dtype != bits.BF16.name:
            fetch_whole[i] = new
            continue
        if spec.size >= _MAX_POSITIONS:
            raise ValueError(f"leaf {spec.name} has {spec.size} elements; the on-device diff "
                             "uses int32 positions (< 2**31): use the host path")
        if _in_mesh(new) and new.ndim and new.sharding.is_fully_replicated:
            # every device holds the whole leaf: compact one device's copy
            old = jax.device_put(old, new.sharding).addressable_shards[0].data
            new = new.addressable_shards[0].data
        if _in_mesh(new) and new.ndim:
            pending[i], extra = _compact_sharded(old, new, values=values, backend=backend,
                                                 interpret=interpret, min_capacity=min_capacity)
            host_bytes += extra
            sharded.add(i)
            continue
        capacity = capacity_for(int(count), min_capacity)
        kernel = _use_kernel(backend, new.size, capacity, interpret,
                             single_device=len(new.sharding.device_set) == 1)
        pending[i] = _compact_leaf(old, new, capacity=capacity, values=values, kernel=kernel,
                                   interpret=interpret)
    fetched = jax.device_get((pending, fetch_whole))  # one batched device -> host transfer
    host_bytes += sum(x.nbytes for x in jax.tree.leaves(fetched))
    lanes = np.zeros((len(specs), 2), np.uint32)
    empty16 = np.zeros(0, np.uint16)
    diffs = []
    for i, (spec, new) in enumerate(zip(specs, new_leaves)):
        load = _loader(new)
        if i in fetched[1]:  # a changed non-bf16 leaf, carried whole (positions not needed)
            whole = np.asarray(fetched[1][i]).reshape(-1)
            diffs.append(LeafDiff(np.zeros(int(counts[i]), np.int64), empty16, empty16, whole))
        elif i not in fetched[0]:  # unchanged
            diffs.append(LeafDiff(np.zeros(0, np.int64), empty16, empty16, None,
                                  deltas=empty16, load_full=load))
        else:
            pos, vals, lane = fetched[0][i]
            k = int(counts[i])
            if i in sharded:  # per-shard sorted runs with -1 padding: merge
                pos = np.concatenate(pos)
                vals = tuple(np.concatenate(v) for v in vals)
                keep = np.flatnonzero(pos >= 0)
                keep = keep[np.argsort(pos[keep], kind="stable")]
                pos, vals = pos[keep], tuple(v[keep] for v in vals)
                if pos.size != k:
                    raise AssertionError(f"leaf {spec.name}: shards found {pos.size} changes, "
                                         f"the count pass {k}")
            positions = pos[:k].astype(np.int64)
            lanes[i] = lane
            if values == "new":
                diffs.append(LeafDiff(positions, None, vals[0][:k], None, load_full=load))
            elif values == "deltas":
                diffs.append(LeafDiff(positions, None, None, None, deltas=vals[0][:k],
                                      load_full=load))
            else:
                diffs.append(LeafDiff(positions, vals[0][:k], vals[1][:k], None,
                                      load_full=load))
    return DeviceDiff(str(treedef), specs, new_tree, diffs, lanes, host_bytes)


def _loader(leaf):
    def load() -> np.ndarray:
        return np.asarray(jax.device_get(leaf)).reshape(-1)
    return load
