"""Compiled host kernel of the sender's bf16 diff: one pass over the words, changes out.

The host sync path reads the snapshot and the fresh bf16 cast once per publish. In numpy that
read is a compare pass writing a mask, then compaction passes over the mask, then gathers
(``bits.diff_bits``): several array passes per leaf, with per-call overhead on each.
``diff_bf16`` does it in one compiled loop over 64-bit words (four bf16 elements each): a
word that differs is split into its elements and each changed element's position, old and
new bit pattern is written out. Memory traffic is the two reads and the few changes. (The
digest lanes' change stays numpy, ``digest.lanes_deltas``: its 32-bit multiplies vectorise
there, where a per-change scalar loop here measured about 2x slower.)

The kernel is compiled with numba (``cache=True``: once per machine, on first use). Without
numba, or with ``JAXFLOW_HOST_KERNELS=numpy``, ``available()`` is False and callers use the
numpy path: same outputs (the equivalence is the test), only slower.
"""

from __future__ import annotations

import numpy as np

from jaxflow.host_jit import numba_or_none

_MASK = 0xFFFFFFFF


_nb = numba_or_none()

if _nb is not None:
    _LOW16 = np.uint64(0xFFFF)

    @_nb.njit(cache=True, nogil=True, inline="always")
    def _split(w, a, b, k, pos, olds, news):
        # The four elements of a differing word are written unconditionally and the cursor
        # advances by "this element changed": no data-dependent branch per element (the
        # changes are random, such a branch mispredicts).
        x = a ^ b
        for j in range(4):
            sh = np.uint64(16 * j)
            pos[k] = 4 * w + j
            olds[k] = (a >> sh) & _LOW16
            news[k] = (b >> sh) & _LOW16
            k += ((x >> sh) & _LOW16) != 0
        return k

    @_nb.njit(cache=True, nogil=True)
    def _kernel(old_w, new_w, old16, new16, pos, olds, news):
        k = 0
        cap = pos.size - 16  # room for the elements of one more group of four words
        n = old_w.size
        n4 = n - n % 4
        for w0 in range(0, n4, 4):  # four words (16 elements) per test: fewer branches
            x0 = old_w[w0] ^ new_w[w0]
            x1 = old_w[w0 + 1] ^ new_w[w0 + 1]
            x2 = old_w[w0 + 2] ^ new_w[w0 + 2]
            x3 = old_w[w0 + 3] ^ new_w[w0 + 3]
            if (x0 | x1) | (x2 | x3):
                if k > cap:
                    return -1  # buffers full: the caller takes the numpy path
                for w in range(w0, w0 + 4):
                    if old_w[w] != new_w[w]:
                        k = _split(w, old_w[w], new_w[w], k, pos, olds, news)
        if k > cap:
            return -1
        for w in range(n4, n):
            if old_w[w] != new_w[w]:
                k = _split(w, old_w[w], new_w[w], k, pos, olds, news)
        for i in range(4 * n, old16.size):  # the tail (< 4 elements) that fills no word
            pos[k] = i
            olds[k] = old16[i]
            news[k] = new16[i]
            k += old16[i] != new16[i]
        return k

    _KERNEL = _kernel

    @_nb.njit(cache=True, nogil=True)
    def _rice_kernel(gaps, b, low, unary):
        # MSB-first bit writers, the layout of entropy._pack_low_bits (the top 1-8 bits of
        # every value as fields back to back, then each lower byte as a plane, high to low)
        # and of np.packbits over the unary bits (q zeros, then a one).
        n = gaps.size
        planes = (b - 1) // 8 if b > 0 else 0  # whole low byte planes after the top field
        hb = b - 8 * planes  # 1..8 bits of top field (0 when b == 0)
        acc = np.uint64(0)
        nbits = 0
        out = 0
        if hb > 0:
            fmask = np.uint64((1 << hb) - 1)
            top = np.uint64(8 * planes)
            for i in range(n):
                acc = (acc << np.uint64(hb)) | ((np.uint64(gaps[i]) >> top) & fmask)
                nbits += hb
                while nbits >= 8:
                    nbits -= 8
                    low[out] = (acc >> np.uint64(nbits)) & np.uint64(0xFF)
                    out += 1
            if nbits:
                low[out] = (acc << np.uint64(8 - nbits)) & np.uint64(0xFF)
                out += 1
        for j in range(planes - 1, -1, -1):
            sh = np.uint64(8 * j)
            for i in range(n):
                low[out] = (np.uint64(gaps[i]) >> sh) & np.uint64(0xFF)
                out += 1
        bit = 0  # unary: the buffer arrives zeroed; only the ones are written
        for i in range(n):
            bit += (gaps[i] >> b)
            unary[bit >> 3] |= np.uint8(0x80 >> (bit & 7))
            bit += 1
        return out, bit

    @_nb.njit(cache=True, nogil=True)
    def _value_bits_kernel(deltas, signs, big, extra):
        # entropy.deltas_encode's streams before zstd: np.packbits(delta < 0),
        # np.packbits(|delta| > 1) and |delta| - 2 of the flagged ones (delta as int16).
        # Branch-free: the signs are random, a branch on them mispredicts half the time.
        k = 0
        zero = 0
        sb = 0
        bb = 0
        n = deltas.size
        for i in range(n):
            u = np.int32(deltas[i])
            neg = u >> 15
            mag = np.abs(u - (neg << 16))
            flag = np.int32(mag > 1)
            sb = (sb << 1) | neg
            bb = (bb << 1) | flag
            extra[k] = mag - 2
            k += flag
            zero |= np.int32(mag == 0)
            if (i & 7) == 7:
                signs[i >> 3] = sb
                big[i >> 3] = bb
                sb = 0
                bb = 0
        if n & 7:
            signs[n >> 3] = sb << (8 - (n & 7))
            big[n >> 3] = bb << (8 - (n & 7))
        return -1 if zero else k

    _U32 = np.uint32
    _M1, _S1 = _U32(0x9E3779B1), _U32(0x85EBCA77)
    _M2, _S2 = _U32(0xC2B2AE3D), _U32(0x27D4EB2F)
    _F1, _F2 = _U32(0x85EBCA6B), _U32(0xC2B2AE35)

    @_nb.njit(cache=True, nogil=True, inline="always")
    def _lane_terms(base, c, word):  # digest._host_terms of one word: (h, h * c) mod 2**32
        h = _U32(base ^ word)
        h = _U32(h ^ _U32(h >> _U32(16)))
        h = _U32(h * _F1)
        h = _U32(h ^ _U32(h >> _U32(13)))
        h = _U32(h * _F2)
        h = _U32(h ^ _U32(h >> _U32(16)))
        return h, _U32(h * c)

    @_nb.njit(cache=True, nogil=True)
    def _lanes_kernel(pos, olds, news, out):
        # every intermediate cast back to uint32: the wrap-around digest.py relies on, and
        # 32-bit lanes LLVM vectorises (numpy's twin makes ~20 passes over the changes)
        l1 = _U32(0)
        l2 = _U32(0)
        for i in range(pos.size):
            p = _U32(pos[i] & 0xFFFFFFFF)
            base = _U32(_U32(p * _M1) + _S1)
            c = _U32(_U32(_U32(p * _M2) + _S2) | _U32(1))
            h_new, t_new = _lane_terms(base, c, _U32(news[i]))
            h_old, t_old = _lane_terms(base, c, _U32(olds[i]))
            l1 = _U32(l1 + _U32(h_new - h_old))
            l2 = _U32(l2 + _U32(t_new - t_old))
        out[0] = l1
        out[1] = l2

    @_nb.njit(cache=True, nogil=True)
    def _full_lanes_kernel(words, out):
        # digest.host_lanes: every word at its own flat position (mod 2**32)
        l1 = _U32(0)
        l2 = _U32(0)
        for i in range(words.size):
            p = _U32(i & 0xFFFFFFFF)
            base = _U32(_U32(p * _M1) + _S1)
            c = _U32(_U32(_U32(p * _M2) + _S2) | _U32(1))
            h, t = _lane_terms(base, c, _U32(words[i]))
            l1 = _U32(l1 + h)
            l2 = _U32(l2 + t)
        out[0] = l1
        out[1] = l2
else:
    _KERNEL = None


def available() -> bool:
    """True when the compiled kernel is in use (numba importable, not disabled)."""
    return _KERNEL is not None


def diff_bf16(old_bits: np.ndarray, new_bits: np.ndarray, *, scratch: list | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """One-pass diff of two flat uint16 (bf16 bit) arrays of equal size: ``bits.diff_bits``'s
    (positions int64[k], old uint16[k], new uint16[k]), or None when more than 1/16 of the
    elements changed (the output buffers' capacity; the caller then takes the numpy path,
    which has no such bound). ``scratch``: a caller-owned one-element list that keeps the
    output buffers between calls. Requires ``available()``.
    """
    if _KERNEL is None:
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
    k = _KERNEL(old_bits[:whole].view(np.uint64), new_bits[:whole].view(np.uint64),
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
    written, bits_out = _rice_kernel(gaps, b, low, unary)
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
    k = _value_bits_kernel(deltas, signs, big, extra)
    if k < 0:
        raise ValueError("values_encode got unchanged elements")
    return signs, big, extra[:k].copy()



def lanes_delta(positions: np.ndarray, old_words: np.ndarray, new_words: np.ndarray
                ) -> np.ndarray:
    """``digest.lanes_delta`` (bit-identical, tested) in one compiled pass: uint32[2]."""
    out = np.zeros(2, np.uint32)
    _lanes_kernel(np.ascontiguousarray(positions, np.int64), np.ascontiguousarray(old_words),
                  np.ascontiguousarray(new_words), out)
    return out


def full_lanes(words: np.ndarray) -> np.ndarray:
    """``digest.host_lanes`` of a leaf's flat uint8/16/32 words (bit-identical, tested)."""
    out = np.zeros(2, np.uint32)
    _full_lanes_kernel(np.ascontiguousarray(words).reshape(-1), out)
    return out
