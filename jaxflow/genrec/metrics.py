"""Top-K ranking metrics over the full item set: Recall@K and NDCG@K (one target per request)."""

from __future__ import annotations

import numpy as np


def recall_ndcg_at_k(ranked, target, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-request Recall@K and NDCG@K for a single held-out target.

    Args:
      ranked: int[B, >= k] item ids best first (-1 = no item); target: int[B].
      k: cut-off.

    Returns:
      (recall f32[B], ndcg f32[B]): recall 1 if the target is in the top k, NDCG
      1 / log2(rank + 2) at its 0-based rank (the ideal DCG of one relevant item is 1).
    """
    ranked = np.asarray(ranked)
    target = np.asarray(target)
    if ranked.ndim != 2 or ranked.shape[1] < k or ranked.shape[0] != target.shape[0]:
        raise ValueError(f"ranked shape {ranked.shape} and target shape {target.shape}: need "
                         f"[B, >= k={k}] and [B]")
    hits = ranked[:, :k] == target[:, None]
    recall = hits.any(1).astype(np.float32)
    rank = np.argmax(hits, axis=1)
    ndcg = np.where(recall > 0, 1.0 / np.log2(rank + 2.0), 0.0).astype(np.float32)
    return recall, ndcg


def popularity_ranking(train_items, n_items: int, k: int) -> np.ndarray:
    """The k most frequent items of ``train_items`` (ties: lower id first): int[k]."""
    counts = np.bincount(np.asarray(train_items).reshape(-1), minlength=n_items)
    return np.argsort(-counts, kind="stable")[:k]
