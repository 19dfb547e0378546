"""Key-centric sample clustering for frozen-window micro-batches.

Samples that share keys are put in the same micro-batch, so per-micro-batch dedup removes
more duplicates and fewer rows cross the All2All. Clustering only permutes samples inside a
batch; under gradient accumulation the full-batch update is unchanged up to the sum order.
"""

from __future__ import annotations

import numpy as np


def _batch_keys(sparse: dict[str, np.ndarray]) -> np.ndarray:
    """int64[B, total ids]: every table's ids, offset so tables never collide (-1 = padding)."""
    cols, offset = [], 0
    for name in sorted(sparse):
        x = np.asarray(sparse[name]).astype(np.int64)
        x = x.reshape(x.shape[0], -1)
        cols.append(np.where(x >= 0, x + offset, -1))
        offset += int(x.max(initial=0)) + 1
    return np.concatenate(cols, axis=1)


CLUSTER_METHODS = ("vote", "greedy")


def cluster_samples(sparse: dict[str, np.ndarray], micro_batches: int,
                    method: str = "vote") -> np.ndarray:
    """A permutation of the batch's samples (int[B]) into ``micro_batches`` equal runs.

    Only *shareable* keys steer it — keys seen 2..N times in the batch: a key seen once cannot
    be shared, and one seen more than N times lands in every micro-batch whatever the order.

    ``"vote"`` (vectorised, ~7 ms for 2048 samples x 32 ids): a few rounds of "each key's home
    is the micro-batch most of its samples are in; each sample prefers the home most of its
    keys have", then samples sorted by preference and cut into equal runs (balance).
    ``"greedy"`` (a Python loop, ~4x slower, removes ~1.6x more duplicates here): one sample at
    a time joins the micro-batch with room that already holds most of its shareable keys.
    """
    if method not in CLUSTER_METHODS:
        raise ValueError(f"method={method!r}; valid: {', '.join(CLUSTER_METHODS)}")
    keys = _batch_keys(sparse)
    b = keys.shape[0]
    if b % micro_batches:
        raise ValueError(f"batch {b} is not divisible by micro_batches={micro_batches}")
    cap = b // micro_batches
    uniq, inv = np.unique(keys, return_inverse=True)
    inv = inv.reshape(keys.shape)
    count = np.bincount(inv.ravel(), minlength=uniq.size)
    shareable = (count > 1) & (count <= micro_batches) & (uniq >= 0)
    if method == "vote":
        return _vote(inv, shareable, micro_batches, cap)
    holds = np.zeros((micro_batches, uniq.size), bool)
    size = np.zeros(micro_batches, np.int64)
    assign = np.empty(b, np.int64)
    for i in range(b):
        k = inv[i][shareable[inv[i]]]
        score = holds[:, k].sum(1).astype(np.float64)
        score[size >= cap] = -1.0
        m = int(np.argmax(score)) if score.max() > 0 else int(np.argmin(np.where(size >= cap, b, size)))
        assign[i] = m
        size[m] += 1
        holds[m, k] = True
    return np.argsort(assign, kind="stable")


def _vote(inv: np.ndarray, shareable: np.ndarray, n: int, cap: int, rounds: int = 3) -> np.ndarray:
    b = inv.shape[0]
    mask = shareable[inv].ravel()
    sample = np.repeat(np.arange(b), inv.shape[1])[mask]
    key = inv.ravel()[mask]
    assign = np.arange(b) % n
    for _ in range(rounds):
        key_votes = np.zeros((shareable.size, n))
        np.add.at(key_votes, (key, assign[sample]), 1)
        home = key_votes.argmax(1)
        votes = np.zeros((b, n))
        np.add.at(votes, (sample, home[key]), 1)
        prefer = np.where(votes.max(1) > 0, votes.argmax(1), assign)
        order = np.lexsort((-votes.max(1), prefer))  # strongest preferences first in each run
        assign = np.empty(b, np.int64)
        assign[order] = np.arange(b) // cap
    return np.argsort(assign, kind="stable")


def micro_batch_transfers(sparse: dict[str, np.ndarray], micro_batches: int,
                          order: np.ndarray | None = None) -> int:
    """Rows moved when every micro-batch dedups its own ids: sum over micro-batches and
    tables of the distinct non-padding keys."""
    total = 0
    for ids in sparse.values():
        x = np.asarray(ids) if order is None else np.asarray(ids)[order]
        for part in np.split(x, micro_batches):
            total += np.unique(part[part >= 0]).size
    return total
