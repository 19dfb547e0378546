"""FlexMARL's agents as one :class:`jaxflow.system.System`.

The system is the solver / verifier workflow (:func:`~jaxflow.marl.workflow.solver_verifier_workflow`
of the ``flexmarl`` config) with one :class:`~jaxflow.marl.pipeline.AgentRuntime` per agent on
its own ``{"trainer", "rollout"}`` meshes. Its state (:class:`FlexMARLState`) is every agent's
train state, the host copy of the initial params (so every timed run starts from the same
weights) and the version; its step is one lockstep version
(:func:`~jaxflow.marl.pipeline.barrier.lockstep_step`: roll out every agent, then one
full-batch GRPO step per agent), which the strict pipeline equals on the same samples.

Meshes are ``{"AGENT/ROLE": mesh}`` (:func:`resolve_meshes`), the form ``--compile-only``
passes to :meth:`FlexMARLSystem.programs`. The ``flexmarl`` experiment
(``jaxflow/main/flexmarl.py``) times the run modes on this state (:mod:`jaxflow.marl.speedup`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxflow.compile_only.program import Program
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.marl.meshes import agent_centric_meshes
from jaxflow.marl.pipeline import AgentRuntime, input_prompts, lockstep_step, rollout_inputs
from jaxflow.marl.processes import host_tree
from jaxflow.marl.programs import agent_programs, engine_programs
from jaxflow.marl.sampling import AgentSampler
from jaxflow.marl.workflow import Workflow, solver_verifier_workflow
from jaxflow.rl.rollout import EngineSettings
from jaxflow.system import static_field, system_state
from jaxflow.train.lm_state import init_params
from jaxflow.train.state import TrainState

__all__ = ["FlexMARLSystem", "FlexMARLState", "FlexMARLParts", "workflow_of", "agent_meshes",
           "resolve_meshes", "meshes_by_agent", "build_runtimes", "bench_engine", "agent_keys"]

#: Folded into the seed's key for :meth:`FlexMARLSystem.evaluate`'s samples and prompts (a
#: stream no training version draws from).
EVAL_STREAM = 0xE7A1


def workflow_of(config: Any) -> Workflow:
    """The ``flexmarl`` config's solver / verifier workflow (models, group size, digits and
    response budgets from ``config``)."""
    return solver_verifier_workflow(config.solver, config.verifier, group_size=config.group_size,
                                    max_digits=config.max_digits,
                                    solver_tokens=config.solver_tokens,
                                    verifier_tokens=config.verifier_tokens)


def agent_meshes(config: Any, devices: Sequence | None = None) -> dict[str, dict[str, Mesh]]:
    """``{agent: {"trainer": mesh, "rollout": mesh}}`` on ``devices`` (default
    ``jax.devices()``), split agent-centrically by
    :func:`~jaxflow.marl.meshes.agent_centric_meshes` with the config's model-axis caps."""
    devices = list(jax.devices() if devices is None else devices)
    return agent_centric_meshes(workflow_of(config), len(devices), devices=devices,
                                trainer_model=config.trainer_model,
                                rollout_model=config.rollout_model)


def resolve_meshes(config: Any, devices: Sequence | None = None) -> dict[str, Mesh]:
    """:func:`agent_meshes` flattened to ``{"AGENT/ROLE": mesh}`` (roles ``trainer`` /
    ``rollout``): the meshes a run, ``--dry-run`` and ``--compile-only`` use."""
    return {f"{a}/{role}": m for a, by_role in agent_meshes(config, devices).items()
            for role, m in by_role.items()}


def meshes_by_agent(workflow: Workflow, meshes: Mapping[str, Mesh]) -> dict[str, dict[str, Mesh]]:
    """``{"AGENT/ROLE": mesh}`` back to ``{agent: {"trainer": mesh, "rollout": mesh}}``; a
    missing entry is a ValueError naming it and the ones given."""
    out = {}
    for a in workflow.order():
        missing = [f"{a}/{r}" for r in ("trainer", "rollout") if f"{a}/{r}" not in meshes]
        if missing:
            raise ValueError(f"meshes lack {missing}; given: {sorted(meshes)}")
        out[a] = {"trainer": meshes[f"{a}/trainer"], "rollout": meshes[f"{a}/rollout"]}
    return out


def build_runtimes(config: Any, workflow: Workflow, meshes: Mapping[str, Mapping[str, Mesh]]
                   ) -> dict[str, AgentRuntime]:
    """Each agent's :class:`~jaxflow.marl.pipeline.AgentRuntime` (compiled GRPO functions,
    optimizer, sampler: the paged engine with ``engine_chunk`` decode steps per decode call) on
    its ``{"trainer": mesh, "rollout": mesh}``: what the run trains with."""
    return {a.name: AgentRuntime(a, workflow, meshes[a.name], config.optim,
                                 n_inputs=config.n_inputs, total_steps=config.steps + 1,
                                 entropy_coef=config.entropy_coef,
                                 engine=EngineSettings(decode_steps=config.engine_chunk))
            for a in workflow.agents}


def bench_engine(config: Any, workflow: Workflow, mesh: Mesh, *, bucket_rows: bool = True
                 ) -> AgentSampler:
    """The engine benchmark's solver sampler (``bench_tokens`` new tokens, temperature 1,
    ``bench_chunk`` decode steps per decode call; ``bucket_rows`` False: the padded batch
    decode) on the rollout ``mesh``."""
    return AgentSampler(config.solver, mesh, max_new_tokens=config.bench_tokens,
                        temperature=1.0, task=workflow.task("solver"), tokenizer=CharTokenizer(),
                        settings=EngineSettings(decode_steps=config.bench_chunk),
                        bucket_rows=bucket_rows)


def agent_keys(n_agents: int) -> jax.Array:
    """The ``flexmarl`` experiment's init keys [n_agents]: ``key(i)`` for the i-th agent of
    ``workflow.agents`` (the keys its recorded runs used)."""
    return jnp.stack([jax.random.key(i) for i in range(n_agents)])


@dataclasses.dataclass(frozen=True, eq=False)
class FlexMARLParts:
    """What a :class:`FlexMARLState` runs on, fixed at :meth:`FlexMARLSystem.init`: the
    config, the workflow, each agent's runtime and ``{agent: {role: mesh}}`` (static: compared
    by identity)."""

    config: Any
    workflow: Workflow
    runtimes: Mapping[str, AgentRuntime]
    meshes: Mapping[str, Mapping[str, Mesh]]


@system_state
class FlexMARLState:
    """FlexMARL's state: ``policies`` (each agent's :class:`~jaxflow.train.state.TrainState`
    on its trainer mesh), ``initial`` (each agent's version-0 params, host arrays) and, static,
    ``version`` (versions trained) and ``parts`` (:class:`FlexMARLParts`)."""

    policies: dict[str, TrainState]
    initial: dict[str, Any]
    version: int = static_field()
    parts: FlexMARLParts = static_field()


@dataclasses.dataclass(frozen=True)
class FlexMARLSystem:
    """FlexMARL's agents (see the module doc): ``init`` / ``step`` / ``programs`` /
    ``evaluate`` of :class:`jaxflow.system.System`, and :meth:`restart` (version 0 again, fresh
    buffers from the initial params: what every timed run of the experiment starts from)."""

    def init(self, config: Any, meshes: Mapping[str, Mesh], key: jax.Array) -> FlexMARLState:
        """Runtimes on ``meshes`` (``{"AGENT/ROLE": mesh}``) and agent i's params from
        ``key[i]`` (``key`` [n_agents], e.g. :func:`agent_keys`), at version 0."""
        workflow = workflow_of(config)
        n = len(workflow.agents)
        if key.shape != (n,):
            raise ValueError(f"key of shape {key.shape}; need one key per agent, shape ({n},)")
        by_agent = meshes_by_agent(workflow, meshes)
        runtimes = build_runtimes(config, workflow, by_agent)
        initial = {name: host_tree(init_params(rt.fns, rt.spec.model, key[i]))
                   for i, (name, rt) in enumerate(runtimes.items())}
        parts = FlexMARLParts(config, workflow, runtimes, by_agent)
        return self.restart(FlexMARLState({}, initial, 0, parts))

    def restart(self, state: FlexMARLState) -> FlexMARLState:
        """``state`` at version 0: every agent's train state fresh from ``state.initial``."""
        runtimes = state.parts.runtimes
        policies = {n: rt.init_policy(state.initial[n]) for n, rt in runtimes.items()}
        return FlexMARLState(policies, state.initial, 0, state.parts)

    def step(self, state: FlexMARLState, batch: Sequence[str] | None, *, key: jax.Array
             ) -> tuple[FlexMARLState, dict[str, float]]:
        """One lockstep version: ``batch`` the version's turn-0 prompts (None: the config's
        ``n_inputs`` prompts of :func:`~jaxflow.marl.pipeline.input_prompts` at the state's
        version), ``key`` the version's keys [2] (:func:`~jaxflow.marl.pipeline.version_keys`
        of the seed and version reproduces :func:`~jaxflow.marl.pipeline.run_sync`). The input
        state's train states are donated. Metrics: ``reward/AGENT`` (the version's reward mean)
        and ``busy_s/ROLE``."""
        parts = state.parts
        cfg = parts.config
        prompts = (input_prompts(parts.workflow, cfg.seed, state.version, cfg.n_inputs)
                   if batch is None else list(batch))
        out = lockstep_step(parts.workflow, parts.runtimes, state.policies, prompts, key=key,
                            version=state.version, rollout_batch=cfg.rollout_batch)
        metrics = ({f"reward/{n}": r for n, r in out.rewards.items()}
                   | {f"busy_s/{role}": s for role, s in out.busy_s.items()})
        return FlexMARLState(out.policies, state.initial, state.version + 1, parts), metrics

    def programs(self, config: Any, meshes: Mapping[str, Mesh]) -> list[Program]:
        """``--compile-only``: a run's jitted programs on ``meshes`` (:func:`resolve_meshes`'
        on the target's devices): per agent its trainer programs
        (:func:`~jaxflow.marl.programs.agent_programs`) and its sampler's paged-engine prefill
        and decode calls for one rollout call's rows; the engine benchmark's (its decode over
        every slot is also the padded decode) when its shapes differ from the solver's."""
        workflow = workflow_of(config)
        by_agent = meshes_by_agent(workflow, meshes)
        runtimes = build_runtimes(config, workflow, by_agent)
        programs = []
        for name, rt in runtimes.items():
            programs += agent_programs(rt, n_inputs=config.n_inputs,
                                       micro_inputs=config.micro_inputs)
            programs += engine_programs(f"{name}/rollout", rt.sampler,
                                        config.rollout_batch * rt.spec.group_size)
        bench = bench_engine(config, workflow, by_agent["solver"]["rollout"])
        solver = runtimes["solver"]
        rows = config.rollout_batch * solver.spec.group_size
        if (bench.config, bench.engine_config(config.bench_rows)) != (
                solver.sampler.config, solver.sampler.engine_config(rows)):
            programs += engine_programs("solver/bench", bench, config.bench_rows)
        return programs

    def evaluate(self, state: FlexMARLState) -> dict[str, float]:
        """Each agent's reward mean (``eval/reward/AGENT``) on ``n_inputs`` held-out prompts
        rolled out with the state's policies (prompts and samples from the seed's
        :data:`EVAL_STREAM`, drawn by no training version); no parameter changes."""
        parts = state.parts
        cfg, workflow = parts.config, parts.workflow
        first = workflow.order()[0]
        prompts = workflow.task(first).prompts(np.random.default_rng([cfg.seed, EVAL_STREAM]),
                                               cfg.n_inputs)
        published = {n: parts.runtimes[n].publish(state.policies[n]) for n in workflow.order()}
        key = jax.random.fold_in(jax.random.key(cfg.seed), EVAL_STREAM)
        out = rollout_inputs(workflow, parts.runtimes, published, prompts, key=key,
                             input_ids=list(range(len(prompts))))
        return {f"eval/reward/{n}": float(np.mean(b.rewards)) for n, b in out.items()}
