"""The synchronous barrier baseline (MARTI-style lockstep): roll out every agent on every
input, then one full-batch GRPO step per agent, agents one after another.

:func:`lockstep_step` is one version of it, a function of (policies, prompts, keys);
:func:`run_sync` runs ``steps`` of them and reports what the pipeline's runs report.

Not to be confused with weight sync (:mod:`jaxflow.sync`): this module is the pipeline's
lockstep reference, which the strict pipeline equals on the same samples.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import jax
import numpy as np

from jaxflow.marl.pipeline.accumulate import group_rows, stack_rows
from jaxflow.marl.pipeline.plan import RunResult, engine_snapshot, engine_stats_since
from jaxflow.marl.pipeline.runtime import (
    AgentRuntime,
    chunks,
    input_prompts,
    rollout_inputs,
    split_batch,
    version_keys,
)
from jaxflow.marl.processes import host_tree
from jaxflow.marl.workflow import Workflow
from jaxflow.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class LockstepStep:
    """What one lockstep version gives: each agent's stepped train state (``policies``), its
    reward mean over the version's rows (``rewards``) and the seconds each role spent
    (``busy_s``: ``rollout`` and ``train/AGENT``)."""

    policies: dict[str, TrainState]
    rewards: dict[str, float]
    busy_s: dict[str, float]


def lockstep_step(workflow: Workflow, runtimes: Mapping[str, AgentRuntime],
                  policies: Mapping[str, TrainState], prompts: Sequence[str], *, key: jax.Array,
                  version: int, rollout_batch: int = 1, block_stages: bool = True
                  ) -> LockstepStep:
    """One version of the barrier: publish every agent's weights, roll out every agent on
    ``prompts`` (the version's turn-0 inputs, ``rollout_batch`` per engine call; input i's id
    is ``version * len(prompts) + i``), then one full-batch GRPO step per agent in turn order.

    ``key``: :func:`~jaxflow.marl.pipeline.runtime.version_keys` [2] (samples, losses; agent
    a's loss key is ``fold_in(key[1], a)``). ``policies`` are donated to the updates (pass
    copies to keep them); ``policies`` itself is not modified. ``block_stages``: see
    :func:`run_sync`."""
    names = workflow.order()
    n_inputs = len(prompts)
    busy = {"rollout": 0.0} | {f"train/{n}": 0.0 for n in names}
    t0 = time.perf_counter()
    published = {n: runtimes[n].publish(policies[n]) for n in names}
    rows: dict[str, list] = {n: [] for n in names}
    for chunk in chunks(list(range(n_inputs)), rollout_batch):
        out = rollout_inputs(workflow, runtimes, published, [prompts[i] for i in chunk],
                             key=key[0], input_ids=[version * n_inputs + i for i in chunk])
        for n in names:
            g = runtimes[n].spec.group_size
            for part in split_batch(out[n], g):
                rows[n] += group_rows(part, g)
    busy["rollout"] += time.perf_counter() - t0
    stepped = dict(policies)
    for a, n in enumerate(names):
        t0 = time.perf_counter()
        rt = runtimes[n]
        mb = rt.place(stack_rows(rows[n]))
        old = rt.old_stats(stepped[n].params, None, mb)
        stepped[n], _ = rt.update(stepped[n], mb, old, key=jax.random.fold_in(key[1], a))
        if block_stages:
            jax.block_until_ready(stepped[n].params)
        busy[f"train/{n}"] += time.perf_counter() - t0
    rewards = {n: float(np.mean([r["reward"] for r in rows[n]])) for n in names}
    return LockstepStep(stepped, rewards, busy)


def run_sync(workflow: Workflow, runtimes: Mapping[str, AgentRuntime],
             policies: dict[str, TrainState], *, steps: int, n_inputs: int, seed: int,
             rollout_batch: int = 1, block_stages: bool = True) -> RunResult:
    """Barrier baseline: ``steps`` :func:`lockstep_step` calls (version v: the prompts of
    :func:`~jaxflow.marl.pipeline.runtime.input_prompts` and the keys of
    :func:`~jaxflow.marl.pipeline.runtime.version_keys` of ``(seed, v)``).

    ``block_stages``: wait for each agent's step before the next agent's (MARTI-style: a
    worker group's step returns when done), so ``busy_s`` holds each role's device seconds
    (the FlexMARL simulator's calibration reads them). False: the steps are only dispatched
    and the host copy of the params at the end of the version is the one wait, so a training
    role's busy seconds are host seconds; the same result, bit for bit, and on one device
    usually the faster lockstep (the ``flexmarl`` experiment times both and takes the faster
    as the baseline of every speedup).

    ``policies``: each agent's train state; they are donated, and the dict is updated in place
    with the final states (as :func:`~jaxflow.marl.pipeline.threads.run_pipeline` does)."""
    names = workflow.order()
    busy = {"rollout": 0.0} | {f"train/{n}": 0.0 for n in names}
    stats0 = engine_snapshot(runtimes)
    out_params, out_rewards, start = [], [], time.perf_counter()
    for v in range(steps):
        t0 = time.perf_counter()
        prompts = input_prompts(workflow, seed, v, n_inputs)
        busy["rollout"] += time.perf_counter() - t0
        step = lockstep_step(workflow, runtimes, policies, prompts, key=version_keys(seed, v),
                             version=v, rollout_batch=rollout_batch, block_stages=block_stages)
        policies.update(step.policies)
        for role, seconds in step.busy_s.items():
            busy[role] += seconds
        out_params.append({n: host_tree(policies[n].params) for n in names})
        out_rewards.append(step.rewards)
    wall = time.perf_counter() - start
    samples = steps * n_inputs * sum(runtimes[n].spec.group_size for n in names)
    return RunResult(out_params, out_rewards, busy, wall, samples,
                     staleness={"max": 0.0, "mean": 0.0},
                     engine=engine_stats_since(runtimes, stats0), workers={"all": 1})
