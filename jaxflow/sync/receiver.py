"""Receiver side: validate a payload completely, then write it into the params.

Every check (versions, tree structure, leaf names, shapes, dtypes, section kinds, stream
lengths, counts, positions) runs and every section is decoded before any leaf is written, so a
rejected payload raises ``PayloadError`` and leaves the receiver's params untouched. Writes are
integer scatters on the uint16 bit patterns: XLA's bf16 scatter may canonicalise NaN payloads,
an integer scatter cannot.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxflow.sync import bits, codecs, entropy
from jaxflow.sync.diff import tree_layout
from jaxflow.sync.digest import device_digest
from jaxflow.sync.payload import Payload, PayloadError
from pallas_kernels import dispatch
from pallas_kernels.sync_scatter_apply import scatter_apply

_BUCKET_KINDS = ("coo", "gap", "entropy")
_CHUNK = 1 << 18


SCATTER_BACKENDS = ("auto", "xla", "pallas")


def apply(payload: Payload, params, *, version: int, inplace: bool = False,
          on_device: bool | None = None, rollback: bool = False, scatter: str = "auto",
          interpret: bool = False):
    """Returns ``params`` advanced from ``version`` to ``payload.version``.

    Args:
      payload: a Payload (e.g. from ``Payload.from_bytes``).
      params: the receiver's tree at ``version``; numpy or jax leaves. Unchanged leaves are
        returned as the same objects; changed jax leaves keep their sharding. Shapes (0-d and
        empty included), dtypes and the tree structure come back exactly.
      version: the receiver's current version. A delta payload needs
        ``version == payload.base_version`` and ``params`` whose on-device digest equals the
        payload's ``base_digest`` (so a wrong ``version=`` cannot apply a delta twice); a full
        payload applies from any version up to its own.
      inplace: write changed numpy leaves in place (only after all validation passed).
      on_device: update jax leaves with an integer scatter on their own devices (keeping
        their sharding, no host round trip of the leaf) instead of on the host. Default: on
        for leaves living on an accelerator, off on CPU where host numpy is faster.
      rollback: allow a full payload older than ``version`` (an explicit rollback).
      scatter: the on-device write of sparse updates: "auto" (the Pallas
        ``sync_scatter_apply`` kernel on GPU/TPU where ``pallas_kernels.dispatch`` says it
        builds, else XLA's scatter), "xla", or "pallas" (forced; ``KernelUnavailable`` where
        it does not build). A leaf sharded over a mesh (a multi-chip replica) runs the kernel
        per shard in a ``shard_map``, each device on its own update list
        (:func:`shard_update_lists`).
      interpret: run a forced Pallas kernel in interpret mode (CPU tests).
    Raises:
      PayloadError: the payload does not apply; ``params`` are unchanged.
    """
    if scatter not in SCATTER_BACKENDS:
        raise ValueError(f"scatter={scatter!r}; valid: {SCATTER_BACKENDS}")
    check_applicable(payload, version, rollback=rollback)
    treedef_str, leaves, specs = tree_layout(params)
    if treedef_str != payload.treedef:
        raise PayloadError(f"tree structure mismatch: payload has {payload.treedef}, "
                           f"receiver has {treedef_str}")
    if len(specs) != len(payload.leaves):
        raise PayloadError(f"payload has {len(payload.leaves)} leaves, receiver {len(specs)}")
    for mine, theirs in zip(specs, payload.leaves):
        if mine != theirs:
            raise PayloadError(f"leaf mismatch: payload {theirs.name} {theirs.dtype}"
                               f"{list(theirs.shape)}, receiver {mine.name} {mine.dtype}"
                               f"{list(mine.shape)}")
    if payload.base_digest is not None and not payload.is_full:
        mine = device_digest(params)
        if mine != payload.base_digest:
            raise PayloadError(
                f"base digest mismatch: the payload was encoded against a tree with digest "
                f"{payload.base_digest} (version {payload.base_version}), the receiver's tree "
                f"at version {version} has digest {mine}; applying would corrupt it (applied "
                "twice, or a wrong version=?)")
    updates = decode_updates(payload, leaves)
    out = list(leaves)
    for i, update in updates.items():
        leaf = leaves[i]
        device = isinstance(leaf, jax.Array) and leaf.size < 2**31 and (  # int32 positions
            on_device if on_device is not None else next(iter(leaf.sharding.device_set)).platform != "cpu")
        out[i] = (_write_on_device(leaf, update, scatter, interpret) if device
                  else _write(leaf, update, inplace))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), out)


def check_applicable(payload: Payload, version: int, *, rollback: bool = False,
                     who: str = "receiver") -> None:
    """The version rules of ``apply`` (envelope validated first); PayloadError naming both
    versions when ``payload`` cannot take a ``who`` at ``version`` forward."""
    if not isinstance(payload, Payload):
        raise PayloadError(f"expected a Payload, got {type(payload).__name__}")
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise PayloadError(f"version must be an int, got {version!r}")
    version = int(version)
    payload.validate()
    if payload.is_full:
        if payload.version < version and not rollback:
            raise PayloadError(f"payload is version {payload.version}, older than the {who}'s "
                               f"version {version}: refused (pass rollback=True to roll back)")
    elif payload.base_version != version:
        older = " (an older payload; only a full payload can roll back)" if (
            payload.version <= version) else ""
        raise PayloadError(f"payload applies to version {payload.base_version}, {who} is at "
                           f"{version} (payload: {payload.base_version} -> {payload.version})"
                           f"{older}")


def decode_updates(payload: Payload, leaves: list) -> dict[int, tuple]:
    """Decodes every section against the receiver's leaves without writing anything.

    Returns leaf index -> ("full", flat array), ("scatter", positions, new uint16 bits) or
    ("delta", positions, uint16 bit-pattern differences to add to the old bits).
    """
    specs = payload.leaves
    updates: dict[int, tuple] = {}
    for section in payload.sections:
        for i in section.leaves:
            if i in updates:
                raise PayloadError(f"leaf {specs[i].name} appears in more than one section")
            updates[i] = None
        is_bf16 = [specs[i].dtype == bits.BF16.name for i in section.leaves]
        if section.kind != "exact" and not all(is_bf16):
            raise PayloadError(f"{section.kind} section covers non-bf16 leaves")
        if section.kind not in _BUCKET_KINDS and len(section.leaves) != 1:
            raise PayloadError(f"{section.kind} section must cover exactly one leaf")
        if section.kind == "exact":
            i = section.leaves[0]
            dtype = bits.host_array(leaves[i]).dtype
            updates[i] = ("full", codecs.exact_decode(section.streams, dtype, specs[i].size))
        elif section.kind == "dense":
            i = section.leaves[0]
            updates[i] = ("full", codecs.dense_decode(section.streams, specs[i].size))
        elif section.kind == "mask":
            i = section.leaves[0]
            pos, deltas = entropy.mask_decode(section.meta, section.streams, specs[i].size)
            updates[i] = ("delta", pos, deltas)
        else:
            updates.update(_decode_bucket(section, specs, leaves))
    return updates


def _decode_bucket(section, specs, leaves) -> dict[int, tuple]:
    sizes = [specs[i].size for i in section.leaves]
    offsets = np.cumsum([0] + sizes)
    total = int(offsets[-1])
    if section.kind == "coo":
        pos, new = codecs.coo_decode(section.meta, section.streams, total)
    elif section.kind == "gap":
        pos, new = codecs.gap_decode(section.meta, section.streams, total)
    else:
        pos, new = entropy.entropy_decode(section.meta, section.streams, total)
    cuts = np.searchsorted(pos, offsets)
    out = {}
    for j, i in enumerate(section.leaves):
        lo, hi = cuts[j], cuts[j + 1]
        kind = "delta" if section.kind == "entropy" else "scatter"
        out[i] = (kind, pos[lo:hi] - offsets[j], new[lo:hi])
    return out


def _write(leaf, update, inplace: bool):
    host = bits.host_array(leaf)
    is_numpy = isinstance(leaf, np.ndarray)
    if inplace and is_numpy and leaf.flags.writeable and leaf.flags.c_contiguous:
        target, copy = leaf, False
    else:
        target, copy = np.empty_like(host), True
    flat, source = bits.as_bits(target), bits.as_bits(host)
    if update[0] == "full":
        flat[:] = bits.as_bits(update[1])
    else:
        _scatter_chunked(flat, source if copy else None, *update)
    if isinstance(leaf, jax.Array):
        return jax.device_put(target, leaf.sharding)
    if is_numpy:
        return target
    return target.reshape(np.shape(leaf))[()] if target.ndim == 0 else target


def _capacity(k: int) -> int:
    """Padded update count (a power of two >= 128): bounded recompiles across publishes."""
    return max(128, 1 << max(0, k - 1).bit_length())


def _write_on_device(leaf: jax.Array, update, scatter: str = "xla", interpret: bool = False):
    if update[0] == "full":
        host = np.asarray(update[1]).view(np.dtype(leaf.dtype)).reshape(leaf.shape)
        return jax.device_put(host, leaf.sharding)
    kind, pos, values = update
    if len(leaf.sharding.device_set) > 1:
        if _sharded_kernel_may_serve(scatter, leaf):
            pos_all, vals_all = shard_update_lists(leaf.sharding, leaf.shape, pos, values)
            if _use_scatter_kernel(scatter, leaf.sharding.shard_shape(leaf.shape),
                                   pos_all.shape[-1], interpret):
                out = _sharded_kernel_scatter(leaf, pos_all, vals_all, mesh=leaf.sharding.mesh,
                                              spec=leaf.sharding.spec, delta=kind == "delta",
                                              interpret=interpret)
                return out if out.sharding == leaf.sharding else jax.device_put(out, leaf.sharding)
    elif _use_scatter_kernel(scatter, leaf.shape, _capacity(pos.size), interpret):
        capacity = _capacity(pos.size)
        flat_pos = np.full(capacity, -1, np.int32)
        flat_pos[: pos.size] = pos
        flat_vals = np.zeros(capacity, np.uint16)
        flat_vals[: pos.size] = values
        return _kernel_scatter(leaf, jnp.asarray(flat_pos), jnp.asarray(flat_vals),
                               delta=kind == "delta", interpret=interpret)
    if leaf.ndim == 0:  # unravel_index has no 0-d form: scatter into a (1,) view
        out = _write_on_device(leaf.reshape(1), update).reshape(())
        return out if out.sharding == leaf.sharding else jax.device_put(out, leaf.sharding)
    # n-d indices: a flat view of a sharded leaf would need a reshape across shards. Padded
    # to ``capacity`` with an out-of-range index (dropped by the scatter).
    capacity = _capacity(pos.size)
    index = []
    for dim, i in zip(leaf.shape, np.unravel_index(pos, leaf.shape)):
        padded = np.full(capacity, dim, np.int32)
        padded[: pos.size] = i
        index.append(jnp.asarray(padded))
    padded_values = np.zeros(capacity, np.uint16)
    padded_values[: pos.size] = values
    gathered = kept = None
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding) and any(
            t == AxisType.Explicit for t in sharding.mesh.axis_types):
        # Explicit-axis meshes want the gather's and the scatter's output shardings spelled out.
        gathered, kept = NamedSharding(sharding.mesh, PartitionSpec()), sharding
    out = _device_scatter(leaf, tuple(index), jnp.asarray(padded_values), kind == "delta",
                          gathered, kept)
    return out if out.sharding == sharding else jax.device_put(out, sharding)


def _use_scatter_kernel(scatter: str, shape: tuple[int, ...], capacity: int,
                        interpret: bool) -> bool:
    """The Pallas scatter for a leaf (or one device's shard of it) of ``shape`` taking
    ``capacity`` updates (``dispatch`` verdict for that one-device kernel)."""
    size = math.prod(shape)
    if scatter == "xla" or size >= 2**31:
        return False
    if scatter == "pallas" and interpret:
        return True
    dst = jax.ShapeDtypeStruct((size,), jnp.uint16)
    pos = jax.ShapeDtypeStruct((capacity,), jnp.int32)
    vals = jax.ShapeDtypeStruct((capacity,), jnp.uint16)
    return dispatch.choose_kernel("sync_scatter_apply", scatter, scatter_apply,
                                  (dst, pos, vals), options=(capacity,))


@functools.partial(jax.jit, static_argnames=("delta", "interpret"))
def _kernel_scatter(leaf, positions, values, *, delta: bool, interpret: bool):
    """``pallas_kernels.sync_scatter_apply`` on a single-device leaf's flat bit patterns
    (delta updates add to the old bits, gathered first; uint16 arithmetic wraps)."""
    flat = jax.lax.bitcast_convert_type(leaf, jnp.uint16).reshape(-1)
    if delta:
        values = flat[jnp.maximum(positions, 0)] + values
    out = scatter_apply(flat, positions, values, interpret=interpret)
    return jax.lax.bitcast_convert_type(out.reshape(leaf.shape), leaf.dtype)


def _sharded_kernel_may_serve(scatter: str, leaf: jax.Array) -> bool:
    """Whether building per-shard update lists can pay off: a NamedSharding leaf of rank >= 1,
    the kernel forced or the leaf on an accelerator (auto never takes it on CPU)."""
    if scatter == "xla" or leaf.ndim == 0 or not isinstance(leaf.sharding, NamedSharding):
        return False
    return scatter == "pallas" or next(iter(leaf.sharding.device_set)).platform != "cpu"


def shard_update_lists(sharding: NamedSharding, shape: tuple[int, ...], positions: np.ndarray,
                       values: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Each device's own updates of a leaf laid out by ``sharding``, for the per-shard kernel.

    Args:
      sharding: the leaf's NamedSharding over a mesh of axis sizes M = (m0, m1, ...).
      shape: the leaf's global shape.
      positions: int [k] ascending, distinct row-major positions in the global leaf.
      values: uint16 [k] bit patterns (new values or deltas) at those positions.

    Returns:
      (positions [*M, c] int32, values [*M, c] uint16), sharded so that each device holds its
      own [1, ..., 1, c] row: the row-major positions inside its shard (a block of the leaf,
      so still ascending) of the updates that land there, -1 past them; c = ``_capacity`` of
      the longest list (shards replicated over a mesh axis get the same list)."""
    mesh = sharding.mesh
    index = np.unravel_index(np.asarray(positions, np.int64), shape)
    lists: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    block_of = {}
    for device, slices in sharding.devices_indices_map(tuple(shape)).items():
        block = tuple(s.indices(n)[:2] for s, n in zip(slices, shape))
        block_of[device] = block
        if block not in lists:
            inside = np.ones(len(positions), bool)
            for (lo, hi), i in zip(block, index):
                inside &= (i >= lo) & (i < hi)
            local = tuple(i[inside] - lo for (lo, _), i in zip(block, index))
            sizes = tuple(hi - lo for lo, hi in block)
            lists[block] = (np.ravel_multi_index(local, sizes).astype(np.int32),
                            np.asarray(values)[inside])
    capacity = _capacity(max(p.size for p, _ in lists.values()))
    pos_all = np.full(mesh.devices.shape + (capacity,), -1, np.int32)
    vals_all = np.zeros(mesh.devices.shape + (capacity,), np.uint16)
    for where in np.ndindex(mesh.devices.shape):
        p, v = lists[block_of[mesh.devices[where]]]
        pos_all[where][: p.size], vals_all[where][: p.size] = p, v
    rows = NamedSharding(mesh, PartitionSpec(*mesh.axis_names, None))
    return jax.device_put(pos_all, rows), jax.device_put(vals_all, rows)


@functools.partial(jax.jit, static_argnames=("mesh", "spec", "delta", "interpret"))
def _sharded_kernel_scatter(leaf, positions, values, *, mesh, spec: PartitionSpec, delta: bool,
                            interpret: bool):
    """``_kernel_scatter`` on every device's shard of a leaf laid out as ``spec`` on ``mesh``,
    in a ``shard_map`` (no collective: each device writes its own shard from its own list of
    :func:`shard_update_lists`). Same bits as ``_device_scatter``."""
    rows = PartitionSpec(*mesh.axis_names, None)

    def local(shard, p, v):
        return _kernel_scatter(shard, p.reshape(-1), v.reshape(-1), delta=delta,
                               interpret=interpret)

    # check_vma off: a shard replicated over an axis is written identically on each device
    # of that axis (the same list), which the vma check cannot see
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, rows, rows), out_specs=spec,
                         check_vma=False)(leaf, positions, values)


@functools.partial(jax.jit, static_argnames=("delta", "gathered", "kept"))
def _device_scatter(leaf, index, values, delta: bool, gathered, kept):
    """Integer scatter of uint16 bit patterns into a bf16 leaf on its own devices.

    Same semantics as ``pallas_kernels.sync_scatter_apply.scatter_apply_reference`` (an
    integer scatter, so NaN payloads survive); XLA partitions it over the leaf's sharding.
    """
    leaf_bits = jax.lax.bitcast_convert_type(leaf, jnp.uint16)
    if delta:
        old = leaf_bits.at[index].get(out_sharding=gathered) if gathered else leaf_bits[index]
        values = old + values  # uint16 arithmetic wraps mod 2**16
    if kept:
        leaf_bits = leaf_bits.at[index].set(values, mode="drop", out_sharding=kept)
    else:
        leaf_bits = leaf_bits.at[index].set(values, mode="drop")
    return jax.lax.bitcast_convert_type(leaf_bits, leaf.dtype)


def _scatter_chunked(flat: np.ndarray, source: np.ndarray | None, kind: str,
                     pos: np.ndarray, values: np.ndarray) -> None:
    """Copies ``source`` into ``flat`` (unless None: in place) and writes the updates, one
    cache-sized chunk at a time so the scatter (and the old-value gather of "delta" updates)
    hits a chunk that was just copied instead of missing cache on every change."""
    n = flat.size
    cuts = np.searchsorted(pos, np.arange(0, n + _CHUNK, _CHUNK))
    for c, start in enumerate(range(0, max(n, 1), _CHUNK)):
        stop = min(start + _CHUNK, n)
        if source is not None:
            flat[start:stop] = source[start:stop]
        lo, hi = cuts[c], cuts[c + 1]
        if lo == hi:
            continue
        where = pos[lo:hi]
        if kind == "delta":
            flat[where] = entropy.apply_values(flat[where], values[lo:hi])
        else:
            flat[where] = values[lo:hi]
