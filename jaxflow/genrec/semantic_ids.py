"""Semantic IDs by residual k-means (RQ-KMeans), as in OneRec / MiniOneRec and OxygenREC.

Level l clusters the residual left by levels 0..l-1 into ``width`` centroids (Lloyd's
algorithm in JAX: one jitted program, items optionally sharded over a mesh axis); an item's
semantic ID is its tuple of centroid indices. The last level is *collision-resolving*: items
that share the first ``levels - 1`` codes get distinct last codes, each item taking the nearest
last-level centroid not yet taken by a closer item of its group (greedy by distance). A group
larger than ``width`` cannot be made unique and raises an error naming the prefix.

Public API: ``rq_kmeans`` -> ``SemanticIds`` (codes, codebooks, per-level reconstruction
error, codebook utilisation, collision rate), ``kmeans`` (one level).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class SemanticIds:
    """Result of :func:`rq_kmeans`.

    Attributes:
      codes: int32[N, L] collision-free semantic ID of every item (row = item index).
      codebooks: float32[L, W, D] centroids of each level.
      reconstruction_error: L floats, mean squared norm of the residual after levels 0..l
        (with the collision-resolved last level).
      raw_reconstruction_error: the same with the last level's plain nearest-centroid codes.
      utilisation: L floats, fraction of each level's W codes used by at least one item.
      collision_rate: fraction of items whose plain L-level code tuple is shared with another
        item (before the last level resolves collisions).
    """

    codes: np.ndarray
    codebooks: np.ndarray
    reconstruction_error: tuple[float, ...]
    raw_reconstruction_error: tuple[float, ...]
    utilisation: tuple[float, ...]
    collision_rate: float

    @property
    def levels(self) -> int:
        return self.codes.shape[1]

    @property
    def width(self) -> int:
        return self.codebooks.shape[1]

    def item_of_code(self) -> dict[tuple[int, ...], int]:
        """The code -> item table (the inverse of ``codes``)."""
        return {tuple(int(c) for c in row): i for i, row in enumerate(self.codes)}


def _sq_dists(x, c):
    """[N, D], [K, D] -> [N, K] squared Euclidean distances (f32)."""
    return (jnp.sum(x * x, -1, keepdims=True) - 2.0 * x @ c.T + jnp.sum(c * c, -1)[None, :])


@partial(jax.jit, static_argnames=("k", "iters"))
def _lloyd(x, weight, init, *, k: int, iters: int):
    def body(_, c):
        assign = jnp.argmin(_sq_dists(x, c), axis=1)
        sums = jax.ops.segment_sum(x * weight[:, None], assign, num_segments=k)
        counts = jax.ops.segment_sum(weight, assign, num_segments=k)
        # an empty cluster keeps its centroid
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1e-12)[:, None], c)

    c = jax.lax.fori_loop(0, iters, body, init)
    return c, jnp.argmin(_sq_dists(x, c), axis=1).astype(jnp.int32)


def kmeans(x, k: int, *, key: jax.Array, iters: int = 25, weight=None, mesh=None,
           axis: str = "data") -> tuple[jax.Array, jax.Array]:
    """Lloyd's k-means.

    Args:
      x: f32[N, D] points.
      k: number of centroids (k > N leaves some centroids duplicated; they stay unused).
      key: PRNG key (keyword-only) choosing the initial centroids among the points.
      iters: Lloyd iterations.
      weight: optional f32[N] point weights (0 = padding row).
      mesh, axis: optional mesh whose ``axis`` the points are sharded over (N must be divisible
        by its size); centroid sums then reduce across shards inside the jitted program.

    Returns:
      (centroids f32[k, D], assignment int32[N]).
    """
    x = jnp.asarray(x, jnp.float32)
    n = x.shape[0]
    weight = jnp.ones((n,), jnp.float32) if weight is None else jnp.asarray(weight, jnp.float32)
    real = np.flatnonzero(np.asarray(weight) > 0)
    pick = np.asarray(jax.random.choice(key, len(real), (k,), replace=k > len(real)))
    init = x[real[pick]]
    if mesh is not None:
        x = jax.device_put(x, NamedSharding(mesh, P(axis, None)))
        weight = jax.device_put(weight, NamedSharding(mesh, P(axis)))
    return _lloyd(x, weight, init, k=k, iters=iters)


def _resolve_last_level(prefix: np.ndarray, dists: np.ndarray, width: int) -> np.ndarray:
    """Distinct last codes within each prefix group: greedy by distance (closest pair first)."""
    n = prefix.shape[0]
    last = np.full(n, -1, np.int64)
    _, group, sizes = np.unique(prefix, axis=0, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    if sizes.max() > width:
        g = int(np.argmax(sizes))
        bad = tuple(int(c) for c in prefix[np.flatnonzero(group == g)[0]])
        raise ValueError(
            f"semantic-ID prefix {bad} holds {int(sizes[g])} items but the last level has width "
            f"{width}: their codes would collide; raise the width or the number of levels")
    for g in np.flatnonzero(sizes > 1):
        members = np.flatnonzero(group == g)
        order = np.argsort(dists[members], axis=None, kind="stable")
        taken = np.zeros(width, bool)
        done = np.zeros(len(members), bool)
        for flat in order:
            m, c = divmod(int(flat), width)
            if done[m] or taken[c]:
                continue
            last[members[m]], taken[c], done[m] = c, True, True
            if done.all():
                break
    single = last < 0
    last[single] = np.argmin(dists[single], axis=1)
    return last


def rq_kmeans(embeddings, *, levels: int = 3, width: int = 256, key: jax.Array,
              iters: int = 25, mesh=None, axis: str = "data") -> SemanticIds:
    """Residual k-means semantic IDs with a collision-resolving last level.

    Args:
      embeddings: f32[N, D] item embeddings (N >= 1, finite).
      levels: L >= 1 code levels.
      width: W >= 2 codes per level.
      key: PRNG key (keyword-only), split per level.
      iters: Lloyd iterations per level.
      mesh, axis: optional mesh to shard items over (N is padded with weight-0 rows).

    Returns:
      SemanticIds with codes int32[N, L] unique per item.

    Raises:
      ValueError: bad shapes / values, or a prefix group larger than ``width``.
    """
    x = np.asarray(embeddings, np.float32)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"embeddings shape {x.shape}: need [N >= 1, D >= 1]")
    if not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x).all(1))[:5].tolist()
        raise ValueError(f"embeddings of items {bad} are not finite")
    if levels < 1 or width < 2:
        raise ValueError(f"levels={levels}, width={width}: need levels >= 1 and width >= 2")
    n = x.shape[0]
    pad = 0 if mesh is None else (-n) % mesh.shape[axis]
    xp = np.concatenate([x, np.zeros((pad, x.shape[1]), np.float32)])
    weight = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    residual = jnp.asarray(xp)
    books, codes, raw_err = [], [], []
    keys = jax.random.split(key, levels)
    for level in range(levels):
        c, a = kmeans(residual, width, key=keys[level], iters=iters, weight=weight, mesh=mesh,
                      axis=axis)
        if level == levels - 1:
            before_last = np.asarray(residual)[:n]
        residual = residual - c[a]
        books.append(np.asarray(c))
        codes.append(np.asarray(a)[:n])
        raw_err.append(float(np.mean(np.sum(np.asarray(residual)[:n] ** 2, -1))))
    codes = np.stack(codes, 1).astype(np.int64)
    _, counts = np.unique(codes, axis=0, return_inverse=False, return_counts=True)
    _, inv = np.unique(codes, axis=0, return_inverse=True)
    collision_rate = float(np.mean(counts[inv.reshape(-1)] > 1))
    dists = np.asarray(_sq_dists(jnp.asarray(before_last), jnp.asarray(books[-1])))
    codes[:, -1] = _resolve_last_level(codes[:, :-1], dists, width)
    final = before_last - books[-1][codes[:, -1]]
    err = tuple(raw_err[:-1]) + (float(np.mean(np.sum(final ** 2, -1))),)
    util = tuple(float(len(np.unique(codes[:, l])) / width) for l in range(levels))
    return SemanticIds(codes=codes.astype(np.int32), codebooks=np.stack(books),
                       reconstruction_error=err, raw_reconstruction_error=tuple(raw_err),
                       utilisation=util, collision_rate=collision_rate)
