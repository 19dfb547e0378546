"""Bit-level views and fast host-side change detection for bf16 tensors.

Everything here works on the raw bit patterns (``uint16`` for bf16), never on float values,
so -0.0/+0.0, NaN payloads, infs and subnormals are compared and reproduced exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# Elements per chunk of the host diff (2 MiB per operand): measured best of 2**16..2**22 on
# the 109M-element benchmark tree; the mask buffer is reused instead of allocated per tensor.
_CHUNK = 1 << 20


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


def diff_bits(old_bits: np.ndarray, new_bits: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions int64, old bits there, new bits there) where two flat bit arrays differ.

    Works in chunks with one reused mask buffer: the compare, the compaction and both gathers
    touch each chunk while it is still in cache, and no tensor-sized temporary is allocated
    (on the benchmark tree about as fast as a bare ``np.flatnonzero(old != new)``, i.e. the
    two gathers come for free; ~1.5x faster than that plus gathers on one 50M tensor).
    """
    if old_bits.shape != new_bits.shape or old_bits.dtype != new_bits.dtype:
        raise ValueError(f"need equal bit arrays, got {old_bits.dtype}{old_bits.shape} "
                         f"and {new_bits.dtype}{new_bits.shape}")
    old_bits, new_bits = old_bits.reshape(-1), new_bits.reshape(-1)
    n = old_bits.size
    mask = np.empty(min(n, _CHUNK), bool)
    pos, old_vals, new_vals = [], [], []
    for start in range(0, n, _CHUNK):
        old_c, new_c = old_bits[start: start + _CHUNK], new_bits[start: start + _CHUNK]
        m = mask[: old_c.size]
        np.not_equal(old_c, new_c, out=m)
        hits = np.flatnonzero(m)
        if hits.size:
            old_vals.append(old_c[hits])
            new_vals.append(new_c[hits])
            hits += start
            pos.append(hits)
    if not pos:
        empty = np.zeros(0, old_bits.dtype)
        return np.zeros(0, np.int64), empty, empty.copy()
    return (np.concatenate(pos).astype(np.int64, copy=False), np.concatenate(old_vals),
            np.concatenate(new_vals))


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
