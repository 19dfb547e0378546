"""Rank correlation between calibration perplexity and retention, with its uncertainty.

The calibration study asks whether a source's perplexity under the dense model predicts how
much of each capability its pruned model keeps (Spearman's rho across sources). With a
handful of sources one rho says little, so :func:`bootstrap_spearman` resamples the sources
(with replacement) and reports a percentile interval, and :func:`sign_stability` asks whether
a correlation keeps its sign across model sizes and sparsities.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats

from jaxflow.stats import bootstrap_rng_kwargs


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of x [N] and y [N] (``scipy.stats.spearmanr``: average ranks
    for ties); nan when either side is constant or holds a nan (e.g. the retention of a
    capability the dense model never solves)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    with warnings.catch_warnings():  # a constant side: scipy warns, the answer is nan
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return float(stats.spearmanr(x, y).statistic)


def bootstrap_spearman(x: Sequence[float], y: Sequence[float], *, n_boot: int = 2000,
                       level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Spearman rho of x [N] vs y [N] with a percentile bootstrap interval over the N items.

    ``scipy.stats.bootstrap`` (paired: the N (x, y) items are resampled together, with
    replacement, by ``np.random.default_rng(seed)``) gives the ``n_boot`` replicate rhos;
    replicates where either side is constant (rho undefined) are dropped and counted, and the
    interval is the percentile interval of the defined ones (scipy's own interval would be nan
    as soon as one replicate is). Returns {"rho", "lo", "hi", "n", "n_boot", "n_undefined",
    "p_positive"}: ``p_positive`` is the share of defined replicates with rho > 0 (a bootstrap
    view of how sure the sign is)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D of one length; got {x.shape} and {y.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: must be in (0, 1)")
    if n_boot < 1:
        raise ValueError(f"n_boot={n_boot!r}: must be >= 1")
    if len(x) < 2:  # every replicate is one repeated item: rho undefined (scipy refuses)
        reps = np.full(n_boot, np.nan)
    else:
        with warnings.catch_warnings():  # undefined replicates make scipy's own interval nan
            warnings.simplefilter("ignore", stats.DegenerateDataWarning)
            res = stats.bootstrap((x, y), spearman, paired=True, vectorized=False,
                                  n_resamples=n_boot, confidence_level=level,
                                  method="percentile",
                                  **bootstrap_rng_kwargs(np.random.default_rng(seed)))
        reps = np.asarray(res.bootstrap_distribution, np.float64)
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
