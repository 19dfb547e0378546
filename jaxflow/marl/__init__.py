"""FlexMARL-style multi-agent RL: workflow as data, experience store, micro-batch pipeline
(strict / bounded staleness), rollout engine with hierarchical load balancing, agent state
swapping (see each module's doc). Across processes every mesh spans every process alike and
``jaxflow.marl.processes`` keeps the processes in step."""

from jaxflow.marl.balance import (
    allocate_workers,
    assign,
    busy_fraction,
    longest_first,
    makespan,
    round_robin,
    work_stealing_makespan,
)
from jaxflow.marl.engine import EngineStats, RolloutEngine, row_keys
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
from jaxflow.marl.store import ExperienceStore, Row, SampleId
from jaxflow.marl.swap import AgentStateSwapper, swap_in, swap_out
from jaxflow.marl.workflow import AgentSpec, Edge, VerifyAdditionTask, Workflow, solver_verifier_workflow

__all__ = ["allocate_workers", "assign", "busy_fraction", "longest_first", "makespan", "round_robin",
           "work_stealing_makespan", "EngineStats", "RolloutEngine", "row_keys", "AgentRuntime",
           "Interrupted", "PipelineConfig", "RunResult", "accumulate", "apply_accumulated",
           "relative_param_diff", "run_bounded", "run_pipeline", "run_strict", "run_sync",
           "weighted_grad", "ExperienceStore", "Row", "SampleId", "AgentStateSwapper", "swap_in",
           "swap_out", "AgentSpec", "Edge", "VerifyAdditionTask", "Workflow",
           "solver_verifier_workflow"]
