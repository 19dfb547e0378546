"""Micro-batch pipeline: train on rollouts as they finish, step when version v is complete.

Per agent and version v the trainer consumes micro-batches (``micro_inputs`` inputs' G
trajectories, rows taken from the :class:`~jaxflow.marl.store.ExperienceStore` in input order)
as soon as the rollout engine stores them, accumulates ``grad(loss_mb) * weight_mb`` (weight =
the micro-batch's share of the loss normaliser after the correction's mask: tokens for
``token-mean``, rows with a token for the ``seq-mean-*`` aggs) in one jitted call per
micro-batch, and applies one optimizer step with
``sum(grads) / sum(weights)`` once all of v's rows are consumed (the last micro-batch's
accumulate and the step are one program); then it publishes version v+1.

Modes (:func:`~jaxflow.marl.pipeline.threads.run_pipeline` of a
:class:`~jaxflow.marl.pipeline.plan.PipelineConfig`):

  strict    rollouts of batch v use exactly version v's weights (each agent's start after that
            agent's publish): the synchronous algorithm (:func:`run_sync`, the barrier: roll
            out everything, then one full-batch GRPO step per agent) on the same samples, up to
            the summation order of the gradient. pi_old == the current params throughout v.
  bounded   staleness ``eta``: rollouts of batch v may start as soon as *some* complete version
            w >= v - eta is published and use the newest one; the trainer of step v consumes
            batch v's rows, whose version lag v - w <= eta is checked, and the run reports the
            observed lag (``RunResult.staleness``). pi_old is the trainer's current params, the
            sampler's log-probs are the behaviour policy (GRPOConfig's importance correction).
            ``eta = 0`` is strict.

Micro-batches are consumed in input order, so a run is deterministic whatever order the rollout
workers finish in (strict runs with and without state swapping, or resumed from a checkpoint,
are bit-identical). Samples are a pure function of (seed, batch v, input, turn, row).

Durability: with ``persist_state`` every micro-batch commit also stores the trainer's state
(version, micro-batches done, gradient accumulator, weight sum, params + optimizer state; after
a version's last micro-batch, the stepped state at version v+1 with nothing accumulated)
atomically with the consumed rows, and ``resume=True`` restarts every trainer from it (the
rollouts regenerate only rows that are missing; a downstream agent's prompts come from the
stored upstream rows, so an upstream agent that already stepped is not rerun).

Drivers (``PipelineConfig(driver=)``): ``threads`` runs the rollouts on a thread of their own and
each agent's trainer on a blocking thread; ``inline`` (strict with one rollout worker, the
default there) runs the trainers on the rollout's thread between its engine calls, dispatching
their programs without waiting, so nothing contends for the interpreter lock and the accumulate
/ step programs overlap the rollout's host work. Rollouts go agent-major (an agent's rows of
version v are all stored before the next agent starts), and under strict each agent waits only
for its own version v, so an agent's last micro-batch and step overlap the later agents'
rollouts. Both drivers give bit-identical results.

Modules: ``accumulate`` (pure gradient accumulation and the trainer's committed state),
``plan`` (the run's frozen config and plan, and its result), ``trainer`` (one agent's
micro-batch consumer, shared by both drivers, and its pure transition), ``versions`` (the board of published weights),
``runtime`` (one agent's compiled functions and engine, row keys, rollouts of a batch of
inputs), ``barrier`` (the synchronous barrier baseline; one version of it is a step),
``threads`` (the rollouts, both drivers and :func:`run_pipeline`).
"""

from jaxflow.marl.pipeline.accumulate import (
    PAYLOAD_FIELDS,
    Accumulator,
    accumulate,
    accumulate_apply,
    apply_accumulated,
    flatten_accumulator,
    group_rows,
    relative_param_diff,
    stack_rows,
    unflatten_accumulator,
    weighted_grad,
)
from jaxflow.marl.pipeline.barrier import LockstepStep, lockstep_step, run_sync
from jaxflow.marl.pipeline.plan import DRIVERS, MODES, PipelineConfig, PipelinePlan, RunResult
from jaxflow.marl.pipeline.runtime import (
    AgentRuntime,
    agent_loads,
    group_row_keys,
    input_prompts,
    loss_key,
    request_row_keys,
    rollout_input,
    rollout_inputs,
    sample_key,
    split_batch,
    version_keys,
)
from jaxflow.marl.pipeline.threads import run_bounded, run_pipeline, run_strict
from jaxflow.marl.pipeline.trainer import AgentTrainer, Interrupted, TrainerReport, consume_micro_batch
from jaxflow.marl.pipeline.versions import VersionBoard

__all__ = ["PAYLOAD_FIELDS", "Accumulator", "accumulate", "accumulate_apply", "apply_accumulated",
           "flatten_accumulator", "group_rows", "relative_param_diff", "stack_rows",
           "unflatten_accumulator", "weighted_grad", "LockstepStep", "lockstep_step", "run_sync", "DRIVERS", "MODES",
           "PipelineConfig", "PipelinePlan", "RunResult", "AgentRuntime", "agent_loads", "group_row_keys",
           "input_prompts", "loss_key", "request_row_keys", "rollout_input", "rollout_inputs", "sample_key",
           "split_batch", "version_keys", "run_bounded", "run_pipeline", "run_strict", "AgentTrainer", "Interrupted",
           "TrainerReport", "consume_micro_batch", "VersionBoard"]
