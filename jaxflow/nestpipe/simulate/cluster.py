"""Per-worker resource clocks of N workers: streams serving their queues in issue order,
collectives that wait for the last worker and end with the slowest part.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


class Cluster:
    """Per-worker resource clocks of N workers, vectorised over workers.

    ``op`` schedules one stage on every worker: start = max(dependencies done, resource free);
    a collective starts when the last worker is ready and ends with its slowest part.
    """

    RESOURCES = ("h2d", "keys", "net", "accel")

    def __init__(self, n: int, *, cv: float, host_threads: int, rng: np.random.Generator):
        self.n, self.cv, self.rng = n, cv, rng
        self.host = np.zeros((n, host_threads))
        self.clock = {r: np.zeros(n) for r in self.RESOURCES}
        self.busy: dict[str, float] = {}
        self._sigma = math.sqrt(math.log1p(cv * cv))

    def _durations(self, mean: float) -> np.ndarray:
        # Always draw, so zeroing one stage's cost leaves every other draw unchanged.
        z = self.rng.standard_normal(self.n)
        if self.cv == 0:
            return np.full(self.n, mean)
        return mean * np.exp(self._sigma * z - 0.5 * self._sigma ** 2)

    def op(self, stage: str, resource: str, mean: float, deps: Sequence[np.ndarray] = (),
           collective: bool = False) -> np.ndarray:
        """Schedule one stage on ``resource`` for every worker after ``deps``; returns the end times float[n] (a
        collective ends for all at the slowest worker)."""
        d = self._durations(mean)
        ready = np.maximum.reduce(list(deps)) if deps else np.zeros(self.n)
        if resource == "host":
            rows = np.arange(self.n)
            k = np.argmin(self.host, axis=1)
            start = np.maximum(ready, self.host[rows, k])
            end = start + d
            self.host[rows, k] = end
        else:
            start = np.maximum(ready, self.clock[resource])
            if collective:
                end = np.full(self.n, start.max() + d.max())
            else:
                end = start + d
            self.clock[resource] = end
        self.busy[stage] = self.busy.get(stage, 0.0) + float(d.mean())
        return end
