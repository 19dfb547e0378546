"""Request-level load balancing of rollout requests over workers (costs, not wall time).

Each request has a cost (e.g. its expected decode steps). Policies assign requests to
``n_workers`` workers; :func:`makespan` is the finishing time of the busiest worker when each
worker runs its requests back to back, and ``busy fraction = sum(costs) / (n * makespan)``.

  round_robin     request i -> worker i % n (the baseline: blind to lengths).
  longest_first   LPT: requests by decreasing cost, each to the least-loaded worker
                  (makespan <= 4/3 OPT).
  work_stealing   round-robin queues; an idle worker steals the last queued request of the
                  worker with the most queued work (an event simulation, see below).

Agent level: :func:`allocate_workers` (rollout workers per agent by load), used by
:func:`jaxflow.marl.pipeline.run_pipeline`, whose per-agent worker pools then pull requests
longest-first from a shared queue (dynamic list scheduling). :func:`assign` gives static
per-worker queues for the same policies.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

POLICIES = ("round_robin", "longest_first", "work_stealing")


def round_robin(costs: Sequence[float], n_workers: int) -> list[int]:
    """Worker per item in arrival order, cycling over the workers."""
    _check(costs, n_workers)
    return [i % n_workers for i in range(len(costs))]


def longest_first(costs: Sequence[float], n_workers: int) -> list[int]:
    """Worker per item by longest-processing-time-first greedy (each item to the least-loaded worker)."""
    _check(costs, n_workers)
    heap = [(0.0, w) for w in range(n_workers)]
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, w = heapq.heappop(heap)
        out[i] = w
        heapq.heappush(heap, (load + float(costs[i]), w))
    return out


def makespan(costs: Sequence[float], assignment: Sequence[int], n_workers: int) -> float:
    """Finishing time of the busiest worker."""
    loads = np.zeros(n_workers)
    np.add.at(loads, np.asarray(assignment, int), np.asarray(costs, float))
    return float(loads.max())


def work_stealing_makespan(costs: Sequence[float], n_workers: int) -> float:
    """Makespan when workers start from round-robin queues (FIFO) and an idle worker steals the
    tail of the queue with the most remaining queued work (ties: lowest worker id)."""
    _check(costs, n_workers)
    queues = [[i for i in range(len(costs)) if i % n_workers == w] for w in range(n_workers)]
    events = [(0.0, w) for w in range(n_workers)]  # (time the worker becomes free, worker)
    heapq.heapify(events)
    end = 0.0
    while events:
        now, w = heapq.heappop(events)
        if queues[w]:
            job = queues[w].pop(0)
        else:
            victims = [(sum(costs[j] for j in q), -v) for v, q in enumerate(queues) if q]
            if not victims:
                end = max(end, now)
                continue
            v = -max(victims)[1]
            job = queues[v].pop()
        heapq.heappush(events, (now + float(costs[job]), w))
    return end


def allocate_workers(loads: dict[str, float], n_workers: int) -> dict[str, int]:
    """Agent-level balancing: ``n_workers`` rollout workers split over agents in proportion to
    their (measured or estimated) load, at least one each (largest remainder; ties by name
    order). Needs ``n_workers >= len(loads)``."""
    names = list(loads)
    if n_workers < len(names):
        raise ValueError(f"n_workers={n_workers}: need >= one per agent ({len(names)})")
    if any(v < 0 for v in loads.values()):
        raise ValueError(f"loads must be >= 0, got {loads}")
    total = float(sum(loads.values())) or 1.0
    spare = n_workers - len(names)
    share = {n: spare * loads[n] / total for n in names}
    out = {n: 1 + int(np.floor(share[n])) for n in names}
    rest = n_workers - sum(out.values())
    for n in sorted(names, key=lambda n: -(share[n] - np.floor(share[n])))[:rest]:
        out[n] += 1
    return out


def assign(costs: Sequence[float], n_workers: int, policy: str) -> list[list[int]]:
    """Request-level balancing: per worker, the request indices it runs, in run order
    (``round_robin`` or ``longest_first``; a worker runs its longest requests first)."""
    if policy == "round_robin":
        owner = round_robin(costs, n_workers)
    elif policy == "longest_first":
        owner = longest_first(costs, n_workers)
    else:
        raise ValueError(f"unknown assignment policy {policy!r}; valid: round_robin, "
                         "longest_first")
    queues: list[list[int]] = [[] for _ in range(n_workers)]
    order = (range(len(costs)) if policy == "round_robin"
             else sorted(range(len(costs)), key=lambda i: (-costs[i], i)))
    for i in order:
        queues[owner[i]].append(i)
    return queues


def busy_fraction(costs: Sequence[float], span: float, n_workers: int) -> float:
    """Mean worker utilisation: total cost over ``n_workers * span`` (1.0 for an empty span)."""
    return float(np.sum(costs)) / (n_workers * span) if span > 0 else 1.0


def _check(costs: Sequence[float], n_workers: int) -> None:
    if n_workers < 1:
        raise ValueError(f"n_workers={n_workers}: need >= 1")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be >= 0")
