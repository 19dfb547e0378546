"""The ``sis_regime`` experiment: map where uncorrected RL degrades, then compare corrections there.

See ``configs/sis_regime.py``. Cells are :class:`jaxflow.rl.offpolicy_cells.Cell` runs through
:func:`jaxflow.rl.offpolicy_cells.run_cell` (same resume: finished cells in ``cells.jsonl``,
the running cell from its checkpoint; :mod:`jaxflow.study.cells`). Phase 1 runs the knob sweep
without correction; :func:`jaxflow.rl.sis_regime.regime_rows` compares each setting with the
lag-1 run seed by seed; ``choose_settings`` picks the phase-2 settings from that map; phase 2
runs every correction there. Outputs: ``results.md`` (regime table, comparison table,
overheads; :mod:`jaxflow.rl.sis_regime_report`), ``summary.json`` and
``plots/sis_regime_map.png``.
"""

from __future__ import annotations

import itertools

from jaxflow.experiment import RunContext
from jaxflow.mesh import RolesConfig, trainer_rollout_meshes
from jaxflow.rl.offpolicy_cells import pass_at_1_definition, run_cell, warm_policy, warm_start_accuracy
from jaxflow.rl.offpolicy_report import aggregate, paired_differences
from jaxflow.rl.sis_regime import (
    choose_settings,
    control_degradation,
    overheads,
    phase1_cells,
    phase2_cells,
    regime_rows,
)
from jaxflow.rl.sis_regime_report import (
    format_compare,
    format_degradation,
    format_overheads,
    format_regime_table,
    plot_regime_map,
)
from jaxflow.rl.warm_start import cache_dir
from jaxflow.study import finished_cells, read_cells, record_cell, run_cells, warm_start_report, write_results


def _describe(record: dict) -> str:
    return (f"{record['label']}: pass@1 {record['final_accuracy']:.3f}, clip "
            f"{record['clip_fraction']:.4f}, SIS accept (expected) "
            f"{record['sis_accept_expected'] or float('nan'):.3f}, {record['cell_seconds']:.0f} s")


def _reused(config, run: RunContext) -> dict[str, dict]:
    """Finished cells of the run directories in ``config.reuse`` (by label)."""
    out: dict[str, dict] = {}
    for d in config.reuse:
        out.update(read_cells(d))
    if out:
        run.info(f"reusing {len(out)} finished cells from {', '.join(config.reuse)}")
    return out


def main(config, run: RunContext) -> dict:
    meshes, roles = trainer_rollout_meshes(RolesConfig(colocate=True))
    config, warm_params, pre_summary = warm_policy(config, meshes, log=run.info, hf=False)
    own = finished_cells(run)
    reused = {k: v for k, v in _reused(config, run).items() if k not in own}
    for record in reused.values():  # the run directory holds every record it reports
        record_cell(run, record)
    done = reused | own
    first = phase1_cells(config)
    grid = config.grid
    estimate = len(first) + 2 * len(grid.compare_algos) * len(grid.compare_corrections) * (
        grid.compare_seeds)
    run.set_total_steps(estimate * config.train.rollouts, "sis_regime")
    initial = warm_start_accuracy(config, meshes, warm_params)
    run.info(f"warm start held-out pass@1 {initial[0]:.3f}, greedy {initial[1]:.3f}")

    def run_one(cell, index):
        return run_cell(cell, index, config, run, meshes=meshes, warm_params=warm_params,
                        initial_accuracy=initial)

    # a cell's global step is its position in the run (resumed cells keep theirs via labels)
    kw = dict(run=run, done=done, indices=itertools.count(len(done)),
              report_only=config.report_only, describe=_describe)
    phase1 = run_cells(first, run_one, **kw)
    regime = regime_rows(config, {r["label"]: r for r in phase1.records})
    baseline = regime[0]["final_mean"] if regime else None
    chosen = choose_settings(config, regime)
    run.info("regime map:\n" + format_regime_table(regime, baseline))
    run.info(f"phase 2 settings: {chosen}")
    phase2 = run_cells(phase2_cells(config, chosen), run_one, **kw)
    missing = phase1.missing + phase2.missing
    if missing:
        run.info(f"report_only: {len(missing)} cells not run (summary['missing'])")
    compared = list({r["label"]: r for r in phase2.records}.values())
    paired = paired_differences(compared)
    rows = aggregate(compared)
    times = overheads(compared)
    degraded = control_degradation(compared)
    write_results(run, {"regime": regime, "chosen": chosen, "compare": rows, "paired": paired,
                        "control_degradation": degraded, "overheads": times},
                  [format_regime_table(regime, baseline), format_degradation(degraded),
                   format_compare(rows, paired), format_overheads(times)])
    if run.is_primary:
        plot_regime_map(run.out_dir / "plots", regime, compared, chosen)
    cache = cache_dir(config.pretrain, config.cache_root).name
    return {
        "task": config.task_name,
        "regime": regime, "chosen": chosen, "compare": rows, "paired": paired,
        "control_degradation": degraded, "overheads": times,
        "pass_at_1": pass_at_1_definition(config),
        "roles": roles, "cells_run": len(done), "missing": missing,
        "warm_start": warm_start_report(cache, pre_summary, heldout_accuracy=initial[0],
                                        heldout_greedy_accuracy=initial[1]),
    }
