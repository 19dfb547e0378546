"""The simulated workload: agents, their response-length distributions and per-agent costs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


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


def check_agents(agents: Sequence[AgentLoad]) -> None:
    """Raise ValueError unless the agents have distinct names, valid sizes and lengths, and each upstream names an
    earlier agent."""
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
