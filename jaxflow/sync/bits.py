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

    Compares 64-bit words (four bf16 elements at once), in chunks with one reused mask
    buffer so no tensor-sized temporary is allocated. The compaction is two-level: the mask
    bytes of eight words are read as one uint64, so ``flatnonzero`` scans an eighth of the
    mask and only the groups holding a change are expanded; the old and new bits are then
    taken from the few gathered words, never by a second gather into the big arrays. The
    tail that does not fill a word is compared element by element. ``scratch``: a
    caller-owned one-element list that keeps the mask buffer between calls (a fresh buffer
    of this size is a fresh mapping from the allocator on every call: page faults on every
    publish).
    """
    if old_bits.shape != new_bits.shape or old_bits.dtype != new_bits.dtype:
        raise ValueError(f"need equal bit arrays, got {old_bits.dtype}{old_bits.shape} "
                         f"and {new_bits.dtype}{new_bits.shape}")
    old_bits, new_bits = old_bits.reshape(-1), new_bits.reshape(-1)
    n, itemsize = old_bits.size, old_bits.dtype.itemsize
    per_word = 8 // itemsize if itemsize in (1, 2, 4, 8) else 0
    whole = (n // per_word) * per_word if per_word else 0
    pos, old_parts, new_parts = [], [], []
    if whole:
        old_w = old_bits[:whole].view(np.uint64)
        new_w = new_bits[:whole].view(np.uint64)
        if scratch is None:
            scratch = [None]
        if scratch[0] is None or scratch[0].size < min(old_w.size + 8, _CHUNK):
            scratch[0] = np.empty(_CHUNK, bool)
        mask = scratch[0]
        shift = per_word.bit_length() - 1  # log2(per_word)
        for start in range(0, old_w.size, _CHUNK):
            k = min(_CHUNK, old_w.size - start)
            k8 = -(-k // 8) * 8
            m = mask[:k8]
            m[k:] = False
            a, b = old_w[start: start + k], new_w[start: start + k]
            np.not_equal(a, b, out=m[:k])
            groups = m.view(np.uint64)  # the mask bytes of 8 words per entry
            g = np.flatnonzero(groups != 0)
            if not g.size:
                continue
            r = np.flatnonzero(groups[g].view(bool))
            words = (g[r >> 3] << 3) | (r & 7)
            a_at, b_at = a[words].view(old_bits.dtype), b[words].view(old_bits.dtype)
            if per_word == 1:
                sub = np.arange(words.size)
            else:
                sub = np.flatnonzero(a_at != b_at)
            pos.append(((words[sub >> shift] + start) << shift) | (sub & (per_word - 1)))
            old_parts.append(a_at[sub])
            new_parts.append(b_at[sub])
    if whole < n:
        tail = np.flatnonzero(old_bits[whole:] != new_bits[whole:])
        if tail.size:
            pos.append(tail + whole)
            old_parts.append(old_bits[whole:][tail])
            new_parts.append(new_bits[whole:][tail])
    if not pos:
        empty = np.zeros(0, old_bits.dtype)
        return np.zeros(0, np.int64), empty, empty.copy()
    if len(pos) == 1:
        return pos[0].astype(np.int64, copy=False), old_parts[0], new_parts[0]
    return (np.concatenate(pos).astype(np.int64, copy=False), np.concatenate(old_parts),
            np.concatenate(new_parts))


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
