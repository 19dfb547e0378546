"""The ``nestpipe`` experiment: every pipeline of ``config.pipelines`` (a
:class:`jaxflow.nestpipe.NestPipeSystem` each) for K steps from the same host tables and DLRM,
data-parallel on a mesh of the devices present (or the first ``config.devices``), the tables
split row-wise over the same shards (keys routed and rows returned by All2All).

Exactness vs ``sync`` (``jaxflow.nestpipe.exactness``: after K steps, and one step from sync's
state at each of the first ``step_check_steps`` steps for the windowed pipelines), speed, stage
times, the ideal bound and clustering (``jaxflow.nestpipe.benchmark``), AUC / logloss.

Across processes (``--coordinator`` / ``--num-processes``: the mesh spans every process's
devices) every figure but the timings equals the single-process run's with the same global mesh,
bit for bit (``tests/test_multiprocess_nestpipe.py``; how: ``jaxflow.nestpipe.pipelines``).
"""

from __future__ import annotations

from jaxflow import signals
from jaxflow.compile_only.program import Program
from jaxflow.experiment import RunContext, to_jsonable
from jaxflow.nestpipe import NestPipeSystem
from jaxflow.nestpipe.benchmark import WINDOWED, clustering_figures, time_pipelines, timing_figures
from jaxflow.nestpipe.exactness import compare_to_sync, one_step_diffs
from jaxflow.nestpipe.model import capacities, pipeline_order, resolve_meshes
from jaxflow.nestpipe.simulate import write_calibration_from_run


def compile_programs(config, meshes) -> list[Program]:
    """Every device program the run executes, with abstract arguments on ``meshes["data"]``
    (``NestPipeSystem.programs``)."""
    return NestPipeSystem().programs(config, meshes)


def main(config, run: RunContext) -> dict:
    """Runs every pipeline (exactness, timing, clustering); the summary. Nothing is
    checkpointed: a stop signal ends the run between two pipeline steps (``signals.polling``),
    so no compilation is left running when the process exits."""
    with signals.polling():
        return run_experiment(config, run)


def run_experiment(config, run: RunContext) -> dict:
    """:func:`main` without the signal polling (see there)."""
    meshes = resolve_meshes(config)
    n_dev = meshes["data"].devices.size
    state0 = NestPipeSystem().init(config, meshes)
    if capacities(config, n_dev)["capacity"] != config.capacity:
        run.info(f"{n_dev} devices: the capacities measured on {config.capacity_devices} do not "
                 "apply; using the worst-case sizes (cannot overflow)")
    pipelines = pipeline_order(config)
    # 1. exactness and quality: K steps each from the same start
    exact = compare_to_sync(pipelines, state0, config.steps, log=run.info)
    check = min(config.steps, config.step_check_steps)
    step_diff = {p: max(one_step_diffs(p, state0, check)) for p in pipelines if p in WINDOWED}
    # 2. timing (jaxflow.timing): paired rounds in a seeded random order, ``runs`` repetitions
    runs, autos, timing = time_pipelines(config, pipelines, state0, log=run.info)
    figures = timing_figures(config, pipelines, runs, autos, timing, n_dev)
    stages = state0.runtime.stages
    summary = {
        **figures,
        "max_param_diff_vs_sync": exact["diff"],
        "max_leafwise_diff_vs_sync": exact["leafwise"],
        "max_one_step_diff_vs_sync": step_diff,
        "capacities": {(f"micro_batches={k}" + (f", {x}" if k > 1 else "")):
                       {"device": m.capacity, "bucket": m.bucket_capacity, "owner": m.owner_capacity}
                       for (k, x), m in stages.items()},
        "devices": n_dev,
        # each windowed pipeline's All2All schedule (sharded.FROZEN_EXCHANGES): fwp / dbp+fwp
        # the paper's per_micro_batch (unless configured batched), sync_accum window
        "frozen_exchange": {p: state0.runtime.stages_for(p).frozen_exchange for p in pipelines
                            if p in WINDOWED},
        # 3. clustering as the pipeline does it (each device's shard, its own cluster_order)
        **clustering_figures(config, state0.runtime.gen, n_dev),
        **{f"{k}_by_pipeline": {p: exact["results"][p][k] for p in pipelines} for k in
           ("auc", "logloss", "final_train_loss")},
        "steps": config.steps, "micro_batches": config.micro_batches,
    }
    ideal = max(figures["ideal_speedup"].values())
    for p in pipelines:
        run.info(f"{p}: speedup {summary['speedup_vs_sync'][p]:.3f} (ideal {ideal:.2f}), "
                 f"max rel diff {exact['diff'][p]:.2e}, step {summary['step_seconds'][p] * 1e3:.1f} ms")
    if config.calibration_out and run.is_primary:
        summary["calibration_written"] = write_calibration_from_run(
            config.calibration_out, summary | {"config": to_jsonable(config)},
            experiment=run.name, variant=run.variant, devices=n_dev)
        run.info(f"wrote calibration {summary['calibration_written']}")
    return summary
