"""Speed of the pipelines beside ``sync`` (``jaxflow.timing``), their stage times, the ideal
bound, and clustering's transfer reduction: the figures of the ``nestpipe`` experiment's
summary.

Timing: ``pairs`` rounds, each running every pipeline once for ``timing_steps`` steps from the
same state in a seeded random order, after a warm-up; per pipeline the median of the paired
ratios sync / pipeline; repeated ``runs`` times (each with its own warm-up and ``auto`` probe:
``probe_rounds`` rounds of ``probe_steps`` steps of each exact pipeline picks the fastest,
whose figures in the same rounds are auto's; the rounds also time sync a second time,
``sync_repeat``). Per-stage times: mean seconds per step of data, h2d, route, retrieve,
exchange, compute, write_back, patch, medians over rounds. Ideal bound: the sum of sync's five
stage times (stage 5 = exchange + compute + write_back) / the slowest. Clustering: rows moved
by per-device, per-micro-batch dedup with the pipeline's own ``cluster_order``, clustered vs
not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxflow.nestpipe.clustering import CLUSTER_METHODS, shard_micro_batch_transfers
from jaxflow.nestpipe.pipelines import PIPELINES, STAGES
from jaxflow.nestpipe.stages import cluster_order
from jaxflow.nestpipe.system import NestPipeState, NestPipeSystem
from jaxflow.timing import auto_summary as summarize_auto
from jaxflow.timing import median_of_runs, repeated_runs

__all__ = ["AUTO_CANDIDATES", "WINDOWED", "clustering_figures", "time_pipelines",
           "timing_figures"]

#: the pipelines ``auto`` chooses from: the exact ones (semi_sync is one step stale)
AUTO_CANDIDATES = ("sync", "sparse_dist", "dbp", "fwp", "dbp+fwp", "sync_accum")
#: the pipelines with a window of ``micro_batches`` (per-step error checked against sync)
WINDOWED = tuple(p for p, (_, window) in PIPELINES.items() if window)


def time_pipelines(config, pipelines: Sequence[str], state: NestPipeState,
                   log: Callable[[str], object] = print) -> tuple[list[dict], list[dict], dict]:
    """The timing rounds of ``pipelines`` (``sync`` among them) from ``state`` with the
    config's ``runs``, ``pairs``, ``timing_steps``, ``warmup``, ``auto``, ``probe_*`` and
    ``seed``. Returns (``repeated_runs``' per-run results, its auto choices, ``{pipeline:
    [run_pipeline stats of every kept timing call]}``)."""
    timing = {p: [] for p in pipelines}
    systems = {p: NestPipeSystem(p) for p in pipelines}

    def timed(p, steps, keep=True):
        def call():
            s = systems[p].train(state, steps)[1]
            if keep:
                timing[p].append(s)
            return s["step_seconds"]  # excludes copying the tables
        return call

    def warm():
        for p in pipelines:
            systems[p].train(state, config.warmup)  # compile + warm caches

    def log_run(r, result, auto):
        log(f"timing run {r}: " + ", ".join(f"{m} {x:.3f}" for m, x in result["speedup"].items())
            + (f" (auto -> {auto['mode']})" if auto else ""))

    candidates = [p for p in AUTO_CANDIDATES if p in pipelines]
    runs, autos = repeated_runs(timed, pipelines, runs=config.runs, steps=config.timing_steps,
                                rounds=config.pairs, baseline="sync", seed=config.seed, warm=warm,
                                candidates=candidates if config.auto else (),
                                probe_steps=config.probe_steps, probe_rounds=config.probe_rounds,
                                log=log_run)
    return runs, autos, timing


def _median(xs) -> float:
    return float(np.median(xs))


def timing_figures(config, pipelines: Sequence[str], runs: list[dict], autos: list[dict],
                   timing: dict, n_devices: int) -> dict:
    """The summary's timing keys from :func:`time_pipelines`' results: ``speedup_vs_sync``
    (median over runs of each run's paired median), ``speedup_runs``, ``speedup_spread``,
    ``speedup_pairs``, ``timing_order``, ``runs``, ``pairs``, auto's keys
    (``timing.auto_summary``), ``ideal_speedup``, ``step_seconds``, ``exposed_host_seconds``,
    ``stage_seconds``, ``sync_step_vs_sum_of_stages``, ``patched_rows_per_step``,
    ``owner_rows_per_step`` ([n_devices] per pipeline)."""
    per_run = median_of_runs([t["speedup"] for t in runs])
    all_pairs = {m: [x for t in runs for x in t["ratios"][m]] for m in per_run}
    stage = {p: {k: _median([s["stage_seconds"].get(k, 0.0) for s in timing[p]])
                 for k in STAGES + ("patch",)} for p in pipelines}
    sync_stages = [stage["sync"][k] for k in STAGES]
    # the five stages; stage 5 = row All2All back + compute (+ grad All2All) + write back
    five = sync_stages[:4] + [sum(sync_stages[4:])]
    ideal = sum(five) / max(five)
    candidates = [p for p in AUTO_CANDIDATES if p in pipelines]
    return {
        # median over runs of each run's paired median; every run's figure and every pair kept
        "speedup_vs_sync": {p: per_run[p]["median"] for p in pipelines},
        "speedup_runs": {p: per_run[p]["runs"] for p in pipelines},
        "speedup_spread": {p: [min(all_pairs[p]), max(all_pairs[p])] for p in pipelines
                           if p != "sync"},
        "speedup_pairs": {m: [t["ratios"][m] for t in runs] for m in per_run if m != "sync"},
        "timing_order": [t["order"] for t in runs],
        "runs": config.runs, "pairs": config.pairs,
        **(summarize_auto(per_run, autos, candidates) if autos else {}),
        "ideal_speedup": {p: (1.0 if p == "sync" else ideal) for p in pipelines},
        "step_seconds": {p: _median([s["step_seconds"] for s in timing[p]]) for p in pipelines},
        "exposed_host_seconds": {p: _median([s["exposed_seconds"] for s in timing[p]])
                                 for p in pipelines},
        "stage_seconds": stage,
        "sync_step_vs_sum_of_stages": _median([s["step_seconds"] for s in timing["sync"]])
        / sum(sync_stages),
        "patched_rows_per_step": {p: _median([s["patched_rows"] for s in timing[p]])
                                  for p in pipelines},
        "owner_rows_per_step": {p: [_median([s["owner_rows"][q] for s in timing[p]])
                                    for q in range(n_devices)] for p in pipelines},
    }


def clustering_figures(config, gen, n_devices: int) -> dict:
    """Rows moved by per-device, per-micro-batch dedup over the first min(steps, 20) batches,
    each device's shard reordered by ``cluster_order`` (every method of ``CLUSTER_METHODS``)
    or not: ``duplicate_transfer_reduction`` (the config's method), ``..._by_method``,
    ``micro_batch_rows_moved``."""
    plain, clustered = 0, {m: 0 for m in CLUSTER_METHODS}
    for t in range(min(config.steps, 20)):
        sp = gen.batch(t, config.batch_size)["sparse"]
        plain += shard_micro_batch_transfers(sp, n_devices, config.micro_batches)
        for m in CLUSTER_METHODS:
            order = cluster_order(sp, n_devices, config.micro_batches, m)
            clustered[m] += shard_micro_batch_transfers(sp, n_devices, config.micro_batches, order)
    return {"duplicate_transfer_reduction": 1.0 - clustered[config.cluster_method] / plain,
            "duplicate_transfer_reduction_by_method": {m: 1.0 - c / plain
                                                       for m, c in clustered.items()},
            "micro_batch_rows_moved": {"unclustered": plain, **clustered}}
