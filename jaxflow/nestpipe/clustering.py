"""Key-centric sample clustering for frozen-window micro-batches.

Samples that share keys are put in the same micro-batch, so per-micro-batch dedup removes
more duplicates and fewer rows cross the All2All. Clustering only permutes samples inside a
batch; under gradient accumulation the full-batch update is unchanged up to the sum order.
"""

from __future__ import annotations

import numpy as np

from jaxflow.host_jit import compiled_module


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

    ``"vote"`` (compiled when numba is present, else vectorised numpy, the same result;
    ~0.9 ms compiled vs ~3 ms numpy for 2,048 samples x 32 ids in 8 groups): a few rounds of
    "each key's home is the micro-batch most of its samples are in; each sample prefers the
    home most of its keys have", then samples sorted by preference and cut into equal runs
    (balance).
    ``"greedy"`` (a Python loop, slower, removes ~1.6x more duplicates here): one sample at
    a time joins the micro-batch with room that already holds most of its shareable keys.
    """
    return cluster_groups(sparse, 1, micro_batches, method)


def cluster_groups(sparse: dict[str, np.ndarray], groups: int, micro_batches: int,
                   method: str = "vote") -> np.ndarray:
    """``cluster_samples`` inside each of ``groups`` equal consecutive runs of the batch (a
    device's shard: samples never leave their group), all groups in one vectorised pass for
    ``"vote"``: int[B] permutation equal to concatenating ``g * per + cluster_samples(run g)``.
    """
    if method not in CLUSTER_METHODS:
        raise ValueError(f"method={method!r}; valid: {', '.join(CLUSTER_METHODS)}")
    keys = _batch_keys(sparse)
    b = keys.shape[0]
    if groups < 1 or b % (groups * micro_batches):
        raise ValueError(f"batch {b} is not divisible by {groups} group(s) x "
                         f"micro_batches={micro_batches}")
    per = b // groups
    if method == "greedy":
        return np.concatenate([g * per + _greedy(keys[g * per:(g + 1) * per], micro_batches)
                               for g in range(groups)])
    compiled = _compiled_vote()
    if compiled is not None:  # the same permutation, compiled (tests compare the two)
        return compiled(keys, per, micro_batches, 3)
    group = np.arange(b) // per
    # a key in another group is another key: shift each group's keys into its own range
    span = int(keys.max(initial=0)) + 1
    keys = np.where(keys >= 0, keys + group[:, None] * span, -1)
    uniq, inv = np.unique(keys, return_inverse=True)
    inv = inv.reshape(keys.shape)
    count = np.bincount(inv.ravel(), minlength=uniq.size)
    shareable = (count > 1) & (count <= micro_batches) & (uniq >= 0)
    return _vote(inv, shareable, micro_batches, per, group)


def _greedy(keys: np.ndarray, n: int) -> np.ndarray:
    b = keys.shape[0]
    cap = b // n
    uniq, inv = np.unique(keys, return_inverse=True)
    inv = inv.reshape(keys.shape)
    count = np.bincount(inv.ravel(), minlength=uniq.size)
    shareable = (count > 1) & (count <= n) & (uniq >= 0)
    holds = np.zeros((n, uniq.size), bool)
    size = np.zeros(n, np.int64)
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


def _vote(inv: np.ndarray, shareable: np.ndarray, n: int, per: int, group: np.ndarray,
          rounds: int = 3) -> np.ndarray:
    """Vote rounds for every group at once (counts by ``bincount``, exact in integers)."""
    b, k_all = inv.shape[0], shareable.size
    cap = per // n
    mask = shareable[inv].ravel()
    sample = np.repeat(np.arange(b), inv.shape[1])[mask]
    key = inv.ravel()[mask]
    rank = np.arange(b) % per  # position inside the group
    assign = rank % n
    for _ in range(rounds):
        key_votes = np.bincount(key * n + assign[sample], minlength=k_all * n).reshape(k_all, n)
        home = key_votes.argmax(1)
        votes = np.bincount(sample * n + home[key], minlength=b * n).reshape(b, n)
        strongest = votes.max(1)
        prefer = np.where(strongest > 0, votes.argmax(1), assign)
        # by group, then preference, strongest preferences first in each run (stable)
        order = np.lexsort((-strongest, prefer, group))
        assign = np.empty(b, np.int64)
        assign[order] = rank // cap
    return np.argsort(group * n + assign, kind="stable")


def _compiled_vote():
    """``_vote_nb.vote`` (imported on first use), or None without numba."""
    module = compiled_module("jaxflow.nestpipe._vote_nb")
    return None if module is None else module.vote


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


def shard_micro_batch_transfers(sparse: dict[str, np.ndarray], num_shards: int,
                                micro_batches: int, order: np.ndarray | None = None) -> int:
    """Rows moved on a mesh of ``num_shards`` devices: device p dedups each micro-batch of its
    own shard (samples ``p*B/P .. (p+1)*B/P``, after the permutation ``order``, e.g.
    ``stages.cluster_order``); the sum of ``micro_batch_transfers`` over shards."""
    b = next(iter(sparse.values())).shape[0]
    if b % num_shards:
        raise ValueError(f"batch {b} is not divisible by num_shards={num_shards}")
    per = b // num_shards
    idx = np.arange(b) if order is None else np.asarray(order)
    return sum(micro_batch_transfers({k: np.asarray(v)[idx[p * per:(p + 1) * per]]
                                      for k, v in sparse.items()}, micro_batches)
               for p in range(num_shards))
