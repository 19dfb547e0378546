"""Bounded producer-consumer embedding pool keyed by sample id (backpressure when full).

The encoder (producer) ``put``s each sample's embeddings; the backbone (consumer) ``take``s
the samples its next micro-batches need, in any order. ``put`` blocks while the pool holds
``capacity`` entries, so a fast producer cannot run away from a slow consumer; ``take`` blocks
until the keys arrive. A key is never stored twice (a duplicate ``put`` raises) and is removed
by the ``take`` that returns it, so no sample is lost or delivered twice.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Hashable, Iterable


class PoolClosed(RuntimeError):
    """The pool was closed while a caller waited (e.g. the other side failed)."""


class EmbeddingPool:
    """A bounded producer-consumer pool of encoder embeddings keyed by sample: ``put`` blocks while ``capacity``
    items are held (backpressure), ``take`` blocks until a key arrives; ``close`` wakes every waiter."""
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"pool capacity={capacity!r}; must be >= 1")
        self.capacity = int(capacity)
        self._items: dict[Hashable, Any] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._ever: set[Hashable] = set()
        self.max_occupancy = 0
        self.put_wait_s = 0.0  # producer time blocked by backpressure
        self.take_wait_s = 0.0  # consumer time starved
        self.puts = 0
        self.takes = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def close(self) -> None:
        """Close the pool: blocked and later ``put`` / ``take`` calls raise ``PoolClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def put(self, key: Hashable, value: Any, *, timeout: float | None = None) -> None:
        """Stores ``value`` under ``key``, waiting while the pool is full."""
        start = time.perf_counter()
        with self._cond:
            if key in self._ever:
                raise KeyError(f"sample {key!r} was already put into the pool")
            ok = self._cond.wait_for(
                lambda: self._closed or len(self._items) < self.capacity, timeout)
            if self._closed:
                raise PoolClosed("pool closed while putting")
            if not ok:
                raise TimeoutError(f"pool full ({self.capacity}) for {timeout}s putting {key!r}")
            self._ever.add(key)
            self._items[key] = value
            self.puts += 1
            self.max_occupancy = max(self.max_occupancy, len(self._items))
            self.put_wait_s += time.perf_counter() - start
            self._cond.notify_all()

    def take_many(self, keys: Iterable[Hashable], *, timeout: float | None = None) -> dict:
        """Removes and returns ``{key: value}`` for every key, taking each as soon as it arrives
        (so a pool smaller than ``keys`` still drains and never deadlocks the producer)."""
        wanted = list(keys)
        if len(set(wanted)) != len(wanted):
            raise ValueError("take_many got a key twice")
        out: dict = {}
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            while True:
                got = [k for k in wanted if k not in out and k in self._items]
                for k in got:
                    out[k] = self._items.pop(k)
                    self.takes += 1
                if got:
                    self._cond.notify_all()
                if len(out) == len(wanted):
                    break
                if self._closed:
                    raise PoolClosed(f"pool closed with {len(wanted) - len(out)} sample(s) "
                                     "still awaited")
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(wanted) - len(out)} sample(s) did not arrive in "
                                       f"{timeout}s")
                self._cond.wait(left)
            self.take_wait_s += time.perf_counter() - start
        return out

    def take(self, key: Hashable, *, timeout: float | None = None) -> Any:
        """Remove and return the item of ``key``, waiting up to ``timeout`` seconds for it."""
        return self.take_many([key], timeout=timeout)[key]

    def stats(self) -> dict:
        """Occupancy and wait counters: capacity, max occupancy, puts, takes, seconds blocked."""
        return {"capacity": self.capacity, "max_occupancy": self.max_occupancy,
                "puts": self.puts, "takes": self.takes, "put_wait_s": self.put_wait_s,
                "take_wait_s": self.take_wait_s}
