"""Discrete-event simulation of multi-agent LLM RL at cluster scale (FlexMARL, arXiv 2602.09578).

What is simulated, per node count (``devices_per_node`` accelerators per node, one rollout
replica per accelerator):

* Workload: agents in turn order (e.g. solver -> verifier); per version, ``inputs`` prompts and
  ``group_size`` trajectories per agent; response lengths drawn per request from a capped
  lognormal per agent (the skew). A downstream agent's group for input i becomes ready when the
  upstream agent's trajectory 0 of input i finishes (the workflow's edge), and its prompt
  includes that response.
* Decode on a replica is continuous batching with ``slots`` concurrent sequences; one decode
  step with ``b`` active sequences costs ``t(b) = weight_s + b * seq_s`` (memory-bound weight
  read + per-sequence compute), so the cost per token falls with occupancy and a long tail
  decodes at low occupancy. Finished sequences free their slot at once (no wasted steps, in both
  schedules). Prefill is not modelled.
* Training costs ``train_token_s`` per (prompt + response) token, data parallel over the
  agent's training devices (at most one sample per device in flight); a publish costs
  ``publish_s`` per agent and version; a swap of an agent's training state between device and
  host costs ``swap_s``.

Schedules (:class:`Schedule`):

* ``sync`` (MARTI-style baseline): devices split equally between agents and colocated (each
  agent's devices roll out, then train); turns are rolled out in order with a barrier between
  turns; requests are assigned round-robin; after the last turn every agent swaps its training
  state in, trains its full batch, publishes and swaps out; the next version starts after a
  global barrier.
* ``flexmarl``: rollout and training disaggregated, devices split between roles and, within a
  role, between agents in proportion to the expected load (agent-level balancing, from the
  length distributions' means, not the drawn lengths); requests streamed to the agent's
  replicas with a request-level policy (``round_robin`` / ``longest_first`` / ``work_stealing``,
  the rules of :mod:`jaxflow.marl.balance`); each agent's trainer consumes micro-batches as
  samples finish and steps + publishes when version v is complete; rollouts of an agent's
  version u start once its weights of version >= u - eta are published (eta = 0: strict, no
  staleness; eta > 0: bounded staleness). Agents' versions advance independently.

``longest_first`` and ``work_stealing`` use the drawn lengths (an oracle; a real system
estimates them). Busy time: a replica is busy while it has >= 1 active sequence; a training
device while it trains; publish and swap time count as idle. Everything is pure Python/numpy and
deterministic given the seed.

Costs (:func:`calibrate`): the measured ``flexmarl`` quick run's lockstep baseline gives dev-CPU
seconds per parameter for a trained token, a decode step (split into a per-sequence part =
trained token / 4 by FLOPs and the rest, the weight part) and a publish; they are scaled to the
simulated agents by parameter count (FLOPs and bytes both grow with it) and by one speed factor
that puts training at ``8 P / (peak * mfu)`` per token on the accelerator. Swap time is
``swap_bytes_per_param * P / host bandwidth`` (an assumption, not measured). The ``flexmarl_scale`` experiment
(``jaxflow/main/flexmarl_scale.py``) sweeps it.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from jaxflow.marl import balance

POLICIES = balance.POLICIES  # round_robin, longest_first, work_stealing
AGENT_SPLITS = ("equal", "load")


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class AgentLoad:
    """One agent of the simulated workload. ``params``: model size (parameters); responses are
    ``min(len_max, round(lognormal(log(len_median), len_sigma)))`` tokens (>= 1)."""

    name: str
    params: float
    prompt_tokens: int
    len_median: float
    len_sigma: float
    len_max: int
    upstream: str = ""  # "" = first turn; else the agent whose trajectory 0 it reads

    def mean_len(self) -> float:
        """Mean of the uncapped lognormal, capped at len_max (a load estimate, not exact)."""
        return min(float(self.len_max), self.len_median * math.exp(self.len_sigma ** 2 / 2))


@dataclasses.dataclass(frozen=True)
class AgentCosts:
    """Seconds: one decode step is ``weight_s + b * seq_s`` for b active sequences."""

    weight_s: float
    seq_s: float
    train_token_s: float
    publish_s: float
    swap_s: float


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    disaggregated: bool  # False: colocated lockstep (the sync baseline)
    agent_split: str = "load"  # "equal" | "load"
    request_policy: str = "work_stealing"
    eta: int = 0  # staleness bound (disaggregated only)
    micro_batch: int = 8  # samples per trainer micro-batch (at least the agent's train devices)

    def __post_init__(self):
        if self.agent_split not in AGENT_SPLITS:
            raise ValueError(f"agent_split={self.agent_split!r}; valid: {', '.join(AGENT_SPLITS)}")
        if self.request_policy not in POLICIES:
            raise ValueError(f"request_policy={self.request_policy!r}; valid: "
                             f"{', '.join(POLICIES)}")
        if self.eta < 0:
            raise ValueError(f"eta={self.eta}: the staleness bound must be >= 0")
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch={self.micro_batch}: need >= 1")


SYNC = Schedule("sync", disaggregated=False, agent_split="equal", request_policy="round_robin")
FLEXMARL = Schedule("flexmarl", disaggregated=True)


@dataclasses.dataclass
class SimResult:
    """``busy_s``: busy device-seconds per role; ``devices``: devices holding each role."""

    wall_s: float
    samples: int
    busy_s: dict[str, float]
    devices: dict[str, int]
    busy_by: dict = dataclasses.field(default_factory=dict)  # (role, agent) -> device-seconds

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    def utilisation(self) -> dict[str, float]:
        """Busy fraction per role and ``overall`` (all devices), each in [0, 1]."""
        out = {"overall": sum(self.busy_s.values()) / (self.devices["all"] * self.wall_s)}
        for role, busy in self.busy_s.items():
            out[role] = busy / (self.devices[role] * self.wall_s)
        return out


def check_agents(agents: Sequence[AgentLoad]) -> None:
    names = [a.name for a in agents]
    if not agents or len(set(names)) != len(names):
        raise ValueError(f"agents {names}: need >= 1 agent with distinct names")
    seen: set[str] = set()
    for a in agents:
        if a.params <= 0:
            raise ValueError(f"agent {a.name!r}: params={a.params} must be > 0")
        if a.prompt_tokens < 0:
            raise ValueError(f"agent {a.name!r}: prompt_tokens={a.prompt_tokens} must be >= 0")
        if a.len_median <= 0:
            raise ValueError(f"agent {a.name!r}: len_median={a.len_median} must be > 0")
        if a.len_sigma < 0:
            raise ValueError(f"agent {a.name!r}: len_sigma={a.len_sigma} must be >= 0")
        if a.len_max < 1:
            raise ValueError(f"agent {a.name!r}: len_max={a.len_max} must be >= 1")
        if a.upstream and a.upstream not in seen:
            raise ValueError(f"agent {a.name!r}: upstream={a.upstream!r} must name an earlier "
                             f"agent (one of {sorted(seen)})")
        seen.add(a.name)


def sample_lengths(agents: Sequence[AgentLoad], *, versions: int, inputs: int, group_size: int,
                   seed: int) -> dict[str, np.ndarray]:
    """Response lengths per agent, shape ``(versions, inputs, group_size)``; a pure function of
    the seed (both schedules see the same requests)."""
    out = {}
    for k, a in enumerate(agents):
        rng = np.random.default_rng([seed, k, 0x5CA1E])
        raw = rng.lognormal(math.log(a.len_median), a.len_sigma, (versions, inputs, group_size))
        out[a.name] = np.clip(np.round(raw), 1, a.len_max).astype(np.int64)
    return out


# ----------------------------------------------------------------------------- rollout pool


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


# ----------------------------------------------------------------------------- device split


def split_devices(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` devices in proportion to ``weights``, each share >= 1 (largest remainder:
    :func:`jaxflow.marl.balance.allocate_workers`)."""
    k = len(weights)
    if total < k:
        raise ValueError(f"{total} devices cannot give each of {k} shares >= 1")
    return list(balance.allocate_workers(dict(enumerate(weights)), total).values())


def expected_loads(agents: Sequence[AgentLoad], costs: dict[str, AgentCosts], slots: int,
                   samples: int) -> tuple[dict[str, float], dict[str, float]]:
    """Device-seconds per version and agent (rollout at full occupancy, training), from the
    length distributions' means: the agent-level balancer's estimate."""
    by = {a.name: a for a in agents}
    roll, train = {}, {}
    for a in agents:
        c, mean = costs[a.name], a.mean_len()
        roll[a.name] = samples * mean * (c.weight_s / slots + c.seq_s)
        prompt = a.prompt_tokens + (by[a.upstream].mean_len() if a.upstream else 0.0)
        train[a.name] = samples * (prompt + mean) * c.train_token_s
    return roll, train


# ----------------------------------------------------------------------------- schedules


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


def plan_split(agents: Sequence[AgentLoad], costs: dict[str, AgentCosts], *, devices: int,
               slots: int, schedule: Schedule, samples: int
               ) -> tuple[dict[str, int], dict[str, int]]:
    """Agent-level allocation: (rollout, train) devices per agent. ``equal``: every (role,
    agent) pair gets an equal share; ``load``: shares in proportion to :func:`expected_loads`
    (the length distributions' means, not the drawn lengths)."""
    names = [a.name for a in agents]
    if devices < 2 * len(names):
        raise ValueError(f"devices={devices}: the disaggregated schedule needs >= 2 per agent "
                         f"({2 * len(names)})")
    if schedule.agent_split == "equal":
        weights = [1.0] * 2 * len(names)
    else:
        roll, train = expected_loads(agents, costs, slots, samples)
        weights = [roll[n] for n in names] + [train[n] for n in names]
    shares = split_devices(devices, weights)
    return dict(zip(names, shares[:len(names)])), dict(zip(names, shares[len(names):]))


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
    fn = simulate_flexmarl if schedule.disaggregated else simulate_sync
    return fn(agents, costs, lengths, devices=devices, slots=slots, schedule=schedule)


# ----------------------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """Measured costs: the sync baseline of the ``flexmarl`` quick run (dev CPU, 2026-11-30,
    runs/flexmarl/20261130-085455, the experiments/README.md table). The workload constants are
    that run's: a fixed-length sampler (solver 4 + verifier 2 decode steps per input, G
    sequences each), solver samples of 5 prompt + 4 response tokens, the solver's parameter count
    (d_model 64, 2 layers, d_ff 128, vocab 23, untied)."""

    samples_per_s: float = 836.534
    busy_rollout: float = 0.734391
    busy_train_solver: float = 0.155834
    busy_train_verifier: float = 0.0875356
    steps: int = 4
    inputs: int = 4
    group_size: int = 4
    agents: int = 2
    decode_steps_per_input: int = 6
    solver_sample_tokens: int = 9
    solver_params: float = 85184.0


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Assumptions (not measured here): the accelerator's bf16 peak and the training MFU fix the
    absolute time scale only; ``host_gbytes_per_s`` and ``swap_bytes_per_param`` (bf16 params +
    f32 master + Adam m, v = 14, rounded to 16) give the state-swap time."""

    peak_flops: float = 989e12  # H200 bf16 dense
    mfu_train: float = 0.4
    host_gbytes_per_s: float = 50.0
    swap_bytes_per_param: float = 16.0


def measured_from_summary(summary: dict) -> MeasuredRun:
    """A :class:`MeasuredRun` from a ``flexmarl`` summary.json (its sync baseline numbers)."""
    cfg, util = summary["config"], summary["baseline_utilisation"]
    s = cfg["solver"]
    d, f, v, layers = s["d_model"], s["d_ff"], s["vocab_size"], s["n_layers"]
    hd = d // s["n_heads"]
    attn = d * hd * (2 * s["n_heads"] + 2 * s["n_kv_heads"])
    params = v * d * (1 if s.get("tie_embeddings") else 2) + layers * (attn + 3 * d * f + 2 * d) + d
    return MeasuredRun(samples_per_s=summary["baseline_samples_per_s"],
                       busy_rollout=util["rollout"], busy_train_solver=util["train/solver"],
                       busy_train_verifier=util["train/verifier"], steps=cfg["steps"],
                       inputs=cfg["n_inputs"], group_size=cfg["group_size"],
                       solver_sample_tokens=2 * cfg["max_digits"] + 3 + 4, solver_params=params)


def per_param_costs(m: MeasuredRun) -> dict[str, float]:
    """Measured dev-CPU seconds per parameter (FLOPs and bytes both scale with the parameter
    count): ``train_token`` (one trained token), ``seq`` (one sequence in one decode step =
    train_token / 4: a forward is 2P FLOPs, the timed training step 8P: forward + backward +
    old-log-prob forward), ``weight`` (the rest of a decode step, measured at occupancy G),
    ``publish`` (the lockstep wall time outside rollout and training, per agent and step)."""
    wall = m.steps * m.inputs * m.group_size * m.agents / m.samples_per_s
    train_token = (m.busy_train_solver * wall
                   / (m.steps * m.inputs * m.group_size * m.solver_sample_tokens))
    seq = train_token / 4
    step = m.busy_rollout * wall / (m.steps * m.inputs * m.decode_steps_per_input)
    weight = step - m.group_size * seq
    rest = 1.0 - m.busy_rollout - m.busy_train_solver - m.busy_train_verifier
    if weight <= 0 or rest < 0:
        raise ValueError(f"measured costs inconsistent: decode step {step:.3g} s, "
                         f"idle fraction {rest:.3g}")
    publish = rest * wall / (m.steps * m.agents)
    return {k: val / m.solver_params for k, val in
            (("train_token", train_token), ("seq", seq), ("weight", weight),
             ("publish", publish))}


def calibrate(agents: Sequence[AgentLoad], measured: MeasuredRun, hw: Hardware
              ) -> tuple[dict[str, AgentCosts], dict]:
    """Per-agent costs at the agents' sizes: measured per-parameter costs x params / speed,
    where ``speed`` = dev CPU's train seconds per parameter-token / the accelerator's
    (8 / (peak * mfu)). Only the absolute time scale rests on ``speed``; every ratio (decode vs
    train vs publish, and the decode occupancy knee weight / seq) is the measured one."""
    pp = per_param_costs(measured)
    speed = pp["train_token"] / (8.0 / (hw.peak_flops * hw.mfu_train))
    costs = {a.name: AgentCosts(
        weight_s=pp["weight"] * a.params / speed, seq_s=pp["seq"] * a.params / speed,
        train_token_s=pp["train_token"] * a.params / speed,
        publish_s=pp["publish"] * a.params / speed,
        swap_s=hw.swap_bytes_per_param * a.params / (hw.host_gbytes_per_s * 1e9))
        for a in agents}
    info = {"per_param_dev_cpu_s": pp, "accelerator_vs_dev_cpu": speed,
            "decode_knee_occupancy": pp["weight"] / pp["seq"]}
    return costs, info


# ----------------------------------------------------------------------------- sweeps

def schedules_from(config) -> dict[str, Schedule]:
    """The baseline, FlexMARL strict and the ablations named in the config."""
    mb = config.micro_batch
    out = {"sync": SYNC,
           "flexmarl": Schedule("flexmarl", True, "load", config.request_policy, 0, mb),
           "no_balance": Schedule("no_balance", True, "equal", "round_robin", 0, mb),
           "longest_first": Schedule("longest_first", True, "load", "longest_first", 0, mb)}
    for eta in config.etas:
        out[f"eta{eta}"] = Schedule(f"eta{eta}", True, "load", config.request_policy, eta, mb)
    return out


def run_scale(config) -> dict:
    """Every schedule at every node count; plain data (see :func:`main`)."""
    agents = tuple(AgentLoad(**dict(a)) if not isinstance(a, AgentLoad) else a
                   for a in config.agents)
    if config.sigma_scale < 0:
        raise ValueError(f"sigma_scale={config.sigma_scale}: must be >= 0")
    agents = tuple(dataclasses.replace(a, len_sigma=a.len_sigma * config.sigma_scale)
                   for a in agents)
    check_agents(agents)
    for key in ("devices_per_node", "slots", "inputs_per_node", "group_size", "versions"):
        if getattr(config, key) < 1:
            raise ValueError(f"{key}={getattr(config, key)}: must be >= 1")
    if config.global_inputs < 0:
        raise ValueError(f"global_inputs={config.global_inputs}: must be >= 0 (0 = weak "
                         "scaling with inputs_per_node)")
    if not config.nodes or min(config.nodes) < 1:
        raise ValueError(f"nodes={config.nodes}: need node counts >= 1")
    costs, info = calibrate(agents, config.measured, config.hardware)
    scheds = schedules_from(config)
    rows = []
    for nodes in config.nodes:
        devices = nodes * config.devices_per_node
        lengths = sample_lengths(agents, versions=config.versions,
                                 inputs=config.global_inputs or nodes * config.inputs_per_node,
                                 group_size=config.group_size, seed=config.seed)
        for name, sched in scheds.items():
            res = simulate(agents, costs, lengths, devices=devices, slots=config.slots,
                           schedule=sched)
            rows.append({"nodes": nodes, "devices": devices, "schedule": name,
                         "wall_s": res.wall_s, "samples": res.samples,
                         "samples_per_s": res.samples_per_s, "utilisation": res.utilisation(),
                         "devices_per_role": res.devices})
    return {"rows": rows, "costs": costs, "calibration": info, "agents": agents}
