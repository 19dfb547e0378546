"""Small-sample statistics for seed studies: paired differences and areas under curves.

A study that runs a treatment and a control with the same seeds (same warm start, prompts and
sampling keys) compares them pair by pair: the interval of the mean paired difference
``treatment - control`` is much narrower than the two groups' own spreads suggest, because the
seed-to-seed variation they share cancels.
"""

from __future__ import annotations

import math
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
      :class:`PairedInterval`: t-interval half width ``t_{level, n-1} * sd / sqrt(n)`` (sd with
      ddof 1) and the bootstrap percentile interval of the mean.
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
    from scipy.stats import t as student_t  # scipy is a dependency of jax itself

    sd = float(d.std(ddof=1))
    half = float(student_t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n))
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return PairedInterval(mean, half, sd, n, float(low), float(high))


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
