"""One agent's rollout replicas: continuous batching under a request-level policy
(round_robin / longest_first / work_stealing, the rules of :mod:`jaxflow.marl.balance`).
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import Sequence

import numpy as np

from jaxflow.marl import balance
from jaxflow.marl.simulate.workload import AgentCosts

POLICIES = balance.POLICIES  # round_robin, longest_first, work_stealing


class RolloutPool:
    """One agent's rollout replicas: continuous batching with a request-level policy.

    Each replica keeps a clock ``steps`` of decode steps done; a sequence started at step s with
    length L finishes when the clock reaches s + L (all active sequences advance one token per
    step; steps are treated as continuous). Requests are ``(key, length)``.
    """

    def __init__(self, n: int, slots: int, costs: AgentCosts, policy: str):
        if n < 1:
            raise ValueError(f"replicas={n}: need >= 1")
        if slots < 1:
            raise ValueError(f"slots={slots}: need >= 1")
        if policy not in POLICIES:
            raise ValueError(f"request_policy={policy!r}; valid: {', '.join(POLICIES)}")
        self.n, self.slots, self.costs, self.policy = n, slots, costs, policy
        self.steps = np.zeros(n)
        self.last_t = np.zeros(n)
        self.n_active = np.zeros(n, np.int64)
        self.finish_sum = np.zeros(n)  # sum of the active sequences' finish steps
        self.active: list[list] = [[] for _ in range(n)]  # heaps of (finish step, seq, key)
        self.queues = [collections.deque() for _ in range(n)]
        self.queued_work = np.zeros(n)
        self.stamp = [0] * n
        self.events: list = []  # (time, replica, stamp)
        self.busy_s = 0.0
        self._rr = 0
        self._seq = 0

    # -- bookkeeping
    def _step_s(self, r: int) -> float:
        return self.costs.weight_s + self.n_active[r] * self.costs.seq_s

    def _advance(self, r: int, now: float) -> None:
        dt = now - self.last_t[r]
        if dt > 0 and self.n_active[r]:
            self.steps[r] += dt / self._step_s(r)
            self.busy_s += dt
        self.last_t[r] = max(self.last_t[r], now)

    def _advance_all(self, now: float) -> None:
        dt = np.maximum(now - self.last_t, 0.0)
        on = self.n_active > 0
        self.steps[on] += dt[on] / (self.costs.weight_s + self.n_active[on] * self.costs.seq_s)
        self.busy_s += float(dt[on].sum())
        self.last_t = np.maximum(self.last_t, now)

    def _schedule(self, r: int) -> None:
        self.stamp[r] += 1
        if self.active[r]:
            left = max(0.0, self.active[r][0][0] - self.steps[r])
            heapq.heappush(self.events, (self.last_t[r] + left * self._step_s(r), r, self.stamp[r]))

    def _refill(self, r: int, steal: bool) -> bool:
        """Fills free slots from the own queue, then (``steal``) from the most-loaded queue."""
        started = False
        while self.n_active[r] < self.slots:
            if self.queues[r]:
                key, length = self.queues[r].popleft()
                self.queued_work[r] -= length
            elif steal and self.policy == "work_stealing" and self.queued_work.max() > 0:
                v = int(np.argmax(self.queued_work))  # most queued work, ties: lowest id
                key, length = self.queues[v].pop()
                self.queued_work[v] -= length
            else:
                break
            self._seq += 1
            finish = self.steps[r] + length
            heapq.heappush(self.active[r], (finish, self._seq, key))
            self.n_active[r] += 1
            self.finish_sum[r] += finish
            started = True
        return started

    def idle(self) -> bool:
        """Whether no replica has an active or queued request."""
        return not self.n_active.any() and not self.queued_work.any()

    # -- public
    def submit(self, requests: Sequence[tuple], now: float) -> None:
        """Queues ``requests`` (``(key, length)``, length >= 1) at ``now``; starts what fits."""
        if not requests:
            return
        self._advance_all(now)
        lengths = [float(length) for _, length in requests]
        if self.policy == "longest_first":
            if self.idle():
                assign = balance.longest_first(lengths, self.n)
            else:  # greedy LPT from the current loads (remaining active + queued tokens)
                load = self.queued_work + self.finish_sum - self.n_active * self.steps
                assign = [0] * len(requests)
                for i in sorted(range(len(requests)), key=lambda i: (-lengths[i], i)):
                    assign[i] = int(np.argmin(load))
                    load[assign[i]] += lengths[i]
        else:
            assign = [(self._rr + i) % self.n for i in range(len(requests))]
            self._rr = (self._rr + len(requests)) % self.n
        touched = sorted(set(assign))
        for (key, length), r in zip(requests, assign):
            self.queues[r].append((key, int(length)))
            self.queued_work[r] += length
        if self.policy == "longest_first":
            for r in touched:
                self.queues[r] = collections.deque(sorted(self.queues[r], key=lambda q: -q[1]))
        for r in touched:
            if self._refill(r, steal=False):
                self._schedule(r)
        if self.policy == "work_stealing":
            self._steal_pass(np.nonzero(self.n_active < self.slots)[0])

    def _steal_pass(self, replicas) -> None:
        for r in replicas:
            if not self.queued_work.max() > 0:
                return
            if self._refill(int(r), steal=True):
                self._schedule(int(r))

    def next_time(self) -> float:
        """The time of the next pending event (inf when there is none)."""
        while self.events and self.events[0][2] != self.stamp[self.events[0][1]]:
            heapq.heappop(self.events)
        return self.events[0][0] if self.events else math.inf

    def pop_completions(self) -> tuple[float, list]:
        """Advances to the next completion time; returns it and the keys finished then.
        Replicas finishing at the same instant all refill from their own queues before any of
        them steals (so a tie does not decide who steals what)."""
        now = self.next_time()
        done, hit = [], []
        while self.events and self.events[0][0] <= now:
            t, r, stamp = heapq.heappop(self.events)
            if stamp != self.stamp[r]:
                continue
            self._advance(r, now)
            eps = 1e-9 * max(1.0, self.steps[r])
            while self.active[r] and self.active[r][0][0] <= self.steps[r] + eps:
                finish, _, key = heapq.heappop(self.active[r])
                self.n_active[r] -= 1
                self.finish_sum[r] -= finish
                done.append(key)
            hit.append(r)
        for r in hit:
            self._refill(r, steal=False)
        if self.policy == "work_stealing":
            self._steal_pass([r for r in hit if self.n_active[r] < self.slots])
        for r in hit:
            self._schedule(r)
        return now, done

    def run(self, requests: Sequence[tuple], start: float) -> float:
        """Runs ``requests`` from ``start`` until all finish; returns the end time."""
        self.submit(requests, start)
        end = start
        while self.next_time() < math.inf:
            end, _ = self.pop_completions()
        return end
