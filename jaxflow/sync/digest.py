"""Base-tree digest computed where the leaves live: a jitted reduction over bit patterns.

A delta payload only reproduces the trainer's tree when it is applied to the exact tree it was
encoded against. ``device_digest(tree)`` fingerprints a tree without moving it: a jitted
function views every leaf's bit pattern as uint32 words (on the devices that hold the leaf,
partitioned like the leaf) and reduces each leaf to two uint32 scalars; only those scalars
reach the host, where they are hashed (blake2b-128) together with the tree structure and every
leaf's name, dtype and shape.

Per leaf, with ``w[p]`` its p-th uint32 word (flat row-major position over the leaf's shape,
times the words per element, plus the word index; little-endian word order for 8- and 16-byte
elements, real before imaginary for complex) and ``p`` taken mod 2**32::

    lane_k = sum_p  mix_k(w[p] XOR (p * M_k + S_k))   mod 2**32        k = 1, 2

``mix_1`` / ``mix_2`` are two different 32-bit avalanche finalizers (MurmurHash3's fmix32 and
the "lowbias32" constants), both bijections of uint32; M_k are odd, S_k fixed seeds.

Collision properties (what the digest promises):
  - Any change of the tree structure, a leaf name, dtype or shape changes the digest (those
    enter blake2b directly).
  - A leaf that differs in exactly one 32-bit word always changes both lanes: for a fixed
    position the summand is a bijection of the word, so its difference cannot be 0.
  - Words are position-bound: the same values at permuted positions give different summands.
  - For any other difference the lanes are sums of 32-bit avalanche outputs; modelling the
    finalizers as random functions, two different leaves collide with probability about
    2**-64 (both lanes), which is what "the receiver applied a delta to the wrong base" (a
    wrong ``version=``, a replica that already applied the payload, a stale snapshot) needs.
  - It is NOT a cryptographic hash: someone who controls the bytes can construct collisions
    (and could recompute the payload's unkeyed blake2b checksum anyway). Payloads carry no
    authentication; run transports over trusted links.
  - Positions wrap mod 2**32: leaves of more than 2**32 words only keep the position binding
    within each 2**32-word window.
The end-to-end check after a sync stays ``replica.tree_digest`` (blake2b over every byte).

Host (numpy) leaves are viewed as words on the host for free and digested by the same jitted
function on the CPU device (an explicit host-to-host copy, a group of leaves at a time), so a
numpy tree and the same tree as sharded jax Arrays have the same digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxflow.sync.diff import tree_layout

DIGEST_HEX_CHARS = 32  # blake2b-128
# Host leaves are copied to the CPU device in groups of at most this many bytes (bounds the
# transient copy; one compiled digest per group layout).
_HOST_GROUP_BYTES = 1 << 28

_M1, _S1 = 0x9E3779B1, 0x85EBCA77
_M2, _S2 = 0xC2B2AE3D, 0x27D4EB2F


def _bit_width(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 8
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            return int(info(dtype).bits)
        except (ValueError, TypeError):
            pass
    return 8 * dtype.itemsize


def _u32(x: int) -> jnp.ndarray:
    return jnp.uint32(x & 0xFFFFFFFF)


def _mix1(h):  # MurmurHash3 fmix32
    h = h ^ (h >> 16)
    h = h * _u32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _u32(0xC2B2AE35)
    return h ^ (h >> 16)


def _mix2(h):  # "lowbias32" (C. Wellons' hash prospector)
    h = h ^ (h >> 16)
    h = h * _u32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * _u32(0x846CA68B)
    return h ^ (h >> 16)


def _device_words(x) -> jnp.ndarray:
    """Inside jit: the leaf's bit pattern as uint32 words, shape (*x.shape, words/element) or
    x.shape for elements of at most 4 bytes."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_ or dtype in (np.uint8, np.uint16, np.uint32):
        return x.astype(jnp.uint32)
    if np.issubdtype(dtype, np.complexfloating):  # real words, then imaginary words
        parts = [_device_words(jnp.real(x)), _device_words(jnp.imag(x))]
        if parts[0].ndim == x.ndim:
            parts = [p[..., None] for p in parts]
        return jnp.concatenate(parts, axis=-1)
    bits = _bit_width(dtype)
    if bits < 8:  # sub-byte types: the code, zero-extended (as numpy stores it, masked)
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
    if dtype.itemsize in (1, 2, 4):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * dtype.itemsize}")
                                            ).astype(jnp.uint32)
    if dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2), little-endian words
    raise ValueError(f"device_digest: unsupported dtype {dtype}")


def host_words(x: np.ndarray) -> np.ndarray:
    """The host-side twin of the device word view (a view, except for sub-byte dtypes)."""
    x = np.asarray(x, order="C")
    dtype = x.dtype
    bits = _bit_width(dtype)
    if dtype == np.bool_ or bits < 8:
        raw = x.view(np.uint8)
        return raw if bits >= 8 else raw & np.uint8((1 << bits) - 1)
    if dtype.itemsize in (1, 2, 4):
        return x.view(np.dtype(f"uint{8 * dtype.itemsize}"))
    if dtype.itemsize in (8, 16):
        return x.reshape(-1).view(np.uint32).reshape(*x.shape, dtype.itemsize // 4)
    raise ValueError(f"device_digest: unsupported dtype {dtype}")


def _flat_positions(shape: tuple[int, ...]) -> jnp.ndarray:
    """uint32 row-major flat index of every element (mod 2**32), elementwise: no reshape, so
    the computation stays partitioned like the leaf."""
    if not shape:
        return jnp.uint32(0)
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * _u32(stride)
        stride *= shape[d]
    return pos


def _leaf_lanes(x) -> jnp.ndarray:
    words = _device_words(x)
    pos = _flat_positions(words.shape)
    h1 = _mix1(words ^ (pos * _u32(_M1) + _u32(_S1)))
    h2 = _mix2(words ^ (pos * _u32(_M2) + _u32(_S2)))
    return jnp.stack([jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32)])


@jax.jit
def leaf_lanes(leaves: tuple) -> tuple:
    """One uint32[2] (the two lanes) per leaf of ``leaves`` (jax arrays on one device set,
    any shardings, meshes alike or not). The only outputs; the leaves stay on their devices."""
    return tuple(_leaf_lanes(x) for x in leaves)


def _groups(leaves: list) -> list[tuple[list[int], Any]]:
    """Leaf indices grouped by the devices holding them; host leaves in byte-bounded groups."""
    by_devices: dict = {}
    host: list[list[int]] = []
    host_bytes = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array):
            by_devices.setdefault(frozenset(leaf.sharding.device_set), []).append(i)
            continue
        nbytes = np.asarray(leaf).nbytes
        if not host or host_bytes + nbytes > _HOST_GROUP_BYTES:
            host.append([])
            host_bytes = 0
        host[-1].append(i)
        host_bytes += nbytes
    return [(ids, None) for ids in by_devices.values()] + [(ids, "host") for ids in host]


def tree_lanes(tree: Any) -> np.ndarray:
    """uint32[n_leaves, 2] lanes of every leaf of ``tree`` (in ``tree_layout`` order)."""
    _, leaves, _ = tree_layout(tree)
    pending = []
    cpu = None
    for ids, where in _groups(leaves):
        if where == "host":
            cpu = cpu or jax.devices("cpu")[0]
            args = tuple(jax.device_put(host_words(np.asarray(leaves[i])), cpu) for i in ids)
        else:
            args = tuple(leaves[i] for i in ids)
        pending.append((ids, leaf_lanes(args)))
    out = np.zeros((len(leaves), 2), np.uint32)
    fetched = jax.device_get([lanes for _, lanes in pending])  # 8 bytes per leaf, explicitly
    for (ids, _), lanes in zip(pending, fetched):
        if ids:
            out[ids] = np.stack(lanes)
    return out


def device_digest(tree: Any) -> str:
    """Hex blake2b-128 of the tree structure, every leaf's name / dtype / shape and its two
    on-device lanes (see the module docstring for what collides and what cannot)."""
    treedef, _, specs = tree_layout(tree)
    lanes = tree_lanes(tree)
    h = hashlib.blake2b(digest_size=16)
    h.update(b"jaxflow.sync.device_digest/1|" + treedef.encode())
    for spec, lane in zip(specs, lanes):
        h.update(f"|{spec.name}|{spec.dtype}|{list(spec.shape)}|".encode())
        h.update(lane.astype("<u4").tobytes())
    return h.hexdigest()
