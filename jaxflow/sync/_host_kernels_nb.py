"""The compiled kernels of :mod:`jaxflow.sync.host_kernels` (imported there on first use, so
``import jaxflow.sync`` does not load numba). Module level, so numba caches them on disk
(``cache=True``)."""

import numba
import numpy as np

_LOW16 = np.uint64(0xFFFF)


@numba.njit(cache=True, nogil=True, inline="always")
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


@numba.njit(cache=True, nogil=True)
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


@numba.njit(cache=True, nogil=True)
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


@numba.njit(cache=True, nogil=True)
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


@numba.njit(cache=True, nogil=True, inline="always")
def _lane_terms(base, c, word):  # digest._host_terms of one word: (h, h * c) mod 2**32
    h = _U32(base ^ word)
    h = _U32(h ^ _U32(h >> _U32(16)))
    h = _U32(h * _F1)
    h = _U32(h ^ _U32(h >> _U32(13)))
    h = _U32(h * _F2)
    h = _U32(h ^ _U32(h >> _U32(16)))
    return h, _U32(h * c)


@numba.njit(cache=True, nogil=True)
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


@numba.njit(cache=True, nogil=True)
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
