"""The version board: published weights per (version, agent), shared by the pipeline's threads.

Trainers put agent ``name``'s weights of version v as they step; a version is *complete* when
every agent has published it. Rollouts ask for the newest complete version >= a minimum
(``v - eta`` under bounded staleness, ``v`` when strict) and block until one exists. Versions
older than the newest complete one are dropped, except, with a ``floor`` (multi-process bounded
runs, where process 0 picks the version every process's rollout uses), those >= the floor.
``halt`` wakes every waiter and makes it raise, so one failing thread stops the others.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence


class VersionBoard:
    """Published weights per (version, agent); thread-safe (see module doc)."""

    def __init__(self, names: Sequence[str], floor: int | None = None):
        self.names, self.by_version, self.cond = tuple(names), {}, threading.Condition()
        self.stop = False
        self.floor = floor  # None: keep only the newest complete version and newer

    def raise_floor(self, version: int) -> None:
        """Versions >= ``version`` stay on the board (no-op without a floor); the floor only
        rises."""
        with self.cond:
            if self.floor is not None:
                self.floor = max(self.floor, version)
                self._prune()

    def _prune(self) -> None:
        done = self._complete()
        if done:
            keep = max(done) if self.floor is None else min(max(done), self.floor)
            for v in [v for v in self.by_version if v < keep]:
                del self.by_version[v]

    def _complete(self) -> list[int]:
        return [v for v, d in self.by_version.items() if len(d) == len(self.names)]

    def put(self, version: int, name: str, params: Any) -> None:
        """Agent ``name`` publishes ``params`` as ``version``."""
        with self.cond:
            self.by_version.setdefault(version, {})[name] = params
            self._prune()
            self.cond.notify_all()

    def get_at_least(self, version: int, timeout: float) -> tuple[int, dict[str, Any]]:
        """``(w, {agent: params})`` of the newest complete version w >= ``version``; waits up
        to ``timeout`` seconds, then (or after :meth:`halt`) raises RuntimeError."""
        with self.cond:
            ok = self.cond.wait_for(lambda: self.stop or any(v >= version
                                                             for v in self._complete()),
                                    timeout)
            if self.stop or not ok:
                raise RuntimeError(f"weights of version >= {version} not published in "
                                   f"{timeout} s (or the run stopped)")
            newest = max(self._complete())
            return newest, dict(self.by_version[newest])

    def get_agent(self, version: int, name: str, timeout: float) -> Any:
        """Agent ``name``'s weights of exactly ``version`` (strict rollouts: each agent's rows
        of batch v need only that agent's version v, not every agent's); waits like
        :meth:`get_at_least`."""
        with self.cond:
            ok = self.cond.wait_for(lambda: self.stop or name in self.by_version.get(version, {}),
                                    timeout)
            if self.stop or not ok:
                raise RuntimeError(f"weights of agent {name!r} version {version} not published "
                                   f"in {timeout} s (or the run stopped)")
            return self.by_version[version][name]

    def halt(self) -> None:
        """Stops the run: every waiter (now or later) raises, ``stop`` turns True."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
