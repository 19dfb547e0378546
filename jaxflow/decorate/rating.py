"""Pairwise ratings: comparison sampling, Bradley-Terry scores fitted in JAX, the uniform rank
mapping to 0-100, and agreement statistics.

DecorateLM (Zhao et al., EMNLP 2024) rates texts on 8 criteria by asking a judge which of two
texts is better, with every text in at least ~6 random comparisons, then fits Bradley-Terry
scores (Bradley & Terry, 1952): P(i beats j) = sigmoid(s_i - s_j), and maps them to 0-100 by
rank ("uniform").

The fit maximises the log-likelihood with a small ridge prior ``l2 / 2 * ||s||^2`` (without it
an item that wins every comparison has an infinite score); the penalised optimum is unique and
has ``sum(s) = 0``. It runs damped Newton steps (preconditioned conjugate-gradient solves with
Hessian-vector products, so memory stays O(pairs)), vmapped over criteria; the paper's plain
gradient ascent reaches the same optimum more slowly.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: DecorateLM's 8 rating criteria, in a fixed order (column k of every ratings array).
CRITERIA = ("educational_value", "expertise", "fact_and_trivia", "reasoning_level",
            "scarcity", "story_likeness", "structural_format", "subjectivity")


def sample_pairs(n_items: int, min_comparisons: int, *, key: jax.Array) -> np.ndarray:
    """Random comparison pairs in which every item appears at least ``min_comparisons`` times.

    Each round is a random cyclic order of all items, paired with its successor, so every item
    is in exactly 2 pairs per round; ``ceil(min_comparisons / 2)`` rounds are drawn.

    Returns:
      [n_items * rounds, 2] int32 (i, j) pairs with i != j.
    """
    if n_items < 2:
        raise ValueError(f"sample_pairs needs n_items >= 2 to form a pair, got {n_items}")
    if min_comparisons < 1:
        raise ValueError(f"min_comparisons={min_comparisons}; valid: >= 1")
    rounds = math.ceil(min_comparisons / 2)
    out = []
    for k in jax.random.split(key, rounds):
        perm = np.asarray(jax.random.permutation(k, n_items))
        out.append(np.stack([perm, np.roll(perm, -1)], axis=1))
    return np.concatenate(out).astype(np.int32)


def validate_pairs(pairs: np.ndarray, n_items: int) -> np.ndarray:
    """[P, 2] int pairs with both ids in [0, n_items) and i != j; ValueError naming the first
    bad record otherwise."""
    pairs = np.asarray(pairs)
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must have shape [P, 2], got {pairs.shape}")
    bad = np.flatnonzero(((pairs < 0) | (pairs >= n_items)).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"comparison record {i} names unknown item(s) {pairs[i].tolist()}; "
                         f"valid item ids are 0..{n_items - 1}")
    same = np.flatnonzero(pairs[:, 0] == pairs[:, 1])
    if same.size:
        i = int(same[0])
        raise ValueError(f"comparison record {i} compares item {int(pairs[i, 0])} with itself")
    return pairs.astype(np.int32)


def comparisons_from_records(records: Sequence[Mapping[str, Any]], item_ids: Sequence[str],
                             criteria: Sequence[str] = CRITERIA):
    """Comparison records -> arrays for ``fit_bradley_terry``.

    Each record is ``{"a": id, "b": id, "criterion": name, "winner": "a" | "b" | "tie"}``.

    Returns:
      (pairs [P, 2] int32, outcomes [P, K] float32 (1 = a better, 0.5 = tie),
      weights [P, K] float32 (1 where that criterion was judged for that pair)); one row per
      distinct (a, b) pair.

    Raises:
      ValueError: a record naming an item not in ``item_ids``, an unknown criterion or winner.
    """
    index = {str(x): i for i, x in enumerate(item_ids)}
    crit = {c: k for k, c in enumerate(criteria)}
    rows: dict[tuple[int, int], int] = {}
    outs, wts = [], []
    for r, rec in enumerate(records):
        for side in ("a", "b"):
            if str(rec.get(side)) not in index:
                raise ValueError(f"comparison record {r} names unknown item {rec.get(side)!r} "
                                 f"as {side!r}; known items are the {len(index)} given ids")
        if rec.get("criterion") not in crit:
            raise ValueError(f"comparison record {r}: criterion {rec.get('criterion')!r}; "
                             f"valid: {', '.join(criteria)}")
        win = {"a": 1.0, "b": 0.0, "tie": 0.5}.get(rec.get("winner"))
        if win is None:
            raise ValueError(f"comparison record {r}: winner {rec.get('winner')!r}; valid: a, b, tie")
        a, b = index[str(rec["a"])], index[str(rec["b"])]
        if a == b:
            raise ValueError(f"comparison record {r} compares item {rec['a']!r} with itself")
        row = rows.setdefault((a, b), len(rows))
        if row == len(outs):
            outs.append(np.zeros(len(criteria), np.float32))
            wts.append(np.zeros(len(criteria), np.float32))
        outs[row][crit[rec["criterion"]]] = win
        wts[row][crit[rec["criterion"]]] = 1.0
    pairs = np.array(list(rows), np.int32).reshape(-1, 2)
    return pairs, np.array(outs, np.float32).reshape(-1, len(criteria)), \
        np.array(wts, np.float32).reshape(-1, len(criteria))


def bt_objective(scores: jax.Array, pairs: jax.Array, outcomes: jax.Array, weights: jax.Array,
                 l2: float) -> jax.Array:
    """Negative penalised Bradley-Terry log-likelihood of one criterion.

    Args:
      scores: [N]; pairs: [P, 2] int; outcomes: [P] in [0, 1] (1 = first item wins);
      weights: [P] per-comparison weights (0 drops a comparison).
    Returns:
      scalar: -sum_p w_p [y_p log s(d_p) + (1 - y_p) log s(-d_p)] + l2 / 2 ||s||^2,
      d_p = s_i - s_j.
    """
    d = scores[pairs[:, 0]] - scores[pairs[:, 1]]
    ll = outcomes * jax.nn.log_sigmoid(d) + (1.0 - outcomes) * jax.nn.log_sigmoid(-d)
    return -(weights * ll).sum() + 0.5 * l2 * jnp.sum(scores * scores)


def _segment(values, ids, n):
    return jax.ops.segment_sum(values, ids, num_segments=n)


@functools.partial(jax.jit, static_argnames=("n_items", "max_iters", "cg_iters"))
def _fit(pairs, outcomes, weights, l2, tol, *, n_items: int, max_iters: int, cg_iters: int = 50):
    """Damped Newton's method with a Jacobi-preconditioned conjugate-gradient solve per step."""
    i, j = pairs[:, 0], pairs[:, 1]
    n = n_items

    def one(y, w):
        # The data term is shift invariant and the penalised optimum has sum(s) = 0, so adding
        # (sum s)^2 / (2 n) leaves the optimum unchanged and gives the shift direction unit
        # curvature instead of l2 (a better-conditioned Newton system).
        def fun(s):
            return bt_objective(s, pairs, y, w, l2) + 0.5 * jnp.sum(s) ** 2 / n

        def grad_and_curv(s):
            d = s[i] - s[j]
            p = jax.nn.sigmoid(d)
            r = w * (p - y)
            g = _segment(r, i, n) - _segment(r, j, n) + l2 * s + jnp.sum(s) / n
            c = w * p * (1.0 - p)
            return g, c

        def hvp(c, v):
            dv = c * (v[i] - v[j])
            return _segment(dv, i, n) - _segment(dv, j, n) + l2 * v + jnp.sum(v) / n

        def solve(c, g):
            diag = _segment(c, i, n) + _segment(c, j, n) + l2 + 1.0 / n
            x = jnp.zeros_like(g)
            r = g
            z = r / diag
            q = z

            def body(_, carry):
                x, r, z, q = carry
                hq = hvp(c, q)
                rz = jnp.dot(r, z)
                alpha = rz / jnp.maximum(jnp.dot(q, hq), 1e-30)
                x, r_new = x + alpha * q, r - alpha * hq
                z_new = r_new / diag
                beta = jnp.dot(r_new, z_new) / jnp.maximum(rz, 1e-30)
                return x, r_new, z_new, z_new + beta * q

            return jax.lax.fori_loop(0, cg_iters, body, (x, r, z, q))[0]

        def step(carry):
            s, it, _ = carry
            g, c = grad_and_curv(s)
            delta = solve(c, g)
            f0 = fun(s)

            def shrink(t):
                return (fun(s - t * delta) > f0) & (t > 1e-3)

            t = jax.lax.while_loop(shrink, lambda t: 0.5 * t, 1.0)
            s = s - t * delta
            return s, it + 1, jnp.max(jnp.abs(grad_and_curv(s)[0]))

        def cond(carry):
            _, it, gmax = carry
            return (it < max_iters) & (gmax > tol)

        s0 = jnp.zeros((n,), jnp.float32)
        g0 = jnp.max(jnp.abs(grad_and_curv(s0)[0]))
        s, it, gmax = jax.lax.while_loop(cond, step, (s0, jnp.int32(0), g0))
        return s, gmax, it

    return jax.vmap(one, in_axes=(1, 1), out_axes=(1, 0, 0))(outcomes, weights)


def fit_bradley_terry(pairs: np.ndarray, outcomes: np.ndarray, n_items: int, *,
                      weights: np.ndarray | None = None, l2: float = 0.1, tol: float = 1e-5,
                      max_iters: int = 100) -> tuple[jax.Array, dict]:
    """Bradley-Terry scores per criterion: maximum of the penalised log-likelihood by damped
    Newton steps (conjugate-gradient solves with Hessian-vector products, O(P) memory).

    Args:
      pairs: [P, 2] int item ids (validated against ``n_items``).
      outcomes: [P, K] (or [P]) in [0, 1]: 1 = first item better, 0.5 = tie.
      n_items: N.
      weights: [P, K] comparison weights (default 1); 0 marks "not judged".
      l2: ridge strength (> 0).
      tol: stop when max |gradient| < tol.

    Returns:
      (scores [N, K] float32 with sum 0 per column, info {"grad_max": [K], "iters": [K]}).
    """
    pairs = validate_pairs(pairs, n_items)
    outcomes = np.asarray(outcomes, np.float32)
    squeeze = outcomes.ndim == 1
    if squeeze:
        outcomes = outcomes[:, None]
    if outcomes.shape[0] != pairs.shape[0]:
        raise ValueError(f"outcomes has {outcomes.shape[0]} rows for {pairs.shape[0]} pairs")
    if np.isnan(outcomes).any() or (outcomes < 0).any() or (outcomes > 1).any():
        raise ValueError("outcomes must lie in [0, 1] (1 = first item wins, 0.5 = tie)")
    if not l2 > 0:
        raise ValueError(f"l2={l2}: must be > 0 (the unpenalised MLE is infinite when an item "
                         "wins all its comparisons)")
    weights = np.ones_like(outcomes) if weights is None else np.asarray(weights, np.float32)
    if weights.ndim == 1:
        weights = weights[:, None]
    if weights.shape != outcomes.shape:
        raise ValueError(f"weights shape {weights.shape} != outcomes shape {outcomes.shape}")
    s, grad_max, iters = _fit(jnp.asarray(pairs), jnp.asarray(outcomes), jnp.asarray(weights),
                              jnp.float32(l2), jnp.float32(tol), n_items=int(n_items),
                              max_iters=int(max_iters))
    info = {"grad_max": np.asarray(grad_max), "iters": np.asarray(iters)}
    return (s[:, 0] if squeeze else s), info


def average_ranks(x: np.ndarray) -> np.ndarray:
    """0-based ranks along axis 0, ties given their average rank: [N, ...] -> float64."""
    x = np.asarray(x)
    if x.ndim == 1:
        order = np.argsort(x, kind="stable")
        sorted_x = x[order]
        ranks = np.empty(len(x), np.float64)
        start = 0
        boundaries = np.flatnonzero(np.diff(sorted_x) != 0) + 1
        for end in list(boundaries) + [len(x)]:
            ranks[order[start:end]] = 0.5 * (start + end - 1)
            start = end
        return ranks
    return np.stack([average_ranks(x[:, k]) for k in range(x.shape[1])], axis=1)


def uniform_scores(scores: np.ndarray) -> np.ndarray:
    """The paper's "uniform" mapping: rank / (N - 1) * 100, per column (ties share a rank).

    [N, K] (or [N]) -> same shape float32 in [0, 100]."""
    scores = np.asarray(scores)
    n = scores.shape[0]
    if n < 2:
        return np.full(scores.shape, 50.0, np.float32)
    return (average_ranks(scores) / (n - 1) * 100.0).astype(np.float32)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation per column: [N, K] x [N, K] -> [K] (or scalars for [N]).

    A constant column gives nan (its rank correlation is undefined)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"spearman: shapes {a.shape} and {b.shape} differ")
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    den = np.sqrt((ra * ra).sum(0) * (rb * rb).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(0) / den


def pair_agreement(scores: np.ndarray, pairs: np.ndarray, outcomes: np.ndarray) -> np.ndarray:
    """Fraction of decided (non-tie) comparisons whose winner has the higher score, per column.

    scores [N, K], pairs [P, 2], outcomes [P, K] -> [K]."""
    scores, outcomes = np.asarray(scores), np.asarray(outcomes)
    if scores.ndim == 1:
        scores, outcomes = scores[:, None], outcomes[:, None]
    d = scores[pairs[:, 0]] - scores[pairs[:, 1]]
    decided = outcomes != 0.5
    right = ((d > 0) & (outcomes == 1)) | ((d < 0) & (outcomes == 0))
    return (right & decided).sum(0) / np.maximum(decided.sum(0), 1)


def simulate_outcomes(true_scores: np.ndarray, pairs: np.ndarray, *, key: jax.Array) -> np.ndarray:
    """Bradley-Terry comparisons of items with known scores: [N] or [N, K] -> [P] or [P, K]
    of 0/1, first item wins with probability sigmoid(s_i - s_j)."""
    s = jnp.asarray(true_scores, jnp.float32)
    d = s[pairs[:, 0]] - s[pairs[:, 1]]
    return np.array(jax.random.bernoulli(key, jax.nn.sigmoid(d)).astype(jnp.float32))


def recovery_study(n_items: int, comparisons: Sequence[int], *, spread: float, repeats: int,
                   key: jax.Array, l2: float = 0.1) -> dict[int, dict[str, float]]:
    """How well Bradley-Terry recovers known scores from c random comparisons per item.

    True scores ~ Normal(0, spread^2); for each c, ``repeats`` independent draws of pairs and
    outcomes. Returns {c: {"spearman": mean, "spearman_min": min, "pair_agreement": mean}}.
    """
    out = {}
    # Pad every c's comparisons to the largest count with weight-0 rows: one compiled fit.
    p_max = n_items * math.ceil(max(comparisons) / 2)
    for c in comparisons:
        rhos, agree = [], []
        for key_r in jax.random.split(jax.random.fold_in(key, c), repeats):
            k_true, k_pairs, k_out = jax.random.split(key_r, 3)
            true = np.asarray(spread * jax.random.normal(k_true, (n_items,)))
            pairs = sample_pairs(n_items, c, key=k_pairs)
            y = simulate_outcomes(true, pairs, key=k_out)
            pad = p_max - len(pairs)
            w = np.concatenate([np.ones(len(pairs)), np.zeros(pad)]).astype(np.float32)
            pairs = np.concatenate([pairs, np.tile(np.array([[0, 1]], np.int32), (pad, 1))])
            y = np.concatenate([y, np.zeros(pad, np.float32)])
            fit, _ = fit_bradley_terry(pairs, y, n_items, weights=w, l2=l2)
            rhos.append(float(spearman(np.asarray(fit), true)))
            truth_pairs = sample_pairs(n_items, 2, key=jax.random.fold_in(k_pairs, 1))
            truth_y = (true[truth_pairs[:, 0]] > true[truth_pairs[:, 1]]).astype(np.float32)
            agree.append(float(pair_agreement(np.asarray(fit), truth_pairs, truth_y)[0]))
        out[int(c)] = {"spearman": float(np.mean(rhos)), "spearman_min": float(np.min(rhos)),
                       "pair_agreement": float(np.mean(agree))}
    return out
