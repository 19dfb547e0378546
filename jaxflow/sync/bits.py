"""Bit-level views and fast host-side change detection for bf16 tensors.

Everything here works on the raw bit patterns (``uint16`` for bf16), never on float values,
so -0.0/+0.0, NaN payloads, infs and subnormals are compared and reproduced exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# 64-bit words per chunk of the host diff (2 MiB per operand); the mask buffer is reused
# instead of allocated per tensor.
_CHUNK = 1 << 18


def is_bf16(dtype) -> bool:
    return np.dtype(dtype) == BF16


def host_array(x) -> np.ndarray:
    """A C-contiguous numpy view (or copy) of a numpy/jax array or Python scalar, same shape
    (``np.ascontiguousarray`` would turn a 0-d array into shape (1,))."""
    return np.asarray(x, order="C")


def as_bits(x: np.ndarray) -> np.ndarray:
    """The unsigned-integer view of ``x`` with the same itemsize, flattened: uint16 for bf16."""
    x = np.asarray(x, order="C")
    udtype = np.dtype(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else None
    if udtype is None:
        raise ValueError(f"unsupported itemsize {x.dtype.itemsize} for dtype {x.dtype}")
    return x.reshape(-1).view(udtype)


def diff_bits(old_bits: np.ndarray, new_bits: np.ndarray, *, scratch: list | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions int64, old bits there, new bits there) where two flat bit arrays differ.

    Compares 64-bit words (four bf16 elements at once: a quarter of the compare and
    compaction work), in chunks with one reused mask buffer so no tensor-sized temporary is
    allocated; only the few differing words are then split into their elements. The tail
    that does not fill a word is compared element by element. ``scratch``: a caller-owned
    one-element list that keeps the mask buffer between calls (a fresh buffer of this size
    is a fresh mapping from the allocator on every call: page faults on every publish).
    """
    if old_bits.shape != new_bits.shape or old_bits.dtype != new_bits.dtype:
        raise ValueError(f"need equal bit arrays, got {old_bits.dtype}{old_bits.shape} "
                         f"and {new_bits.dtype}{new_bits.shape}")
    old_bits, new_bits = old_bits.reshape(-1), new_bits.reshape(-1)
    n, itemsize = old_bits.size, old_bits.dtype.itemsize
    per_word = 8 // itemsize if itemsize in (1, 2, 4, 8) else 0
    whole = (n // per_word) * per_word if per_word else 0
    pos = []
    if whole:
        old_w = old_bits[:whole].view(np.uint64)
        new_w = new_bits[:whole].view(np.uint64)
        if scratch is None:
            scratch = [None]
        if scratch[0] is None or scratch[0].size < min(old_w.size, _CHUNK):
            scratch[0] = np.empty(_CHUNK, bool)
        mask = scratch[0]
        hits = []
        for start in range(0, old_w.size, _CHUNK):
            m = mask[: min(_CHUNK, old_w.size - start)]
            np.not_equal(old_w[start: start + _CHUNK], new_w[start: start + _CHUNK], out=m)
            h = np.flatnonzero(m)
            if h.size:
                h += start
                hits.append(h)
        if hits:
            h = np.concatenate(hits)
            old_at, new_at = old_w[h], new_w[h]
            if per_word == 1:
                pos.append(h)
            else:
                sub = np.flatnonzero((old_at ^ new_at).view(old_bits.dtype) != 0)
                pos.append(h[sub // per_word] * per_word + sub % per_word)
    if whole < n:
        tail = np.flatnonzero(old_bits[whole:] != new_bits[whole:])
        if tail.size:
            pos.append(tail + whole)
    if not pos:
        empty = np.zeros(0, old_bits.dtype)
        return np.zeros(0, np.int64), empty, empty.copy()
    positions = np.concatenate(pos).astype(np.int64, copy=False) if len(pos) > 1 else \
        pos[0].astype(np.int64, copy=False)
    return positions, old_bits[positions], new_bits[positions]


def byte_planes(values: np.ndarray, n_bytes: int) -> list[np.ndarray]:
    """Little-endian byte planes 0..n_bytes-1 of an unsigned array (each plane contiguous)."""
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(values.size, values.itemsize)
    return [np.ascontiguousarray(raw[:, b]) for b in range(n_bytes)]


def from_byte_planes(planes: list[np.ndarray], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = planes[0].size if planes else 0
    raw = np.zeros((count, dtype.itemsize), np.uint8)
    for b, plane in enumerate(planes):
        raw[:, b] = plane
    return raw.reshape(-1).view(dtype)


def bytes_needed(max_value: int) -> int:
    """Bytes per value for unsigned values up to ``max_value`` (at least 1)."""
    return max(1, (int(max_value).bit_length() + 7) // 8)
