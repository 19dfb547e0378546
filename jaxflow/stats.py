"""Small-sample statistics for seed studies: paired differences and areas under curves.

A study that runs a treatment and a control with the same seeds (same warm start, prompts and
sampling keys) compares them pair by pair: the interval of the mean paired difference
``treatment - control`` is much narrower than the two groups' own spreads suggest, because the
seed-to-seed variation they share cancels.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class PairedInterval(NamedTuple):
    """Mean of the paired differences with a two-sided interval ``mean +- half_width``
    (t-interval) and a percentile-bootstrap interval ``[boot_low, boot_high]``.

    With one pair the interval is undefined: ``half_width`` and the bootstrap bounds are NaN.
    """

    mean: float
    half_width: float
    sd: float
    n: int
    boot_low: float
    boot_high: float

    def format(self, digits: int = 3) -> str:
        """``"+0.012 +- 0.020 (n=8)"``."""
        return f"{self.mean:+.{digits}f} +- {self.half_width:.{digits}f} (n={self.n})"


def paired_interval(treatment: Sequence[float], control: Sequence[float], *,
                    level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> PairedInterval:
    """Interval of mean(treatment - control) over paired seeds.

    Args:
      treatment, control: [n] values, element i of both from seed i.
      level: two-sided coverage of both intervals, in (0, 1).
      n_boot: bootstrap resamples of the n differences (with replacement); seed: their RNG.

    Returns:
      :class:`PairedInterval`: the t-interval of ``scipy.stats.ttest_rel(treatment, control)``
      (half width ``t_{level, n-1} * sd / sqrt(n)``, sd with ddof 1; 0 when every difference
      is the same) and the percentile interval of ``scipy.stats.bootstrap`` over the mean of
      the differences, ``n_boot`` resamples drawn by ``np.random.default_rng(seed)`` (the same
      resamples, and figures equal to 1e-14, as the hand-written version before it).
    """
    a = np.asarray(treatment, np.float64)
    b = np.asarray(control, np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired_interval needs two equal-length non-empty 1-D sequences; got "
                         f"shapes {a.shape} and {b.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}; valid: 0 < level < 1")
    if n_boot < 1:
        raise ValueError(f"n_boot={n_boot}; valid: >= 1")
    d = a - b
    n = d.size
    mean = float(d.mean())
    if n == 1:
        return PairedInterval(mean, math.nan, math.nan, 1, math.nan, math.nan)
    from scipy import stats  # a dependency (jax needs it too)

    with warnings.catch_warnings():  # equal differences: scipy warns of "precision loss";
        warnings.simplefilter("ignore", RuntimeWarning)  # n_boot=1: of the standard error
        t_ci = stats.ttest_rel(a, b).confidence_interval(confidence_level=level)
        boot = stats.bootstrap((d,), np.mean, n_resamples=n_boot, confidence_level=level,
                               method="percentile", vectorized=True,
                               **bootstrap_rng_kwargs(np.random.default_rng(seed)))
    ci = boot.confidence_interval
    return PairedInterval(mean, float((t_ci.high - t_ci.low) / 2), float(d.std(ddof=1)), n,
                          float(ci.low), float(ci.high))


def bootstrap_rng_kwargs(rng: np.random.Generator) -> dict:
    """The keyword that hands ``rng`` to ``scipy.stats.bootstrap``: ``{"rng": rng}`` on
    scipy >= 1.15, ``{"random_state": rng}`` before (the same draws either way)."""
    from scipy import stats

    return {"rng" if "rng" in inspect.signature(stats.bootstrap).parameters
            else "random_state": rng}


def normalized_auc(curve: Sequence[tuple[float, float]]) -> float:
    """Area under a curve of (x, y) points by the trapezoid rule, divided by its x extent:
    the curve's average height (for pass@1 vs rollout, the mean pass@1 over training).

    A one-point curve returns that point's y."""
    pts = sorted((float(x), float(y)) for x, y in curve)
    if not pts:
        raise ValueError("normalized_auc needs at least one (x, y) point")
    if len(pts) == 1 or pts[-1][0] == pts[0][0]:
        return pts[0][1]
    x, y = np.array(pts).T
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))
