"""Plain section codecs: dense, exact, coo (the paper's int32 + bf16) and gap.

A *bucket* section covers one or more bf16 leaves whose flat positions are concatenated into
one position space of ``total`` elements. Encoders take the sorted changed positions in that
space and the new bf16 bit patterns there; decoders validate every length, count and position
and return ``(positions int64, new_bits uint16)``. Entropy-coded sections live in entropy.py.
"""

from __future__ import annotations

import numpy as np

from jaxflow.sync.payload import PayloadError

_U32_MAX = (1 << 32) - 1


def frombuffer(stream: bytes, dtype, count: int, what: str) -> np.ndarray:
    """``np.frombuffer`` that insists on exactly ``count`` items of ``dtype``."""
    dtype = np.dtype(dtype)
    if count < 0 or len(stream) != count * dtype.itemsize:
        raise PayloadError(f"{what}: {len(stream)} bytes, expected {count} x {dtype.itemsize}")
    return np.frombuffer(stream, dtype=dtype, count=count)


def meta_int(meta: dict, key: str, lo: int = 0, hi: int | None = None) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (
            hi is not None and value > hi):
        raise PayloadError(f"section meta {key}={value!r} invalid (need int in [{lo}, {hi}])")
    return value


def check_streams(streams: tuple, count: int, kind: str) -> None:
    if len(streams) != count:
        raise PayloadError(f"{kind} section has {len(streams)} streams, expected {count}")


def check_positions(pos: np.ndarray, total: int, what: str) -> np.ndarray:
    """Positions must be strictly increasing and inside [0, total)."""
    if pos.size:
        if pos[0] < 0 or pos[-1] >= total:
            raise PayloadError(f"{what}: positions out of range [0, {total})")
        if pos.size > 1 and not np.all(pos[1:] > pos[:-1]):
            raise PayloadError(f"{what}: positions not strictly increasing")
    return pos


def gaps_of(pos: np.ndarray) -> np.ndarray:
    """Zero-based gaps: g0 = p0, gi = pi - p(i-1) - 1 (all >= 0 for strictly increasing p)."""
    gaps = np.empty(pos.size, np.int64)
    if pos.size:
        gaps[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def positions_of(gaps: np.ndarray) -> np.ndarray:
    pos = np.cumsum(gaps.astype(np.int64) + 1)
    pos -= 1
    return pos


# --- dense / exact (one leaf) -----------------------------------------------------------------

def dense_encode(new_bits: np.ndarray) -> tuple[dict, tuple[bytes, ...]]:
    return {}, (new_bits.tobytes(),)


def dense_decode(streams: tuple, size: int) -> np.ndarray:
    check_streams(streams, 1, "dense")
    return frombuffer(streams[0], np.uint16, size, "dense values")


def exact_encode(raw: np.ndarray) -> tuple[dict, tuple[bytes, ...]]:
    return {}, (np.ascontiguousarray(raw).tobytes(),)


def exact_decode(streams: tuple, dtype, size: int) -> np.ndarray:
    check_streams(streams, 1, "exact")
    return frombuffer(streams[0], dtype, size, "exact values")


# --- coo: int32 position + bf16 value (6 bytes per change) ------------------------------------

def coo_encode(pos: np.ndarray, new_bits: np.ndarray, total: int) -> tuple[dict, tuple]:
    if total > np.iinfo(np.int32).max:
        raise ValueError(f"coo needs buckets under 2**31 elements, got {total}")
    return {"count": int(pos.size)}, (pos.astype("<i4").tobytes(), new_bits.astype("<u2").tobytes())


def coo_decode(meta: dict, streams: tuple, total: int) -> tuple[np.ndarray, np.ndarray]:
    check_streams(streams, 2, "coo")
    count = meta_int(meta, "count", 0, total)
    pos = frombuffer(streams[0], "<i4", count, "coo positions").astype(np.int64)
    vals = frombuffer(streams[1], "<u2", count, "coo values")
    return check_positions(pos, total, "coo"), vals


# --- gap: narrowest unsigned gap width + uint32 escapes ---------------------------------------

def gap_encode(pos: np.ndarray, new_bits: np.ndarray, total: int) -> tuple[dict, tuple]:
    if total > _U32_MAX:
        raise ValueError(f"gap codec needs buckets under 2**32 - 1 elements, got {total}")
    gaps = gaps_of(pos)
    best = None
    for width in (1, 2, 4):
        sentinel = (1 << (8 * width)) - 1
        n_escapes = int(np.count_nonzero(gaps >= sentinel)) if width < 4 else 0
        size = gaps.size * width + 4 * n_escapes
        if best is None or size < best[0]:
            best = (size, width, sentinel)
    _, width, sentinel = best
    dtype = np.dtype(f"<u{width}")
    escaped = gaps >= sentinel if width < 4 else np.zeros(gaps.size, bool)
    narrow = np.where(escaped, sentinel, gaps).astype(dtype)
    escapes = gaps[escaped].astype("<u4")
    meta = {"count": int(pos.size), "width": width, "escapes": int(escapes.size)}
    return meta, (narrow.tobytes(), escapes.tobytes(), new_bits.astype("<u2").tobytes())


def gap_decode(meta: dict, streams: tuple, total: int) -> tuple[np.ndarray, np.ndarray]:
    check_streams(streams, 3, "gap")
    count = meta_int(meta, "count", 0, total)
    width = meta_int(meta, "width", 1, 4)
    if width not in (1, 2, 4):
        raise PayloadError(f"gap width {width} invalid; valid: 1, 2, 4")
    n_escapes = meta_int(meta, "escapes", 0, count)
    narrow = frombuffer(streams[0], f"<u{width}", count, "gap widths").astype(np.int64)
    escapes = frombuffer(streams[1], "<u4", n_escapes, "gap escapes")
    vals = frombuffer(streams[2], "<u2", count, "gap values")
    if width < 4:
        escaped = narrow == (1 << (8 * width)) - 1
        if int(np.count_nonzero(escaped)) != n_escapes:
            raise PayloadError(f"gap section has {int(np.count_nonzero(escaped))} escape "
                               f"markers but {n_escapes} escape values")
        narrow[escaped] = escapes
    pos = positions_of(narrow)
    return check_positions(pos, total, "gap"), vals
