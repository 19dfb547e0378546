"""Timing in studies: each step's wall seconds and their median past the compile, and fair
side-by-side timing of modes (:func:`jaxflow.timing.paired_rounds` / ``choose_mode``,
re-exported).

Wall seconds are timing figures: they differ from run to run and never enter a deterministic
comparison (a resumed cell times only the steps it ran).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxflow.timing import choose_mode, paired_rounds

__all__ = ["timed", "median_after_warmup", "paired_rounds", "choose_mode"]


def timed(step: Callable[..., Any], seconds: list[float], *,
          clock: Callable[[], float] = time.perf_counter) -> Callable[..., Any]:
    """``step`` that appends the wall seconds of each call to ``seconds`` (the step must block
    on its outputs, as a step returning host metrics does)."""

    def wrapped(*args, **kwargs):
        t0 = clock()
        out = step(*args, **kwargs)
        seconds.append(clock() - t0)
        return out

    return wrapped


def median_after_warmup(seconds: Sequence[float], warmup: int = 1) -> float | None:
    """Median of ``seconds`` without the first ``warmup`` calls (the compile); None when no call
    is left."""
    rest = list(seconds)[warmup:]
    return float(np.median(rest)) if rest else None
