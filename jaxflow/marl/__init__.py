"""FlexMARL-style multi-agent RL: workflow as data, experience store, micro-batch pipeline,
request-level load balancing (see each module's doc)."""

from jaxflow.marl.balance import (busy_fraction, longest_first, makespan, round_robin,
                                  work_stealing_makespan)
from jaxflow.marl.pipeline import (AgentRuntime, RunResult, apply_accumulated, relative_param_diff,
                                   run_strict,
                                   run_sync, weighted_grad)
from jaxflow.marl.store import ExperienceStore, Row, SampleId
from jaxflow.marl.workflow import (AgentSpec, Edge, VerifyAdditionTask, Workflow,
                                   solver_verifier_workflow)
