"""Semantic IDs by residual k-means (RQ-KMeans), as in OneRec / MiniOneRec and OxygenREC,
with de-duplication codes (TIGER) so that every catalogue gets unique IDs.

Level l clusters the residual left by levels 0..l-1 into ``width`` centroids (Lloyd's
algorithm in JAX: one jitted program, items optionally sharded over a mesh axis); an item's
semantic ID is its tuple of centroid indices, followed by ``dedup_levels`` de-duplication codes.

``dedup`` chooses how items that share a code tuple are told apart:

* ``"auto"`` (default): the last k-means level is *collision-resolving*: the items of a group
  sharing the first ``levels - 1`` codes spread over the last level's centroids greedily by
  distance (the closest (item, centroid) pair first), each centroid taking at most
  ``ceil(group size / width)`` items (1 when the group fits: distinct last codes). Items that
  still share all ``levels`` codes (only groups larger than ``width``) are numbered 0, 1, ...
  in order of distance to their last centroid, and that number, written in base ``width``,
  is appended as ``dedup_levels = ceil(log_width(largest such group))`` extra codes (0 for
  every item that was unique already). A catalogue whose groups all fit gets no extra level.
* ``"tiger"``: TIGER's scheme: plain nearest-centroid codes at every level, then always at
  least one appended code numbering the items that share the whole tuple.
* ``"off"``: the collision-resolving last level only; a group larger than ``width`` raises
  an error naming the prefix.

Every appended code is in [0, width), so the trie, the beam search and the model see a
semantic ID of ``levels + dedup_levels`` codes of one width.

Public API: ``rq_kmeans`` -> ``SemanticIds`` (codes, codebooks, per-level reconstruction
error, codebook utilisation, collision rate, de-duplication levels), ``kmeans`` (one level),
``dedup_codes`` (the numbering of items that share a tuple).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class SemanticIds:
    """Result of :func:`rq_kmeans`.

    Attributes:
      codes: int32[N, L + E] unique semantic ID of every item (row = item index): L k-means
        codes, then E = ``dedup_levels`` de-duplication codes, all in [0, W).
      codebooks: float32[L, W, D] centroids of each k-means level.
      reconstruction_error: L floats, mean squared norm of the residual after levels 0..l
        (with the collision-resolved last level).
      raw_reconstruction_error: the same with the last level's plain nearest-centroid codes.
      utilisation: L + E floats, fraction of each code position's W codes used by an item.
      collision_rate: fraction of items whose plain L-level code tuple is shared with another
        item (before the last level resolves collisions).
      dedup_levels: E, the number of appended de-duplication codes.
      largest_prefix_group: the most items sharing the first L - 1 k-means codes (the
        collision-resolving last level alone makes them unique only up to W).
    """

    codes: np.ndarray
    codebooks: np.ndarray
    reconstruction_error: tuple[float, ...]
    raw_reconstruction_error: tuple[float, ...]
    utilisation: tuple[float, ...]
    collision_rate: float
    dedup_levels: int = 0
    largest_prefix_group: int = 1

    @property
    def levels(self) -> int:
        """Codes per item, L + E (what the trie and the model are built with)."""
        return self.codes.shape[1]

    @property
    def kmeans_levels(self) -> int:
        """Residual k-means levels (the codebooks' first axis)."""
        return self.codebooks.shape[0]

    @property
    def width(self) -> int:
        """Codes per level (the codebooks' second axis)."""
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


DEDUP_MODES = ("auto", "tiger", "off")


def _groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group index int[N], group sizes) of the rows of ``keys`` int[N, K] (K may be 0)."""
    if keys.shape[1] == 0:
        return np.zeros(keys.shape[0], np.int64), np.asarray([keys.shape[0]])
    _, group, sizes = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    return group.reshape(-1), sizes


def _resolve_last_level(prefix: np.ndarray, dists: np.ndarray, width: int, *,
                        allow_shared: bool) -> np.ndarray:
    """Last codes spread within each prefix group, greedy by distance (closest pair first),
    each code taking at most ceil(group size / width) items (distinct codes when it fits)."""
    n = prefix.shape[0]
    last = np.full(n, -1, np.int64)
    group, sizes = _groups(prefix)
    if sizes.max() > width and not allow_shared:
        g = int(np.argmax(sizes))
        bad = tuple(int(c) for c in prefix[np.flatnonzero(group == g)[0]])
        raise ValueError(
            f"semantic-ID prefix {bad} holds {int(sizes[g])} items but the last level has width "
            f"{width}: their codes would collide; raise the width or the number of levels, or "
            "append de-duplication codes (dedup='auto' or 'tiger')")
    for g in np.flatnonzero(sizes > 1):
        members = np.flatnonzero(group == g)
        cap = -(-len(members) // width)
        order = np.argsort(dists[members], axis=None, kind="stable")
        taken = np.zeros(width, np.int64)
        done = np.zeros(len(members), bool)
        left = len(members)
        for flat in order:
            m, c = divmod(int(flat), width)
            if done[m] or taken[c] >= cap:
                continue
            last[members[m]], done[m] = c, True
            taken[c] += 1
            left -= 1
            if not left:
                break
    single = last < 0
    last[single] = np.argmin(dists[single], axis=1)
    return last


def dedup_codes(codes, dist, width: int, *, min_levels: int = 0) -> np.ndarray:
    """De-duplication codes int32[N, E] telling apart items that share a code tuple.

    Items sharing a row of ``codes`` int[N, L] are numbered 0, 1, ... by ``dist`` f32[N]
    (ascending; ties by item index); the number is written in base ``width`` over
    E = max(min_levels, ceil(log_width(largest group))) digits, most significant first.
    Every (codes, dedup) row is then unique.
    """
    codes = np.asarray(codes)
    n = codes.shape[0]
    group, sizes = _groups(codes)
    order = np.lexsort((np.arange(n), np.asarray(dist, np.float64), group))
    rank = np.empty(n, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank[order] = np.arange(n) - starts[group[order]]
    e, cap = min_levels, width ** min_levels
    while cap < sizes.max():
        e, cap = e + 1, cap * width
    digits = [(rank // width ** (e - 1 - j)) % width for j in range(e)]
    return np.stack(digits, 1).astype(np.int32) if e else np.zeros((n, 0), np.int32)


def rq_kmeans(embeddings, *, levels: int = 3, width: int = 256, key: jax.Array,
              iters: int = 25, dedup: str = "auto", mesh=None,
              axis: str = "data") -> SemanticIds:
    """Residual k-means semantic IDs, unique per item (see the module docstring).

    Args:
      embeddings: f32[N, D] item embeddings (N >= 1, finite).
      levels: L >= 1 k-means code levels.
      width: W >= 2 codes per level.
      key: PRNG key (keyword-only), split per level.
      iters: Lloyd iterations per level.
      dedup: "auto", "tiger" or "off" (module docstring).
      mesh, axis: optional mesh to shard items over (N is padded with weight-0 rows).

    Returns:
      SemanticIds with codes int32[N, L + E] unique per item (E = dedup_levels; 0 with
      ``dedup="off"``, >= 1 with ``"tiger"``).

    Raises:
      ValueError: bad shapes / values, or (``dedup="off"`` only) a prefix group larger than
        ``width``.
    """
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup={dedup!r}: must be one of {DEDUP_MODES}")
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
    _, prefix_sizes = _groups(codes[:, :-1])
    if dedup != "tiger":
        codes[:, -1] = _resolve_last_level(codes[:, :-1], dists, width,
                                           allow_shared=dedup == "auto")
    final = before_last - books[-1][codes[:, -1]]
    extra = dedup_codes(codes, np.sum(final ** 2, -1), width,
                        min_levels=1 if dedup == "tiger" else 0)
    err = tuple(raw_err[:-1]) + (float(np.mean(np.sum(final ** 2, -1))),)
    codes = np.concatenate([codes, extra], 1)
    util = tuple(float(len(np.unique(codes[:, lv])) / width) for lv in range(codes.shape[1]))
    return SemanticIds(codes=codes.astype(np.int32), codebooks=np.stack(books),
                       reconstruction_error=err, raw_reconstruction_error=tuple(raw_err),
                       utilisation=util, collision_rate=collision_rate,
                       dedup_levels=extra.shape[1], largest_prefix_group=int(prefix_sizes.max()))
