"""Compiled host kernels of the sync path: the sender's bf16 diff, the entropy codec's
streams and the digest lanes, each one pass over its input.

The host sync path reads the snapshot and the fresh bf16 cast once per publish. In numpy that
read is a compare pass writing a mask, then compaction passes over the mask, then gathers
(``bits.diff_bits``): several array passes per leaf, with per-call overhead on each.
``diff_bf16`` does it in one compiled loop over 64-bit words (four bf16 elements each): a
word that differs is split into its elements and each changed element's position, old and
new bit pattern is written out. Memory traffic is the two reads and the few changes. The
other kernels are compiled twins of numpy functions, each tested to give the same output:
``rice_encode`` (``entropy.rice_encode``'s bytes) and ``value_bits`` (the sign / magnitude
streams of ``entropy.deltas_encode``) for the entropy codec, ``lanes_delta`` (the digest
update from a leaf's changes, which ``digest.lanes_deltas`` uses per leaf whenever the kernels
are available and the words are at most 32 bits) and ``full_lanes`` (``digest.host_lanes`` of
a whole leaf).

The kernels are compiled with numba (``cache=True``: once per machine, on first use). Without
numba, or with ``JAXFLOW_HOST_KERNELS=numpy``, ``available()`` is False and callers use the
numpy path: same outputs (the equivalence is the test), only slower.
"""

from __future__ import annotations

import numpy as np

from jaxflow.host_jit import compiled_module


def _kernels():
    """The compiled kernels (``_host_kernels_nb``), imported on first use; None without."""
    return compiled_module("jaxflow.sync._host_kernels_nb")


def available() -> bool:
    """True when the compiled kernel is in use (numba importable, not disabled)."""
    return _kernels() is not None


def diff_bf16(old_bits: np.ndarray, new_bits: np.ndarray, *, scratch: list | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """One-pass diff of two flat uint16 (bf16 bit) arrays of equal size: ``bits.diff_bits``'s
    (positions int64[k], old uint16[k], new uint16[k]), or None when more than 1/16 of the
    elements changed (the output buffers' capacity; the caller then takes the numpy path,
    which has no such bound). ``scratch``: a caller-owned one-element list that keeps the
    output buffers between calls. Requires ``available()``.
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("host_kernels.diff_bf16 needs numba (see available())")
    old_bits, new_bits = old_bits.reshape(-1), new_bits.reshape(-1)
    n = old_bits.size
    whole = n // 4 * 4
    cap = n // 16 + 32  # the kernel stops (-1) rather than write past its buffers
    if scratch is None:
        scratch = [None]
    if scratch[0] is None or scratch[0][0].size < cap:
        size = max(cap, 1 << 16)
        scratch[0] = (np.empty(size, np.int64), np.empty(size, np.uint16),
                      np.empty(size, np.uint16))
    pos, olds, news = (b[:cap] for b in scratch[0])
    k = kernels._kernel(old_bits[:whole].view(np.uint64), new_bits[:whole].view(np.uint64),
                        old_bits, new_bits, pos, olds, news)
    if k < 0:
        return None
    return pos[:k].copy(), olds[:k].copy(), news[:k].copy()


def rice_encode(gaps: np.ndarray, b: int) -> tuple[bytes, bytes, int]:
    """``entropy.rice_encode`` (same bytes, tested) in one compiled pass per stream."""
    gaps = np.ascontiguousarray(gaps, np.int64)
    n = gaps.size
    n_unary = int((gaps >> b).sum()) + n if n else 0
    low = np.empty((n * b + 7) // 8, np.uint8)
    unary = np.zeros((n_unary + 7) // 8, np.uint8)
    written, bits_out = _kernels()._rice_kernel(gaps, b, low, unary)
    assert written == low.size and bits_out == n_unary
    return low.tobytes(), unary.tobytes(), n_unary


def value_bits(deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed sign bits, packed "magnitude > 1" flags, uint16 magnitude - 2 of the flagged)
    of uint16 deltas (new - old mod 2**16, read as int16): ``entropy.deltas_encode``'s
    streams before compression. ValueError on a zero delta (an unchanged element)."""
    deltas = np.ascontiguousarray(deltas, np.uint16)
    packed = (deltas.size + 7) // 8
    signs, big = np.empty(packed, np.uint8), np.empty(packed, np.uint8)
    extra = np.empty(deltas.size + 1, np.uint16)  # + 1: the cursor writes one ahead
    k = _kernels()._value_bits_kernel(deltas, signs, big, extra)
    if k < 0:
        raise ValueError("values_encode got unchanged elements")
    return signs, big, extra[:k].copy()



def lanes_delta(positions: np.ndarray, old_words: np.ndarray, new_words: np.ndarray
                ) -> np.ndarray:
    """``digest.lanes_delta`` (bit-identical, tested) in one compiled pass: uint32[2]."""
    out = np.zeros(2, np.uint32)
    _kernels()._lanes_kernel(np.ascontiguousarray(positions, np.int64),
                             np.ascontiguousarray(old_words), np.ascontiguousarray(new_words), out)
    return out


def full_lanes(words: np.ndarray) -> np.ndarray:
    """``digest.host_lanes`` of a leaf's flat uint8/16/32 words (bit-identical, tested)."""
    out = np.zeros(2, np.uint32)
    _kernels()._full_lanes_kernel(np.ascontiguousarray(words).reshape(-1), out)
    return out
