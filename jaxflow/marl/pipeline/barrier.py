"""The synchronous barrier baseline (MARTI-style lockstep): roll out every agent on every
input, then one full-batch GRPO step per agent, agents one after another.

Not to be confused with weight sync (:mod:`jaxflow.sync`): this module is the pipeline's
lockstep reference, which the strict pipeline equals on the same samples.
"""

from __future__ import annotations

import time
from typing import Mapping

import jax
import numpy as np

from jaxflow.marl.pipeline.accumulate import group_rows, stack_rows
from jaxflow.marl.pipeline.plan import RunResult, engine_snapshot, engine_stats_since
from jaxflow.marl.pipeline.runtime import AgentRuntime, chunks, input_prompts, loss_key, rollout_inputs, split_batch
from jaxflow.marl.processes import host_tree
from jaxflow.marl.workflow import Workflow
from jaxflow.train.state import TrainState


def run_sync(workflow: Workflow, runtimes: Mapping[str, AgentRuntime],
             policies: dict[str, TrainState], *, steps: int, n_inputs: int, seed: int,
             rollout_batch: int = 1, block_stages: bool = True) -> RunResult:
    """Barrier baseline: roll out all inputs for every agent (``rollout_batch`` inputs per
    engine call), then one full-batch step per agent, agents one after another.

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
        published = {n: runtimes[n].publish(policies[n]) for n in names}
        rows: dict[str, list] = {n: [] for n in names}
        prompts = input_prompts(workflow, seed, v, n_inputs)
        for chunk in chunks(list(range(n_inputs)), rollout_batch):
            out = rollout_inputs(workflow, runtimes, published, [prompts[i] for i in chunk],
                                 seed=seed, version=v,
                                 input_ids=[v * n_inputs + i for i in chunk])
            for n in names:
                g = runtimes[n].spec.group_size
                for part in split_batch(out[n], g):
                    rows[n] += group_rows(part, g)
        busy["rollout"] += time.perf_counter() - t0
        for a, n in enumerate(names):
            t0 = time.perf_counter()
            rt = runtimes[n]
            mb = rt.place(stack_rows(rows[n]))
            old = rt.old_stats(policies[n].params, None, mb)
            policies[n], _ = rt.update(policies[n], mb, old, key=loss_key(seed, v, a))
            if block_stages:
                jax.block_until_ready(policies[n].params)
            busy[f"train/{n}"] += time.perf_counter() - t0
        out_params.append({n: host_tree(policies[n].params) for n in names})
        out_rewards.append({n: float(np.mean([r["reward"] for r in rows[n]])) for n in names})
    wall = time.perf_counter() - start
    samples = steps * n_inputs * sum(runtimes[n].spec.group_size for n in names)
    return RunResult(out_params, out_rewards, busy, wall, samples,
                     staleness={"max": 0.0, "mean": 0.0},
                     engine=engine_stats_since(runtimes, stats0), workers={"all": 1})
