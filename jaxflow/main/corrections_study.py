"""The ``corrections_study`` experiment: every off-policy correction ranked in each degraded regime.

See ``configs/corrections_study.py``. Cells (:func:`jaxflow.rl.corrections_study.study_cells`)
run through :func:`jaxflow.rl.offpolicy_cells.run_cell` and resume as ``sis_regime``'s do
(finished cells in ``cells.jsonl``, the running one from its checkpoint; ``reuse`` adds other
run directories' cells). The MoE cells run the MoE warm start (``moe_pretrain``), loaded when
the first one runs. Each correction's loss-step overhead is measured once per run directory,
after the cells (:func:`jaxflow.rl.correction_overhead.cached_overheads`; ``report_only`` too).
Outputs: ``results.md`` (:func:`jaxflow.rl.corrections_study_report.study_report`: the cells
done against the plan, ranking per regime, the regimes against lag 1, R3 with the router
disagreement), ``summary.json``. ``python -m jaxflow.rl.corrections_study_report RUN_DIR``
prints the same tables from a run directory at any time, running nothing.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax

from configs.bench_policy_loss import get_config as bench_config
from jaxflow.experiment import RunContext
from jaxflow.mesh import RolesConfig, trainer_rollout_meshes
from jaxflow.rl.correction_overhead import cached_overheads, loss_step_overheads, recorded_sis_overhead
from jaxflow.rl.corrections_study import study_cells
from jaxflow.rl.corrections_study_report import study_report
from jaxflow.rl.offpolicy_cells import pass_at_1_definition, run_cell, warm_policy, warm_start_accuracy
from jaxflow.rl.warm_start import cache_dir
from jaxflow.study import finished_cells, read_cells, record_cell, run_cells, warm_start_report, write_results


def _describe(record: dict) -> str:
    extra = ("" if record.get("router_disagreement") is None else
             f", router disagreement {record['router_disagreement']:.4f}")
    return (f"{record['label']}: pass@1 {record['final_accuracy']:.3f}{extra}, "
            f"{record['cell_seconds']:.0f} s")


def _policies(config, meshes, run: RunContext):
    """``policy(moe) -> (config, params, initial accuracy, warm-start report)``, each policy
    loaded (pretrained on first use) when first asked for."""
    loaded = {}

    def policy(moe: bool):
        if moe not in loaded:
            cfg = dataclasses.replace(config, pretrain=config.moe_pretrain) if moe else config
            cfg, params, pre = warm_policy(cfg, meshes, log=run.info, hf=False)
            initial = warm_start_accuracy(cfg, meshes, params)
            size = sum(x.size for x in jax.tree.leaves(params))
            run.info(f"{'MoE' if moe else 'dense'} warm start: {size:,} parameters, held-out pass@1 "
                     f"{initial[0]:.3f}, greedy {initial[1]:.3f}")
            report = warm_start_report(cache_dir(cfg.pretrain, cfg.cache_root).name, pre, parameters=size,
                                       heldout_accuracy=initial[0], heldout_greedy_accuracy=initial[1])
            loaded[moe] = (cfg, params, initial, report)
        return loaded[moe]
    return policy, loaded


def main(config, run: RunContext) -> dict:
    meshes, roles = trainer_rollout_meshes(RolesConfig(colocate=True))
    study = config.study
    cells = study_cells(study)
    own = finished_cells(run)
    reused = {}
    for d in config.reuse:
        reused.update({k: v for k, v in read_cells(d).items() if k not in own})
    for record in reused.values():  # the run directory holds every record it reports
        record_cell(run, record)
    done = reused | own
    todo = [c for c in cells if c.label not in done]
    run.info(f"{len(cells)} cells, {len(cells) - len(todo)} done ({len(reused)} reused), {len(todo)} to run")
    run.set_total_steps(len(cells) * config.train.rollouts, "corrections_study")

    policy, loaded = _policies(config, meshes, run)

    def run_one(cell, index):
        cfg, params, initial, _ = policy(bool(cell.moe))
        return run_cell(cell, index, cfg, run, meshes=meshes, warm_params=params, initial_accuracy=initial)

    result = run_cells(cells, run_one, run=run, done=done, indices=itertools.count(len(done)),
                       report_only=config.report_only, describe=_describe)
    records = list({r["label"]: r for r in result.records}.values())
    # after the cells: on a loaded machine the cells get the CPU first (measured once per run directory)
    bench = dataclasses.replace(bench_config("quick"), algo=study.algos[0])
    overheads = cached_overheads(run, lambda: loss_step_overheads(
        bench, study.corrections, key=jax.random.key(config.seed), pairs=study.overhead_pairs, log=run.info))
    results, sections = study_report(study, records, overheads, recorded_sis_overhead())
    write_results(run, results, sections)
    return {
        "task": config.task_name, **results, "pass_at_1": pass_at_1_definition(config), "roles": roles,
        "cells_total": len(cells), "cells_done": len(records), "missing": result.missing,
        "warm_starts": {("moe" if moe else "dense"): v[3] for moe, v in loaded.items()},
    }
