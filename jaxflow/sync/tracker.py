"""In-mesh change tracking: find changed bf16 elements on the trainer's sharded params.

Each device compares its own shard of the fresh bf16 cast with its shard of the last synced
snapshot (bit patterns, inside ``jax.shard_map``), so no full tensor is ever gathered. Shapes
stay static in two passes: first every shard counts its changes, then every shard compacts
them into the same power-of-two ``capacity`` (so at most log2(n) compiled variants per leaf).
Positions are flat indices into the logical, unsharded leaf, so the receiver may shard
differently (or not at all). Only one replica of each shard reports (the one at index 0 of
every mesh axis the leaf is not sharded over).

    tracker = ChangeTracker(bf16_params_at_last_sync)
    for step in ...:
        params = train_step(...)
        tracker.observe(cast_to_bf16(params))        # per-step counts, in-mesh
    payload = tracker.encode(cast_to_bf16(params), base_version=v, version=v + 1)
    ...send; once the receiver acknowledged:
    tracker.commit(cast_to_bf16(params))
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.sync import bits
from jaxflow.sync.diff import LeafDiff, check_same_layout, diff_leaf, tree_layout
from jaxflow.sync.digest import device_digest
from jaxflow.sync.encoder import DEFAULT_BUCKET_ELEMS, encode_diffs
from jaxflow.sync.entropy import DEFAULT_ZSTD_LEVEL
from jaxflow.sync.payload import Payload
from pallas_kernels import dispatch
from pallas_kernels.sync_diff_compact import diff_compact, diff_compact_reference


class CompactBackend(enum.Enum):
    """Who compacts each shard's changes: AUTO uses the Pallas kernel on GPU/TPU where it
    builds for the shard's size (else XLA with one warning), XLA never, PALLAS always
    (``KernelUnavailable`` where it does not build)."""

    AUTO = "auto"
    XLA = "xla"
    PALLAS = "pallas"


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _spec_axes(spec: P, ndim: int) -> list[tuple[str, ...]]:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]


def _shard_geometry(mesh, axes: list[tuple[str, ...]], local_shape, global_shape):
    """Inside shard_map: flat logical positions of this shard's elements (int32, local shape)
    and whether this device is the reporting replica."""
    strides = np.cumprod((list(global_shape[1:]) + [1])[::-1])[::-1]
    flat = jnp.zeros(local_shape, jnp.int32)
    for d, dim_axes in enumerate(axes):
        offset = 0
        for a in dim_axes:
            offset = offset * mesh.shape[a] + jax.lax.axis_index(a)
        coord = jax.lax.broadcasted_iota(jnp.int32, local_shape, d) + offset * local_shape[d]
        flat = flat + coord * int(strides[d])
    used = {a for dim_axes in axes for a in dim_axes}
    owner = jnp.bool_(True)
    for a in mesh.axis_names:
        if a not in used:
            owner = owner & (jax.lax.axis_index(a) == 0)
    return flat, owner


@functools.cache
def shard_count_fn(mesh, spec, global_shape):
    """The jitted in-mesh count of one bf16 leaf sharded by ``NamedSharding(mesh, spec)``:
    ``fn(old, new) -> int32[n_devices]``, each reporting device's count of elements whose
    bits differ in its shard (0 for the other replicas of that shard). Cached per layout."""
    axes = _spec_axes(spec, len(global_shape))
    every = P(tuple(mesh.axis_names))

    def count(old, new):
        _, owner = _shard_geometry(mesh, axes, old.shape, global_shape)
        changed = jax.lax.bitcast_convert_type(old, jnp.uint16) != jax.lax.bitcast_convert_type(
            new, jnp.uint16)
        return jnp.where(owner, jnp.sum(changed, dtype=jnp.int32), 0).reshape(1)

    return jax.jit(jax.shard_map(count, mesh=mesh, in_specs=(spec, spec), out_specs=every,
                                 check_vma=False))


@functools.cache
def shard_compact_fn(mesh, spec, global_shape, capacity: int, backend: str, interpret: bool):
    """The jitted in-mesh compaction of one sharded bf16 leaf: ``fn(old, new) -> (positions,
    old_bits, new_bits)``, each [n_devices * capacity]: per device ``capacity`` slots of its
    shard's changes, positions int32 flat in the logical leaf, -1 for padding and for
    non-reporting replicas. ``backend``: "pallas" (``diff_compact``) or "xla". Cached."""
    axes = _spec_axes(spec, len(global_shape))
    every = P(tuple(mesh.axis_names))

    def compact(old, new):
        flat_index, owner = _shard_geometry(mesh, axes, old.shape, global_shape)
        old_b = jax.lax.bitcast_convert_type(old, jnp.uint16).reshape(-1)
        new_b = jax.lax.bitcast_convert_type(new, jnp.uint16).reshape(-1)
        if backend == "pallas":
            _, local, o, n = diff_compact(old_b, new_b, capacity=capacity, interpret=interpret)
        else:
            _, local, o, n = diff_compact_reference(old_b, new_b, capacity=capacity)
        keep = owner & (local >= 0)
        positions = jnp.where(keep, flat_index.reshape(-1)[jnp.maximum(local, 0)], -1)
        return positions, o, n

    return jax.jit(jax.shard_map(compact, mesh=mesh, in_specs=(spec, spec),
                                 out_specs=(every, every, every), check_vma=False))


def _in_mesh(leaf) -> bool:
    return (isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
            and bits.is_bf16(leaf.dtype) and leaf.ndim > 0)


class ChangeTracker:
    """Tracks bf16 bit changes of sharded params against the last synced snapshot.

    Args:
      snapshot: the tree the receiver holds (bf16 leaves as sharded jax Arrays with
        NamedSharding are tracked in-mesh; other leaves are compared on the host).
      backend: a CompactBackend or its value: "auto" (default: the Pallas kernel on GPU/TPU
        where it builds for these shapes, XLA's jnp.nonzero compaction otherwise), "xla",
        or "pallas" (sync_diff_compact, forced).
      interpret: run the Pallas kernel in interpret mode (required on CPU).
      min_capacity: the smallest compaction capacity.
    """

    def __init__(self, snapshot, *, backend: CompactBackend | str = CompactBackend.AUTO,
                 interpret: bool = False, min_capacity: int = 128):
        try:
            self.backend = CompactBackend(backend)
        except ValueError:
            raise ValueError(f"unknown backend {backend!r}; valid: "
                             f"{[b.value for b in CompactBackend]}") from None
        self.interpret, self.min_capacity = interpret, min_capacity
        self.commit(snapshot)

    def commit(self, params) -> None:
        """Makes ``params`` the new snapshot (call after the receiver applied a payload)."""
        self._treedef, self._snapshot, self._specs = tree_layout(params)
        self._snapshot_tree, self._base_digest = params, None  # digest on first encode

    def _leaves(self, params) -> list:
        treedef, leaves, specs = tree_layout(params)
        check_same_layout(self._specs, specs, self._treedef, treedef)
        return leaves

    def observe(self, params) -> dict[str, int]:
        """Per-leaf count of elements whose bits differ from the snapshot (one optimizer
        step's view; counted per shard inside the mesh)."""
        out = {}
        for spec, old, new in zip(self._specs, self._snapshot, self._leaves(params)):
            if _in_mesh(new):
                out[spec.name] = int(np.asarray(self._counts(old, new)).sum())
            else:
                out[spec.name] = diff_leaf(old, new).count
        return out

    def _counts(self, old, new):
        sharding = new.sharding
        old = jax.device_put(old, sharding)  # no-op when the snapshot is laid out alike
        return shard_count_fn(sharding.mesh, sharding.spec, tuple(new.shape))(old, new)

    def diffs(self, params, *, with_full: bool = False) -> list[LeafDiff]:
        """LeafDiffs of ``params`` against the snapshot, positions in logical flat order."""
        out = []
        for spec, old, new in zip(self._specs, self._snapshot, self._leaves(params)):
            if not _in_mesh(new):
                out.append(diff_leaf(old, new))
                continue
            if spec.size >= 2**31:
                raise ValueError(f"leaf {spec.name} has {spec.size} elements; in-mesh "
                                 "tracking uses int32 positions (< 2**31)")
            sharding = new.sharding
            old = jax.device_put(old, sharding)
            per_shard = np.asarray(self._counts(old, new))
            capacity = next_power_of_two(int(per_shard.max()), self.min_capacity)
            positions, old_bits, new_bits = self._compact(old, new, capacity)
            keep = positions >= 0
            order = np.argsort(positions[keep], kind="stable")
            full = bits.host_array(new).reshape(-1) if with_full else None
            out.append(LeafDiff(positions[keep][order].astype(np.int64),
                                old_bits[keep][order], new_bits[keep][order], full))
        return out

    def _compact(self, old, new, capacity: int):
        args = (new.sharding.mesh, new.sharding.spec, tuple(new.shape), capacity)
        if self._use_kernel(new, capacity):
            out = shard_compact_fn(*args, "pallas", self.interpret)(old, new)
        else:
            out = shard_compact_fn(*args, "xla", False)(old, new)
        return tuple(np.asarray(x) for x in out)

    def _use_kernel(self, new, capacity: int) -> bool:
        """Kernel or XLA compaction for this leaf's shards (``pallas_kernels.dispatch``):
        AUTO asks for the verdict on GPU/TPU (XLA with one warning where the kernel does not
        build for the shard's size), PALLAS forces it (KernelUnavailable where it does not
        build; interpret mode skips the check)."""
        if self.backend is CompactBackend.XLA:
            return False
        if self.backend is CompactBackend.PALLAS and self.interpret:
            return True
        local = int(np.prod(new.sharding.shard_shape(tuple(new.shape))))
        shard = jax.ShapeDtypeStruct((local,), jnp.uint16)
        mode = "auto" if self.backend is CompactBackend.AUTO else "pallas"
        # The kernel runs on each device's shard inside shard_map: built alone for the shard.
        return dispatch.choose_kernel(
            "sync_diff_compact", mode, functools.partial(diff_compact, capacity=capacity),
            (shard, shard), options=(capacity,))

    def encode(self, params, *, base_version: int, version: int, codec: str = "auto",
               bucket_elems: int = DEFAULT_BUCKET_ELEMS,
               zstd_level: int = DEFAULT_ZSTD_LEVEL) -> Payload:
        """Like ``sync.encode(snapshot, params, ...)`` without gathering tracked leaves
        (except for ``codec="dense"``, which sends them whole); delta payloads carry the
        snapshot's base digest, so ``apply`` refuses them on any other base."""
        diffs = self.diffs(params, with_full=codec == "dense")
        if self._base_digest is None:  # on the snapshot's own devices, a few scalars per leaf
            self._base_digest = device_digest(self._snapshot_tree)
        return encode_diffs(self._treedef, self._specs, diffs, base_version=base_version,
                            version=version, codec=codec, bucket_elems=bucket_elems,
                            zstd_level=zstd_level, base_digest=self._base_digest)
