"""FlexMARL-style multi-agent RL: workflow as data, experience store, micro-batch pipeline
(strict / bounded staleness), sampling through the paged rollout engine (``sampling``:
:class:`AgentSampler` over :class:`jaxflow.rollout.RolloutEngine`) with hierarchical load
balancing, agent state swapping (see each module's doc). Across processes every mesh spans every process alike and
``jaxflow.marl.processes`` keeps the processes in step.

``system`` is the whole as one :class:`jaxflow.system.System` (:class:`FlexMARLSystem`: typed
state, a lockstep version as its step, the ``--compile-only`` programs); ``speedup`` the run
modes, their fair timing and the speedup summary of the ``flexmarl`` experiment;
``engine_bench`` the bucketed vs padded decode benchmark of the sampler; ``scale_report`` the cluster
simulator's (``simulate``) sweep beside the paper's figures (the ``flexmarl_scale``
experiment)."""

from jaxflow.marl.balance import (
    allocate_workers,
    assign,
    busy_fraction,
    longest_first,
    makespan,
    round_robin,
    work_stealing_makespan,
)
from jaxflow.marl.pipeline import (
    AgentRuntime,
    Interrupted,
    PipelineConfig,
    RunResult,
    accumulate,
    apply_accumulated,
    relative_param_diff,
    run_bounded,
    run_pipeline,
    run_strict,
    run_sync,
    weighted_grad,
)
from jaxflow.marl.sampling import AgentSampler, SamplingStats, replica_mesh, row_keys
from jaxflow.marl.scale_report import paper_checks, plot_scale, scale_summary
from jaxflow.marl.speedup import LOCKSTEP, ModeTimings, fastest_lockstep, run_modes, speedup_summary, time_modes
from jaxflow.marl.store import ExperienceStore, Row, SampleId
from jaxflow.marl.swap import AgentStateSwapper, swap_in, swap_out
from jaxflow.marl.system import FlexMARLParts, FlexMARLState, FlexMARLSystem, agent_keys, resolve_meshes
from jaxflow.marl.workflow import AgentSpec, Edge, VerifyAdditionTask, Workflow, solver_verifier_workflow

__all__ = ["allocate_workers", "assign", "busy_fraction", "longest_first", "makespan", "round_robin",
           "work_stealing_makespan", "AgentSampler", "SamplingStats", "replica_mesh", "row_keys", "AgentRuntime",
           "Interrupted", "PipelineConfig", "RunResult", "accumulate", "apply_accumulated",
           "relative_param_diff", "run_bounded", "run_pipeline", "run_strict", "run_sync",
           "weighted_grad", "ExperienceStore", "Row", "SampleId", "AgentStateSwapper", "swap_in",
           "swap_out", "AgentSpec", "Edge", "VerifyAdditionTask", "Workflow",
           "solver_verifier_workflow", "LOCKSTEP", "ModeTimings", "fastest_lockstep", "run_modes",
           "speedup_summary", "time_modes", "FlexMARLParts", "FlexMARLState", "FlexMARLSystem", "agent_keys",
           "resolve_meshes", "paper_checks", "plot_scale", "scale_summary"]
