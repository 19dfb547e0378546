"""The two discrete-event simulations: the MARTI-style lockstep baseline and the disaggregated
FlexMARL micro-batch pipeline (see the package doc).
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import Sequence

import numpy as np

from jaxflow.marl.simulate.pool import RolloutPool
from jaxflow.marl.simulate.schedules import FLEXMARL, SYNC, Schedule, SimResult, plan_split, split_devices
from jaxflow.marl.simulate.workload import AgentCosts, AgentLoad, check_agents


def _train_s(tokens: float, n_samples: int, devices: int, c: AgentCosts) -> float:
    return tokens * c.train_token_s / max(1, min(devices, n_samples))


def _prompt_tokens(agents, lengths, a: AgentLoad, v: int, i: int) -> int:
    return a.prompt_tokens + (int(lengths[a.upstream][v, i, 0]) if a.upstream else 0)


def simulate_sync(agents: Sequence[AgentLoad], costs: dict[str, AgentCosts],
                  lengths: dict[str, np.ndarray], *, devices: int, slots: int,
                  schedule: Schedule = SYNC) -> SimResult:
    """The MARTI-style lockstep baseline (see module doc)."""
    check_agents(agents)
    shares = split_devices(devices, [1.0] * len(agents))
    versions, inputs, group = next(iter(lengths.values())).shape
    turns: list[list[AgentLoad]] = []
    depth: dict[str, int] = {}
    for a in agents:
        depth[a.name] = depth[a.upstream] + 1 if a.upstream else 0
        while len(turns) <= depth[a.name]:
            turns.append([])
        turns[depth[a.name]].append(a)
    t = 0.0
    busy_by = {(role, a.name): 0.0 for role in ("rollout", "train") for a in agents}
    for v in range(versions):
        for turn in turns:
            ends = []
            for a in turn:
                pool = RolloutPool(shares[agents.index(a)], slots, costs[a.name],
                                   schedule.request_policy)
                reqs = [((v, i, g), int(lengths[a.name][v, i, g]))
                        for i in range(inputs) for g in range(group)]
                ends.append(pool.run(reqs, t))
                busy_by[("rollout", a.name)] += pool.busy_s
            t = max(ends)
        ends = []
        for k, a in enumerate(agents):
            c = costs[a.name]
            tokens = sum(_prompt_tokens(agents, lengths, a, v, i) * group
                         + int(lengths[a.name][v, i].sum()) for i in range(inputs))
            train = _train_s(tokens, inputs * group, shares[k], c)
            busy_by[("train", a.name)] += tokens * c.train_token_s
            ends.append(t + 2 * c.swap_s + train + c.publish_s)
        t = max(ends)
    busy = {role: sum(s for (r, _), s in busy_by.items() if r == role)
            for role in ("rollout", "train")}
    return SimResult(t, versions * inputs * group * len(agents), busy,
                     {"all": devices, "rollout": devices, "train": devices}, busy_by)


def simulate_flexmarl(agents: Sequence[AgentLoad], costs: dict[str, AgentCosts],
                      lengths: dict[str, np.ndarray], *, devices: int, slots: int,
                      schedule: Schedule = FLEXMARL,
                      split: tuple[dict[str, int], dict[str, int]] | None = None
                      ) -> SimResult:
    """Disaggregated micro-batch pipeline with hierarchical balancing (see module doc).
    ``split``: (rollout, train) devices per agent; None = :func:`plan_split`."""
    check_agents(agents)
    versions, inputs, group = next(iter(lengths.values())).shape
    names = [a.name for a in agents]
    samples = inputs * group
    if split is None:
        split = plan_split(agents, costs, devices=devices, slots=slots, schedule=schedule,
                           samples=samples)
    roll_dev, train_dev = split
    if sum(roll_dev.values()) + sum(train_dev.values()) != devices:
        raise ValueError(f"split {split} does not add up to devices={devices}")
    pools = {n: RolloutPool(roll_dev[n], slots, costs[n], schedule.request_policy) for n in names}
    downstream = {a.name: [b for b in agents if b.upstream == a.name] for a in agents}
    by = {a.name: a for a in agents}

    published = dict.fromkeys(names, 0)  # the newest weights' version per agent
    opened = dict.fromkeys(names, -1)  # highest version whose rollouts may start
    ready_groups: dict[str, dict[int, list[int]]] = {n: collections.defaultdict(list)
                                                     for n in names}
    avail: dict[str, dict[int, list[int]]] = {n: collections.defaultdict(list) for n in names}
    tver = dict.fromkeys(names, 0)  # version each trainer is accumulating
    consumed = dict.fromkeys(names, 0)
    running = dict.fromkeys(names, False)
    events: list = []  # (time, seq, kind, agent, payload)
    seq = [0]
    busy_train = dict.fromkeys(names, 0.0)
    end = [0.0]

    def push(t, kind, name, payload):
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, name, payload))

    def group_requests(n, v, i):
        return [((n, v, i, g), int(lengths[n][v, i, g])) for g in range(group)]

    def open_gates(n, now):
        while opened[n] + 1 < versions and opened[n] + 1 <= published[n] + schedule.eta:
            opened[n] += 1
            u = opened[n]
            todo = range(inputs) if not by[n].upstream else ready_groups[n].pop(u, [])
            reqs = [r for i in todo for r in group_requests(n, u, i)]
            pools[n].submit(reqs, now)

    def try_train(n, now):
        if running[n] or tver[n] >= versions:
            return
        v = tver[n]
        need = samples - consumed[n]
        if need == 0:  # waiting for the publish
            return
        want = min(need, max(schedule.micro_batch, train_dev[n]))
        if len(avail[n][v]) < want:
            return
        batch, avail[n][v] = avail[n][v], []
        tokens = float(sum(batch))
        busy_train[n] += tokens * costs[n].train_token_s
        running[n] = True
        push(now + _train_s(tokens, len(batch), train_dev[n], costs[n]), "trained", n, len(batch))

    for n in names:
        open_gates(n, 0.0)
    while True:
        t_pool, pool_name = min((pools[n].next_time(), n) for n in names)
        t_event = events[0][0] if events else math.inf
        if t_pool == math.inf and t_event == math.inf:
            break
        if t_pool <= t_event:
            now, done = pools[pool_name].pop_completions()
            n = pool_name
            for (_, v, i, g) in done:
                a = by[n]
                avail[n][v].append(_prompt_tokens(agents, lengths, a, v, i)
                                   + int(lengths[n][v, i, g]))
                if g == 0:
                    for b in downstream[n]:
                        if v <= opened[b.name]:
                            pools[b.name].submit(group_requests(b.name, v, i), now)
                        else:
                            ready_groups[b.name][v].append(i)
            try_train(n, now)
            continue
        now, _, kind, n, payload = heapq.heappop(events)
        if kind == "trained":
            running[n] = False
            consumed[n] += payload
            if consumed[n] == samples:
                push(now + costs[n].publish_s, "published", n, tver[n])
            else:
                try_train(n, now)
        else:  # published: weights of version payload + 1 are live
            published[n] = payload + 1
            tver[n], consumed[n] = payload + 1, 0
            running[n] = False
            end[0] = max(end[0], now)
            open_gates(n, now)
            try_train(n, now)
    if any(tver[n] != versions for n in names):
        raise RuntimeError(f"simulation stalled at trainer versions {tver}")
    busy_by = {("rollout", n): pools[n].busy_s for n in names}
    busy_by |= {("train", n): busy_train[n] for n in names}
    return SimResult(end[0], versions * samples * len(agents),
                     {"rollout": sum(p.busy_s for p in pools.values()),
                      "train": sum(busy_train.values())},
                     {"all": devices, "rollout": sum(roll_dev.values()),
                      "train": sum(train_dev.values())}, busy_by)


def simulate(agents: Sequence[AgentLoad], costs: dict[str, AgentCosts],
             lengths: dict[str, np.ndarray], *, devices: int, slots: int,
             schedule: Schedule) -> SimResult:
    """Simulate one schedule: ``simulate_flexmarl`` when it is disaggregated, else ``simulate_sync``."""
    fn = simulate_flexmarl if schedule.disaggregated else simulate_sync
    return fn(agents, costs, lengths, devices=devices, slots=slots, schedule=schedule)
