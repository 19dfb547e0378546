"""The ``sis_offpolicy`` experiment (and ``sis_study``): a grid of GRPO runs under off-policy
knobs, +/- SIS.

See ``configs/sis_offpolicy.py`` for the grid. Each cell (:mod:`jaxflow.rl.offpolicy_cells`) is
an independent RL run from the same warm start; its curve (held-out greedy accuracy vs rollout)
goes to ``metrics.jsonl`` (rows carry ``cell``; the x axis is a global step
``cell_index * rollouts + rollout``) and to ``cells.jsonl`` when the cell finishes.
``plots/sis_offpolicy_*.png`` overlay the curves; ``results.md`` holds the tables
(:mod:`jaxflow.rl.offpolicy_report`).

Resume (``--resume``): finished cells (``cells.jsonl``) are skipped; the running cell continues
from its latest checkpoint (``checkpoints/<cell>/``) bit-exactly (:mod:`jaxflow.study.cells`).
Each cell trains through :func:`jaxflow.train.loop.run_steps`, so ``--kill-after-checkpoint=N``
(the resume tests' crash) counts the global step above.
"""

from __future__ import annotations

import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.rl.offpolicy_cells import grid_cells, pass_at_1_definition, run_cell, warm_policy, warm_start_accuracy
from jaxflow.rl.offpolicy_report import aggregate, format_paired_table, format_table, paired_differences, plot_curves
from jaxflow.rl.warm_start import cache_dir
from jaxflow.study import finished_cells, run_cells, warm_start_report, write_results


def _describe(record: dict) -> str:
    return (f"{record['label']}: accuracy {record['final_accuracy']:.3f}, greedy "
            f"{record['final_greedy_accuracy']:.3f} (first-rollout reward "
            f"{record['reward_first']:.3f}), accept {record['accept_rate']:.3f}")


def main(config, run: RunContext) -> dict:
    meshes, roles = trainer_rollout_meshes(config.roles)
    run.info(f"roles: {roles}")
    config, warm_params, pre_summary = warm_policy(config, meshes, log=run.info)
    cells = grid_cells(config.grid)
    done = finished_cells(run)
    run.set_total_steps(len(cells) * config.train.rollouts, "sis_offpolicy")
    initial = warm_start_accuracy(config, meshes, warm_params)
    run.info(f"warm start held-out accuracy: sampled {initial[0]:.3f}, greedy {initial[1]:.3f}")

    def run_one(cell, index):
        return run_cell(cell, index, config, run, meshes=meshes, warm_params=warm_params,
                        initial_accuracy=initial)

    records = run_cells(cells, run_one, run=run, done=done, describe=_describe).records
    rows = aggregate(records)
    paired = paired_differences(records)
    write_results(run, rows, [format_table(rows), format_paired_table(paired)])
    plot_curves(run, records)
    rewards = [r["reward_first"] for r in records if r.get("reward_first") is not None]
    cache = cache_dir(config.pretrain, config.cache_root).name
    return {
        "results": rows,
        "paired": paired,
        "pass_at_1": pass_at_1_definition(config),
        "cells_run": [r["label"] for r in records],
        "roles": roles,
        "warm_start": warm_start_report(
            cache, pre_summary, heldout_accuracy=initial[0], heldout_greedy_accuracy=initial[1],
            first_rollout_reward_mean=float(np.mean(rewards)) if rewards else None),
        "params_checksums": {r["label"]: r["params_checksum"] for r in records},
    }
