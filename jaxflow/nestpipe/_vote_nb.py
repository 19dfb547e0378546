"""The compiled vote clustering of :mod:`jaxflow.nestpipe.clustering` (imported there on
first use, so ``import jaxflow.nestpipe`` does not load numba; module level, so numba caches it
on disk)."""

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def vote(keys, per, n, rounds):
    """``_vote`` after the key numbering, in one compiled pass per stage: keys are
    numbered by an open-addressing hash table instead of ``np.unique`` (the vote does not
    depend on how keys are numbered), the stable sorts are counting sorts."""
    b, width = keys.shape
    cap = per // n
    # -- number the keys (group, key) -> 0..k-1; -1 = padding
    size, bits = 1, 0
    while size < 2 * b * width + 2:
        size *= 2
        bits += 1
    shift = np.uint64(64 - bits)  # Fibonacci hashing: the product's top bits
    table = np.full((size, 2), -1, np.int64)  # (key code, its number): one line a probe
    inv = np.empty((b, width), np.int64)
    span = keys.max() + 1
    k_all = 0
    for i in range(b):
        g = i // per
        for j in range(width):
            code = keys[i, j]
            if code < 0:
                inv[i, j] = -1
                continue
            code += g * span  # a key in another group is another key
            h = np.int64((np.uint64(code) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
            while table[h, 0] != -1 and table[h, 0] != code:
                h = (h + 1) & (size - 1)
            if table[h, 0] == -1:
                table[h, 0] = code
                table[h, 1] = k_all
                k_all += 1
            inv[i, j] = table[h, 1]
    count = np.zeros(k_all, np.int64)
    for i in range(b):
        for j in range(width):
            if inv[i, j] >= 0:
                count[inv[i, j]] += 1
    # -- the (sample, key) pairs of shareable keys, in row-major order (as _vote's mask)
    m = 0
    for i in range(b):
        for j in range(width):
            k = inv[i, j]
            if k >= 0 and count[k] > 1 and count[k] <= n:
                m += 1
    sample = np.empty(m, np.int64)
    key = np.empty(m, np.int64)
    m = 0
    for i in range(b):
        for j in range(width):
            k = inv[i, j]
            if k >= 0 and count[k] > 1 and count[k] <= n:
                sample[m] = i
                key[m] = k
                m += 1
    assign = np.empty(b, np.int64)
    for i in range(b):
        assign[i] = (i % per) % n
    key_votes = np.zeros((k_all, n), np.int64)
    votes = np.zeros((b, n), np.int64)
    home = np.empty(k_all, np.int64)
    prefer = np.empty(b, np.int64)
    strongest = np.empty(b, np.int64)
    order = np.empty(per, np.int64)
    buckets = n * (width + 1)
    fill = np.empty(buckets + 1, np.int64)
    for _ in range(rounds):
        key_votes[:] = 0
        for t in range(m):
            key_votes[key[t], assign[sample[t]]] += 1
        for k in range(k_all):  # argmax: the first maximum, as numpy's
            best = 0
            for c in range(1, n):
                if key_votes[k, c] > key_votes[k, best]:
                    best = c
            home[k] = best
        votes[:] = 0
        for t in range(m):
            votes[sample[t], home[key[t]]] += 1
        for i in range(b):
            best = 0
            for c in range(1, n):
                if votes[i, c] > votes[i, best]:
                    best = c
            strongest[i] = votes[i, best]
            prefer[i] = best if strongest[i] > 0 else assign[i]
        # per group, stable by (prefer, -strongest): np.lexsort((-strongest, prefer, group))
        for g in range(b // per):
            lo = g * per
            fill[:] = 0
            for i in range(lo, lo + per):
                fill[prefer[i] * (width + 1) + (width - strongest[i]) + 1] += 1
            for q in range(buckets):
                fill[q + 1] += fill[q]
            for i in range(lo, lo + per):
                q = prefer[i] * (width + 1) + (width - strongest[i])
                order[fill[q]] = i
                fill[q] += 1
            for r in range(per):
                assign[order[r]] = r // cap
    # np.argsort(group * n + assign, kind="stable"): per group, stable by assign
    out = np.empty(b, np.int64)
    start = np.empty(n + 1, np.int64)
    for g in range(b // per):
        lo = g * per
        start[:] = 0
        for i in range(lo, lo + per):
            start[assign[i] + 1] += 1
        for c in range(n):
            start[c + 1] += start[c]
        for i in range(lo, lo + per):
            out[lo + start[assign[i]]] = i
            start[assign[i]] += 1
    return out
