"""Selecting training data from decorated ratings and tags under a token budget.

DecorateLM (Zhao et al., EMNLP 2024) samples texts without replacement with probability
proportional to ``sum_k c_k exp(z_k)``, z_k the text's z-scored rating on criterion k, with
c = 0.2 for educational value, expertise, fact & trivia and reasoning level and 0.05 for the
other four; and balances topics hierarchically with

    p  proportional to  n_a^a * (n_b^b / sum_b' n_b'^b) * (n_c^c / sum_c' n_c'^c) / n_c,

n_a, n_b, n_c the number of texts with the text's level-1, level-2, level-3 tag, the sums over
the siblings under the same parent, all exponents 0.5: level-1 category a receives total mass
proportional to n_a^a (flattened from n_a), level-2 b within a a share proportional to n_b^b,
and so on. When both are used the weights multiply.

Sampling without replacement proportional to weights is done with the Gumbel-top-k trick
(Kool et al., 2019): sort by log w + Gumbel noise; texts are taken in that order until the
next one would exceed the token budget.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxflow.decorate.rating import CRITERIA

#: The paper's sampling coefficients c_k, in the order of CRITERIA.
DEFAULT_COEFS = (0.2, 0.2, 0.2, 0.2, 0.05, 0.05, 0.05, 0.05)


def rating_weights(ratings: np.ndarray, coefs=DEFAULT_COEFS) -> np.ndarray:
    """sum_k c_k exp(z_k): ratings [N, K] -> weights [N] float64 (z per column, population std;
    a constant column has z = 0)."""
    r = np.asarray(ratings, np.float64)
    coefs = np.asarray(coefs, np.float64)
    if r.ndim != 2 or r.shape[1] != coefs.shape[0]:
        raise ValueError(f"ratings shape {r.shape} needs {coefs.shape[0]} columns (one per coefficient)")
    if (coefs < 0).any():
        raise ValueError(f"coefficients must be >= 0, got {coefs.tolist()}")
    sd = r.std(0)
    z = np.where(sd > 0, (r - r.mean(0)) / np.where(sd > 0, sd, 1.0), 0.0)
    return (coefs * np.exp(z)).sum(1)


def tag_balance_weights(tags: np.ndarray, exponents=(0.5, 0.5, 0.5)) -> np.ndarray:
    """The hierarchical balance weight of every text: tags [N, 3] -> [N] float64.

    Per level-1 tag the weights sum to n_a^a; among the level-2 children of a, to
    n_a^a * n_b^b / sum n_b'^b; and so on (see module docstring).
    """
    tags = np.asarray(tags, np.int64)
    if tags.ndim != 2 or tags.shape[1] != 3 or tags.shape[0] == 0:
        raise ValueError(f"tags must be a non-empty [N, 3] array, got shape {tags.shape}")
    ea, eb, ec = (float(e) for e in exponents)
    _, ia, na = np.unique(tags[:, 0], return_inverse=True, return_counts=True)
    ab = tags[:, 0] * (tags[:, 1].max() + 1) + tags[:, 1]
    ub, ib, nb = np.unique(ab, return_inverse=True, return_counts=True)
    abc = ab * (tags[:, 2].max() + 1) + tags[:, 2]
    uc, ic, nc = np.unique(abc, return_inverse=True, return_counts=True)
    # parents of each distinct (a, b) and (a, b, c) group
    parent_b = ia[np.unique(ab, return_index=True)[1]]
    parent_c = ib[np.unique(abc, return_index=True)[1]]
    sum_b = np.bincount(parent_b, weights=nb.astype(np.float64) ** eb)
    sum_c = np.bincount(parent_c, weights=nc.astype(np.float64) ** ec)
    w = (na[ia].astype(np.float64) ** ea * (nb[ib] ** eb / sum_b[parent_b[ib]])
         * (nc[ic] ** ec / sum_c[parent_c[ic]]) / nc[ic])
    return w


def gumbel_order(weights: np.ndarray, *, key: jax.Array) -> np.ndarray:
    """A sample-without-replacement order proportional to ``weights`` (zero weights never come
    before a positive one; they are excluded): [N] -> [M] indices, M = #positive weights."""
    w = np.asarray(weights, np.float64)
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError("sampling weights must be finite and >= 0")
    g = np.asarray(jax.random.gumbel(key, w.shape, dtype=np.float32), np.float64)
    pos = np.flatnonzero(w > 0)
    keys = np.log(w[pos]) + g[pos]
    return pos[np.argsort(-keys, kind="stable")]


def select_budget(weights: np.ndarray, token_counts: np.ndarray, budget: int, *,
                  key: jax.Array) -> np.ndarray:
    """Indices sampled without replacement proportional to ``weights`` until the next text
    would exceed ``budget`` tokens (the selection holds <= budget tokens).

    Raises:
      ValueError: when ``budget`` exceeds the tokens of all texts with positive weight, or is
        not positive.
    """
    counts = np.asarray(token_counts, np.int64)
    w = np.asarray(weights)
    if counts.shape != w.shape:
        raise ValueError(f"token_counts shape {counts.shape} != weights shape {w.shape}")
    if budget <= 0:
        raise ValueError(f"token budget {budget}: must be > 0")
    available = int(counts[w > 0].sum())
    if budget > available:
        raise ValueError(f"token budget {budget} exceeds the {available} tokens of the corpus's "
                         f"{int((w > 0).sum())} selectable texts; lower the budget")
    order = gumbel_order(w, key=key)
    total = np.cumsum(counts[order])
    return order[: int(np.searchsorted(total, budget, side="right"))]


def combined_weights(ratings: np.ndarray | None, tags: np.ndarray | None, n: int, *,
                     coefs=DEFAULT_COEFS, exponents=(0.5, 0.5, 0.5)) -> np.ndarray:
    """Rating weights x tag-balance weights (either may be None: factor 1); [N]."""
    w = np.ones(n)
    if ratings is not None:
        w = w * rating_weights(ratings, coefs)
    if tags is not None:
        w = w * tag_balance_weights(tags, exponents)
    return w


__all__ = ["CRITERIA", "DEFAULT_COEFS", "rating_weights", "tag_balance_weights", "gumbel_order",
           "select_budget", "combined_weights"]
