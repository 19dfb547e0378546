"""What a FlexMARL run is given and what it returns, shared by the drivers and the baseline.

* :class:`PipelineConfig`: the fixed inputs of one :func:`~jaxflow.marl.pipeline.threads.run_pipeline`
  call (workflow, per-agent runtimes, budgets, mode, batching, timeouts, hooks), validated when
  it is built and never changed.
* :class:`PipelinePlan`: the config with what the run resolved before it started (the store and
  the version board, which lock themselves; whether commits persist trainer states; the resumed
  accumulators and the first version to train; how long a rollout waits for weights; the inline
  driver's per-request hook). Frozen too: a driver that needs other values builds its own with
  ``dataclasses.replace``.
* :class:`RunResult`: per-step params and rewards, busy seconds and run facts, for the pipeline
  and the barrier baseline alike.

The mutable state of a run is owned, not shared: each agent's
:class:`~jaxflow.marl.pipeline.trainer.AgentTrainer` holds its own counters and outputs, the
rollout returns its busy seconds and worker split, and the drivers assemble the result.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

from jaxflow.marl.pipeline.accumulate import Accumulator, group_rows
from jaxflow.marl.pipeline.runtime import AgentRuntime
from jaxflow.marl.pipeline.versions import VersionBoard
from jaxflow.marl.processes import multi_process
from jaxflow.marl.sampling import SamplingStats
from jaxflow.marl.store import ExperienceStore, SampleId
from jaxflow.marl.swap import AgentStateSwapper
from jaxflow.marl.workflow import Workflow
from jaxflow.rl.rollout import RolloutBatch

MODES = ("strict", "bounded")
DRIVERS = ("auto", "inline", "threads")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One FlexMARL run's fixed inputs (see the package doc for the modes).

    Args:
      workflow, runtimes: the agents and each agent's :class:`AgentRuntime`.
      steps: versions to train; n_inputs: turn-0 inputs per version; seed: samples and loss keys.
      mode: "strict" or "bounded" (staleness ``eta`` >= 0; 0 is strict).
      micro_inputs: inputs per trainer micro-batch (must divide ``n_inputs``).
      rollout_batch: inputs per rollout engine call (a request).
      rollout_workers: 1: one rollout thread runs every agent in turn order per input.
        >= number of agents: agent-level balancing gives each agent
        :func:`~jaxflow.marl.balance.allocate_workers` threads in proportion to its load
        (:func:`~jaxflow.marl.pipeline.runtime.agent_loads`, then the measured busy seconds of
        the previous version); each agent's threads pull its requests longest-first (predicted
        cost: the input's upstream response length, else equal) from a shared queue (dynamic
        list scheduling = work stealing); a downstream agent's request waits for its upstream
        output.
      swapper: swap each agent's training state to host while it waits for its next version.
      persist_state: store each trainer's state with every commit (None: when the store has a
        path); ``resume=True`` restarts from those states.
      interrupt: ``(agent, version, micro_batches_done) -> bool`` called after every commit;
        True makes that trainer raise :class:`~jaxflow.marl.pipeline.trainer.Interrupted`
        (tests of resumption).
      timeout_s: the run's deadline, and how long a rollout waits for weights.
      driver: "threads" (a rollout thread and a blocking trainer thread per agent), "inline"
        (strict with one rollout worker only: the trainers run on the rollout's thread between
        its engine calls and only dispatch their programs) or "auto" (inline where it applies,
        else threads). Both give bit-identical results.
    """

    workflow: Workflow
    runtimes: Mapping[str, AgentRuntime]
    steps: int
    n_inputs: int
    seed: int
    mode: str = "strict"
    eta: int = 0
    micro_inputs: int = 1
    rollout_batch: int = 1
    rollout_workers: int = 1
    swapper: AgentStateSwapper | None = None
    persist_state: bool | None = None
    resume: bool = False
    interrupt: Callable[[str, int, int], bool] | None = None
    timeout_s: float = 600.0
    driver: str = "auto"

    def __post_init__(self):
        mode, driver, workers = self.mode, self.driver, self.rollout_workers
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: 'strict', 'bounded'")
        if driver not in DRIVERS:
            raise ValueError(f"unknown driver {driver!r}; valid: {', '.join(map(repr, DRIVERS))}")
        if driver == "inline" and (mode != "strict" or workers != 1):
            raise ValueError(f"driver='inline' with mode={mode!r}, rollout_workers={workers}: "
                             "inline needs mode='strict' and rollout_workers=1")
        if self.eta < 0 or (mode == "strict" and self.eta != 0):
            raise ValueError(f"eta={self.eta}: need 0 for strict, >= 0 for bounded")
        if self.n_inputs % self.micro_inputs:
            raise ValueError(f"micro_inputs={self.micro_inputs} must divide "
                             f"n_inputs={self.n_inputs}")
        if workers != 1 and workers < len(self.names):
            raise ValueError(f"rollout_workers={workers}: need 1 or >= {len(self.names)} "
                             "(one per agent)")

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The agents in turn order."""
        return tuple(self.workflow.order())

    @functools.cached_property
    def turns(self) -> dict[str, int]:
        """Each agent's turn (per-row lookups: computed once)."""
        return {n: self.workflow.turn(n) for n in self.names}

    @property
    def inline(self) -> bool:
        """Whether the run uses the inline driver ("auto": strict with one rollout worker).

        Across processes always: the CPU / GPU runtimes start one collective program at a time
        in launch order, so threads that launch programs in a timing-dependent order would do it
        in a different order on each process and deadlock. Bounded runs there roll out batch v
        with version max(v - eta, first) exactly (:func:`~jaxflow.marl.pipeline.threads.bounded_weights`),
        deterministic on every process; strict runs give the threads driver's bits anyway."""
        if multi_process():
            return True
        if self.driver == "auto":
            return self.mode == "strict" and self.rollout_workers == 1
        return self.driver == "inline"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """What the drivers share, fixed for the run (see module doc).

    ``resumed``: the accumulators of trainers that restart mid-run; ``first``: the first version
    any trainer still has to train; ``wait_s``: how long a rollout waits for weights (0 on the
    inline driver: never waited for); ``after_request(agent)``: runs after each of the agent's
    rollout requests is stored (the inline driver's trainer of that agent)."""

    config: PipelineConfig
    store: ExperienceStore
    board: VersionBoard
    persist: bool
    resumed: Mapping[str, Accumulator]
    first: int
    wait_s: float
    after_request: Callable[[str], None] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The agents' names in turn order."""
        return self.config.names

    def sample_id(self, name: str, version: int, i: int, t: int) -> SampleId:
        """Row t of input i of agent ``name`` at ``version``."""
        return SampleId(version * self.config.n_inputs + i, self.config.turns[name], t)

    def put_rows(self, name: str, version: int, weights_version: int, i: int,
                 batch: RolloutBatch) -> None:
        """Input i's G rows of agent ``name`` into the store (rows already there are kept)."""
        for t, row in enumerate(group_rows(batch, self.config.runtimes[name].spec.group_size)):
            sid = self.sample_id(name, version, i, t)
            if not self.store.has(name, sid):
                self.store.put(name, sid, weights_version, row)


@dataclasses.dataclass
class RunResult:
    """Per-step host params per agent, reward means, per-role busy seconds and run facts.

    ``params[v]`` / ``rewards[v]`` are empty dicts for versions a resumed run did not train.
    ``staleness``: max / mean version lag (step - policy version) of the consumed rows.
    ``engine``: decode row-steps executed vs a padded batch decode (see
    :class:`~jaxflow.marl.sampling.SamplingStats`). ``workers``: rollout workers per agent.
    """

    params: list[dict[str, Any]]
    rewards: list[dict[str, float]]
    busy_s: dict[str, float]
    wall_s: float
    samples: int
    staleness: dict[str, float] = dataclasses.field(default_factory=dict)
    engine: dict[str, float] = dataclasses.field(default_factory=dict)
    workers: dict[str, int] = dataclasses.field(default_factory=dict)
    swap: dict[str, float] = dataclasses.field(default_factory=dict)


def engine_snapshot(runtimes: Mapping[str, AgentRuntime]) -> dict[str, SamplingStats]:
    """A copy of every agent's sampler counters (to subtract later)."""
    return {n: dataclasses.replace(rt.sampler.stats) for n, rt in runtimes.items()}


def engine_stats_since(runtimes: Mapping[str, AgentRuntime], before: dict[str, SamplingStats]
                       ) -> dict[str, float]:
    """Decode work of all samplers since the snapshot ``before``, plus ``saved_fraction``."""
    total = SamplingStats()
    for n, rt in runtimes.items():
        s = dataclasses.replace(rt.sampler.stats)
        for f in dataclasses.fields(s):
            setattr(s, f.name, getattr(s, f.name) - getattr(before[n], f.name))
        total.add(s)
    return dataclasses.asdict(total) | {"saved_fraction": total.saved_fraction}
