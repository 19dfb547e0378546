"""Entry of the `bench_policy_loss` experiment (config: configs/bench_policy_loss.py).

The SIS loss step's overhead against correction="none" (alternated timings on a synthetic
rollout), XLA's compiled bytes of the fused vs the naive (logit-materialising) step, and one
GRPO iteration with and without the separate pi_old forward: the arms are
:mod:`jaxflow.rl.policy_loss_bench`.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxflow.experiment import RunContext
from jaxflow.rl.policy_loss_bench import grpo_iteration, loss_step_timing, memory_figures


def main(config, run: RunContext) -> dict[str, Any]:
    key = jax.random.key(config.seed)
    summary, data = loss_step_timing(config, run, key)
    if config.measure_memory:
        summary.update(memory_figures(config, data, key))
    run.info(f"sis/none median {summary['sis_overhead_ratio']:.4f} "
             f"[{summary['sis_overhead_ratio_min']:.4f}, {summary['sis_overhead_ratio_max']:.4f}]")
    if config.grpo_iteration:
        summary["grpo_iteration"] = grpo_iteration(config, run)
    return summary
