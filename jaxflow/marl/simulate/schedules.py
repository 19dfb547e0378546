"""Schedules (the sync baseline, FlexMARL and its ablations), the result of a simulation, and the
agent-level device split.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxflow.marl import balance
from jaxflow.marl.simulate.pool import POLICIES
from jaxflow.marl.simulate.workload import AgentCosts, AgentLoad

AGENT_SPLITS = ("equal", "load")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One simulated schedule: colocated lockstep or disaggregated, the agent device split, the request policy, the
    staleness bound ``eta`` and the trainer micro-batch."""
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
        """Throughput: samples over wall seconds."""
        return self.samples / self.wall_s

    def utilisation(self) -> dict[str, float]:
        """Busy fraction per role and ``overall`` (all devices), each in [0, 1]."""
        out = {"overall": sum(self.busy_s.values()) / (self.devices["all"] * self.wall_s)}
        for role, busy in self.busy_s.items():
            out[role] = busy / (self.devices[role] * self.wall_s)
        return out


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
