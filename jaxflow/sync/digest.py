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

    h[p]   = fmix32(w[p] XOR (p * M + S))          MurmurHash3's 32-bit finalizer
    lane_1 = sum_p h[p]                 mod 2**32
    lane_2 = sum_p h[p] * c[p]          mod 2**32,   c[p] = (p * M' + S') OR 1  (odd)

Collision properties (what the digest promises):
  - Any change of the tree structure, a leaf name, dtype or shape changes the digest (those
    enter blake2b directly).
  - A leaf that differs in exactly one 32-bit word always changes both lanes: for a fixed
    position ``h`` is a bijection of the word (fmix32 is invertible) and ``c[p]`` is odd,
    hence invertible mod 2**32, so neither difference can be 0.
  - Words are position-bound: the same values at permuted positions give different ``h``.
  - For any other difference, modelling fmix32 as a random function, lane_1 collides with
    probability 2**-32; given that, lane_2 collides with probability 2**-(32 - v), v >= 1 the
    2-adic valuation of the ``c[p] - c[q]`` involved (1 for most pairs): about 2**-63 per leaf
    in all -- what "a delta applied to the wrong base" (a wrong ``version=``, a payload applied
    twice, a stale snapshot) needs. (The second lane reuses ``h``, a multiply instead of a
    second finalizer: a third cheaper per word than two independent mixes.)
  - It is NOT a cryptographic hash: someone who controls the bytes can construct collisions
    (and could recompute the payload's unkeyed blake2b checksum anyway). Payloads carry no
    authentication; run transports over trusted links.
  - Positions wrap mod 2**32: leaves of more than 2**32 words only keep the position binding
    within each 2**32-word window.
The end-to-end check after a sync stays ``replica.tree_digest`` (blake2b over every byte).

Host (numpy) leaves live on the host, so they are digested there, in place, by ``host_lanes``:
the numpy twin of the jitted function (bit-identical; about 2x faster than copying them to the
CPU device and running XLA there), so a numpy tree and the same tree as sharded jax Arrays
have the same digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxflow.sync import host_kernels
from jaxflow.sync.diff import tree_layout

DIGEST_HEX_CHARS = 32  # blake2b-128

_M1, _S1 = 0x9E3779B1, 0x85EBCA77  # position mix of h
_M2, _S2 = 0xC2B2AE3D, 0x27D4EB2F  # odd per-position multiplier of lane 2


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


def _mix1(h):  # MurmurHash3 fmix32 (a bijection of uint32)
    h = h ^ (h >> 16)
    h = h * _u32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _u32(0xC2B2AE35)
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
    h = _mix1(words ^ (pos * _u32(_M1) + _u32(_S1)))
    odd = (pos * _u32(_M2) + _u32(_S2)) | _u32(1)
    return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(h * odd, dtype=jnp.uint32)])


@jax.jit
def leaf_lanes(leaves: tuple) -> tuple:
    """One uint32[2] (the two lanes) per leaf of ``leaves`` (jax arrays on one device set,
    any shardings, meshes alike or not). The only outputs; the leaves stay on their devices."""
    return tuple(_leaf_lanes(x) for x in leaves)


_HOST_CHUNK = 1 << 16  # words per step of the host twin (its buffers stay in cache)


def _fmix32_inplace(h: np.ndarray, tmp: np.ndarray) -> None:
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        np.right_shift(h, np.uint32(shift), out=tmp)
        h ^= tmp
        if factor is not None:
            h *= np.uint32(factor)


def _host_terms(words: np.ndarray, pos: np.ndarray, h: np.ndarray, t: np.ndarray
                ) -> tuple[int, int]:
    """Sums (mod 2**32) of ``h`` and ``h * c`` over uint32 positions ``pos`` holding
    ``words``; ``h`` and ``t`` are scratch buffers of the same length."""
    with np.errstate(over="ignore"):
        np.multiply(pos, np.uint32(_M1), out=h)
        h += np.uint32(_S1)
        np.bitwise_xor(h, words, out=h)  # uint8 / uint16 words zero-extend
        _fmix32_inplace(h, t)
        lane_1 = int(h.sum(dtype=np.uint32))  # wraps mod 2**32
        np.multiply(pos, np.uint32(_M2), out=t)
        t += np.uint32(_S2)
        t |= np.uint32(1)
        t *= h
        return lane_1, int(t.sum(dtype=np.uint32))


def host_lanes(x: np.ndarray) -> np.ndarray:
    """uint32[2]: the lanes of a host (numpy) leaf, computed where it lives -- the numpy twin
    of ``_leaf_lanes`` (bit-identical, tested), chunked and in place: no copy of the leaf, no
    device transfer, no compile."""
    words = host_words(x).reshape(-1)
    if host_kernels.available() and words.dtype.itemsize <= 4:
        return host_kernels.full_lanes(words)
    base = np.arange(min(words.size, _HOST_CHUNK), dtype=np.uint32)
    pos, h, t = (np.empty(base.size, np.uint32) for _ in range(3))
    lane_1 = lane_2 = 0
    for start in range(0, words.size, _HOST_CHUNK):
        chunk = words[start: start + _HOST_CHUNK]
        k = chunk.size
        with np.errstate(over="ignore"):
            np.add(base[:k], np.uint32(start & 0xFFFFFFFF), out=pos[:k])
        a, b = _host_terms(chunk, pos[:k], h[:k], t[:k])
        lane_1, lane_2 = lane_1 + a, lane_2 + b
    return np.array([lane_1 & 0xFFFFFFFF, lane_2 & 0xFFFFFFFF], np.uint32)


def lanes_delta(positions: np.ndarray, old_words: np.ndarray, new_words: np.ndarray
                ) -> np.ndarray:
    """uint32[2] to add (mod 2**32) to a leaf's lanes when the words at flat word
    ``positions`` change from ``old_words`` to ``new_words`` (e.g. a bf16 leaf's diff, one
    word per element): keeps a digest current in O(changes) instead of a pass over the tree."""
    pos = (np.asarray(positions, np.int64) & 0xFFFFFFFF).astype(np.uint32)
    h, t = np.empty(pos.size, np.uint32), np.empty(pos.size, np.uint32)
    new = _host_terms(np.asarray(new_words), pos, h, t)
    old = _host_terms(np.asarray(old_words), pos, h, t)
    return np.array([(n - o) & 0xFFFFFFFF for n, o in zip(new, old)], np.uint32)


def device_lanes_delta(positions: jnp.ndarray, old_words: jnp.ndarray, new_words: jnp.ndarray
                       ) -> jnp.ndarray:
    """Inside jit: the device twin of ``lanes_delta`` over compacted slots.

    Args:
      positions: int32[c] flat word positions, -1 for padding slots (which count nothing).
      old_words, new_words: uint16 / uint32 [c] words at those positions before and after.
    Returns:
      uint32[2] to add (mod 2**32) to the leaf's lanes.
    """
    valid = positions >= 0
    upos = jnp.where(valid, positions, 0).astype(jnp.uint32)

    def terms(words):
        h = _mix1(words.astype(jnp.uint32) ^ (upos * _u32(_M1) + _u32(_S1)))
        h = jnp.where(valid, h, jnp.uint32(0))
        odd = (upos * _u32(_M2) + _u32(_S2)) | _u32(1)
        return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(h * odd, dtype=jnp.uint32)])

    return terms(new_words) - terms(old_words)


def lanes_deltas(positions: list[np.ndarray], old_words: list[np.ndarray],
                 new_words: list[np.ndarray]) -> np.ndarray:
    """uint32[len(positions), 2]: ``lanes_delta`` of many leaves at once (one vectorised pass
    over all their changes, summed per leaf), bit-identical to calling it per leaf."""
    out = np.zeros((len(positions), 2), np.uint32)
    if host_kernels.available() and all(np.asarray(w).dtype.itemsize <= 4
                                        for w in (*old_words, *new_words)):
        for i, (p, o, n) in enumerate(zip(positions, old_words, new_words)):
            if np.size(p):
                out[i] = host_kernels.lanes_delta(p, o, n)
        return out
    sizes = np.array([np.size(p) for p in positions], np.int64)
    live = np.flatnonzero(sizes)
    if live.size == 0:
        return out
    pos = (np.concatenate([np.asarray(positions[i], np.int64) for i in live])
           & 0xFFFFFFFF).astype(np.uint32)
    starts = np.concatenate([[0], np.cumsum(sizes[live])[:-1]])
    h, t = np.empty(pos.size, np.uint32), np.empty(pos.size, np.uint32)
    for words, sign in ((new_words, 1), (old_words, -1)):
        w = np.concatenate([np.asarray(words[i]) for i in live]).astype(np.uint32)
        with np.errstate(over="ignore"):
            np.multiply(pos, np.uint32(_M1), out=h)
            h += np.uint32(_S1)
            np.bitwise_xor(h, w, out=h)
            _fmix32_inplace(h, t)
            np.multiply(pos, np.uint32(_M2), out=t)
            t += np.uint32(_S2)
            t |= np.uint32(1)
            t *= h
            lane_1 = np.add.reduceat(h, starts, dtype=np.uint32)
            lane_2 = np.add.reduceat(t, starts, dtype=np.uint32)
            if sign > 0:
                out[live, 0] += lane_1
                out[live, 1] += lane_2
            else:
                out[live, 0] -= lane_1
                out[live, 1] -= lane_2
    return out


def combine(treedef: str, specs, lanes: np.ndarray) -> str:
    """The digest string of a tree from its structure, LeafSpecs and uint32[n, 2] lanes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"jaxflow.sync.device_digest/1|" + treedef.encode())
    for spec, lane in zip(specs, lanes):
        h.update(f"|{spec.name}|{spec.dtype}|{list(spec.shape)}|".encode())
        h.update(np.asarray(lane, np.uint32).astype("<u4").tobytes())
    return h.hexdigest()


def tree_lanes(tree: Any) -> np.ndarray:
    """uint32[n_leaves, 2] lanes of every leaf of ``tree`` (in ``tree_layout`` order): jax
    Arrays by ``leaf_lanes`` on their devices (one call per device set), host leaves by
    ``host_lanes``."""
    _, leaves, _ = tree_layout(tree)
    out = np.zeros((len(leaves), 2), np.uint32)
    by_devices: dict = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array):
            by_devices.setdefault(frozenset(leaf.sharding.device_set), []).append(i)
    pending = [(ids, leaf_lanes(tuple(leaves[i] for i in ids))) for ids in by_devices.values()]
    for i, leaf in enumerate(leaves):  # overlaps with the dispatched device work
        if not isinstance(leaf, jax.Array):
            out[i] = host_lanes(np.asarray(leaf))
    fetched = jax.device_get([lanes for _, lanes in pending])  # 8 bytes per leaf, explicitly
    for (ids, _), lanes in zip(pending, fetched):
        out[ids] = np.stack(lanes)
    return out


def device_digest(tree: Any) -> str:
    """Hex blake2b-128 of the tree structure, every leaf's name / dtype / shape and its two
    on-device lanes (see the module docstring for what collides and what cannot)."""
    treedef, _, specs = tree_layout(tree)
    return combine(treedef, specs, tree_lanes(tree))
