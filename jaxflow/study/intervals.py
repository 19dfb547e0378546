"""Seed intervals of a study: paired treatment-minus-control differences over shared seeds,
one-sample intervals over seeds, means over records, and their text in tables.

The interval arithmetic is :mod:`jaxflow.stats` (``paired_interval``, ``normalized_auc``,
re-exported here); this module pairs records by seed and formats the results.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxflow.stats import PairedInterval, normalized_auc, paired_interval

__all__ = ["PairedInterval", "paired_interval", "normalized_auc", "paired_by_seed", "seed_interval",
           "mean_of", "sample_sd", "format_pm", "format_bounds"]


def paired_by_seed(treatment: Mapping[Any, float], control: Mapping[Any, float], *,
                   level: float = 0.95) -> PairedInterval | None:
    """:func:`jaxflow.stats.paired_interval` of ``treatment[s] - control[s]`` over the seeds
    ``s`` both hold, in ascending seed order (``{seed: value}`` maps); None when they share no
    seed."""
    seeds = sorted(set(treatment) & set(control))
    if not seeds:
        return None
    return paired_interval([treatment[s] for s in seeds], [control[s] for s in seeds], level=level)


def seed_interval(values: Sequence[float], *, level: float = 0.95) -> dict:
    """Mean of ``values`` ([n], one per seed) with a two-sided t-interval.

    Returns ``{"n", "mean", "sd", "half_width", "low", "high", "level"}``: ``half_width`` =
    t_{(1+level)/2, n-1} * sd / sqrt(n) (sd with ddof 1), ``[low, high]`` = mean +- half_width;
    with one value the interval is undefined and ``sd`` / ``half_width`` / ``low`` / ``high``
    are None."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("seed_interval needs at least one value; got none")
    pi = paired_interval(vals, [0.0] * len(vals), level=level)  # the interval of mean(v - 0)
    if pi.n == 1:
        return {"n": 1, "mean": pi.mean, "sd": None, "half_width": None, "low": None,
                "high": None, "level": level}
    return {"n": pi.n, "mean": pi.mean, "sd": pi.sd, "half_width": pi.half_width,
            "low": pi.mean - pi.half_width, "high": pi.mean + pi.half_width, "level": level}


def mean_of(records: Iterable[Mapping[str, Any]], key: str) -> float | None:
    """Mean of ``record[key]`` over the records that hold a value (not None) for it; None when
    none does."""
    vals = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation (ddof 1) of ``values`` ([n]); 0.0 for one value."""
    return float(np.std(np.asarray(values, np.float64), ddof=1)) if len(values) > 1 else 0.0


def format_pm(mean: float, half_width: float, digits: int = 3) -> str:
    """``"+0.012 +- 0.020"``: a signed mean and its interval's half width."""
    return f"{mean:+.{digits}f} +- {half_width:.{digits}f}"


def format_bounds(bounds: Sequence[float], digits: int = 3) -> str:
    """``"[-0.010, +0.031]"``: an interval's signed bounds (e.g. a bootstrap interval)."""
    low, high = bounds
    return f"[{low:+.{digits}f}, {high:+.{digits}f}]"
