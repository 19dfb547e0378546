"""Rank correlation between calibration perplexity and retention, with its uncertainty.

The calibration study asks whether a source's perplexity under the dense model predicts how
much of each capability its pruned model keeps (Spearman's rho across sources). With a
handful of sources one rho says little, so :func:`bootstrap_spearman` resamples the sources
(with replacement) and reports a percentile interval, and :func:`sign_stability` asks whether
a correlation keeps its sign across model sizes and sparsities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=np.float64)
    for value in np.unique(v):
        same = v == value
        r[same] = r[same].mean()
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of x [N] and y [N] (average ranks for ties); nan when either
    side is constant or holds a nan (e.g. the retention of a capability the dense model
    never solves)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if np.isnan(x).any() or np.isnan(y).any():
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def bootstrap_spearman(x: Sequence[float], y: Sequence[float], *, n_boot: int = 2000,
                       level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Spearman rho of x [N] vs y [N] with a percentile bootstrap interval over the N items.

    Each replicate draws N indices with replacement; replicates where either side is constant
    (rho undefined) are dropped and counted. Returns {"rho", "lo", "hi", "n", "n_boot",
    "n_undefined", "p_positive"}: ``p_positive`` is the share of defined replicates with
    rho > 0 (a bootstrap view of how sure the sign is)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D of one length; got {x.shape} and {y.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: must be in (0, 1)")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    reps = np.array([spearman(x[i], y[i]) for i in idx])
    defined = reps[~np.isnan(reps)]
    tail = (1 - level) / 2
    lo, hi = (np.quantile(defined, [tail, 1 - tail]) if defined.size else (np.nan, np.nan))
    return {"rho": spearman(x, y), "lo": float(lo), "hi": float(hi), "n": int(len(x)),
            "n_boot": int(n_boot), "n_undefined": int(n_boot - defined.size),
            "p_positive": float(np.mean(defined > 0)) if defined.size else float("nan")}


def sign_stability(cells: Mapping[str, Mapping[str, float]]) -> dict[str, object]:
    """Whether a correlation keeps its sign across cells (e.g. "size@sparsity").

    cells: {cell name: {"rho", "lo", "hi"}} for one capability. Returns {"signs": {cell: +1 /
    -1 / 0 (rho nan or 0)}, "stable": every defined cell has the same sign, "resolved":
    cells whose interval excludes 0, "resolved_stable": the resolved cells agree in sign
    (True when none is resolved, which ``n_resolved`` = 0 tells apart)}."""
    signs = {}
    for name, c in cells.items():
        rho = c["rho"]
        signs[name] = 0 if rho != rho or rho == 0 else int(np.sign(rho))
    defined = [s for s in signs.values() if s]
    resolved = {name: (1 if c["lo"] > 0 else -1) for name, c in cells.items()
                if c["lo"] == c["lo"] and (c["lo"] > 0 or c["hi"] < 0)}
    return {"signs": signs, "stable": len(set(defined)) <= 1 and bool(defined),
            "n_resolved": len(resolved), "resolved": resolved,
            "resolved_stable": len(set(resolved.values())) <= 1}
