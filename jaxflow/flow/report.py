"""FlowTrain's report: the metrics row of one step across the arms and the run's summary
(speedups as medians of per-round time ratios, samples/s, padding waste, cost imbalance, the
allocator's prediction against the measured throughput, estimated MFU, held-out accuracy,
staleness and the embedding pool's counters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxflow.flow.profile import SplitChoice
from jaxflow.flow.system import MODES, run_total_steps


def step_row(results: Mapping[str, Sequence[dict]], step: int) -> dict[str, Any]:
    """The metrics row of ``step``: per arm ``loss_MODE``, ``padding_waste_MODE`` and (packed
    arms) ``cost_imbalance_MODE``; ``staleness`` of the decoupled arm. ``results[mode][step]``
    is the step's result dict (:meth:`jaxflow.flow.system.FlowTrainSystem.step`)."""
    row: dict[str, Any] = {}
    for mode in MODES:
        res = results[mode][step]
        row[f"loss_{mode}"] = float(res["metrics"]["loss"])
        row[f"padding_waste_{mode}"] = res["layout"].padding_waste
        if res["layout"].packing is not None:
            row[f"cost_imbalance_{mode}"] = res["layout"].packing.imbalance
    row["staleness"] = results["decoupled"][step]["staleness"]
    return row


def merge_pool_stats(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One run's pool counters from those of its calls: counts and waits summed, the largest
    occupancy; ``{}`` without calls."""
    if not calls:
        return {}
    out = dict(calls[0])
    for stats in calls[1:]:
        for k, v in stats.items():
            if k == "max_occupancy":
                out[k] = max(out[k], v)
            elif k != "capacity":
                out[k] = out[k] + v
    return out


def summarize_run(config, *, times: Mapping[str, Sequence[float]],
                  results: Mapping[str, Sequence[dict]], flops: float, peak: float,
                  accuracy: Mapping[str, float], choice: SplitChoice, colocated: bool,
                  timers: Mapping[str, float], pool: Mapping[str, Any],
                  params: tuple[int, int], backend: str) -> dict[str, Any]:
    """The flowtrain summary. ``times[mode]``: seconds of each timed round; ``results[mode]``:
    every step's result; ``flops``: model FLOPs of one step (no padding); ``peak``: measured
    flop/s; ``accuracy``: held-out accuracy per arm; ``params``: (encoder, backbone) counts."""
    tc = config.train
    per_sample = tc.block_steps * tc.batch_size
    t = {m: np.asarray(times[m]) for m in MODES}
    ratios = {m: t["monolithic_padded"] / t[m] for m in MODES}
    samples_per_s = {m: per_sample / float(np.median(t[m])) for m in MODES}

    def mean_of(mode, fn):
        return float(np.mean([fn(res) for res in results[mode]]))

    waste = {m: mean_of(m, lambda r: r["layout"].padding_waste) for m in MODES}
    imbalance = {m: mean_of(m, lambda r: r["layout"].packing.imbalance) for m in MODES[1:]}
    stale = [r["staleness"] for r in results["decoupled"]]
    alloc = choice.allocation
    return {
        "speedup_vs_monolithic_padded": {m: float(np.median(ratios[m])) for m in MODES},
        "speedup_spread": {m: [float(ratios[m].min()), float(ratios[m].max())] for m in MODES},
        "samples_per_s": samples_per_s,
        "round_seconds": {m: [float(x) for x in t[m]] for m in MODES},  # each timed round, every arm
        "cost_imbalance": imbalance["decoupled"],
        "cost_imbalance_by_mode": imbalance,
        "padding_waste": waste["decoupled"],
        "padding_waste_by_mode": waste,
        "allocator": {
            "encoder_devices": alloc.encoder.devices,
            "backbone_devices": alloc.backbone.devices,
            "backbone_model_degree": alloc.backbone.model,
            "colocated": colocated,
            "predicted_samples_per_s": alloc.predicted_samples_per_s,
            "predicted_serial_samples_per_s": alloc.predicted_serial_samples_per_s,
            "measured_samples_per_s": samples_per_s["decoupled"],
            "profile": choice.profile,
        },
        "estimated_mfu": {m: flops / tc.batch_size * samples_per_s[m] / peak for m in MODES},
        "peak_flops_measured": peak,
        "model_flops_per_step": flops,
        "final_loss": {m: float(np.mean([float(r["metrics"]["loss"])
                                         for r in results[m][-max(1, len(results[m]) // 5):]]))
                       for m in MODES},
        "heldout_accuracy": dict(accuracy),
        "staleness": {"run_ahead": config.flow.run_ahead, "mean": float(np.mean(stale)),
                      "max": int(max(stale))},
        "decoupled_timers_s": dict(timers),
        "pool": dict(pool),
        "steps": run_total_steps(config),
        "batch_size": tc.batch_size,
        "encoder_params": params[0],
        "backbone_params": params[1],
        "attention_backend": backend,
    }
