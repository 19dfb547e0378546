"""The ``flowtrain`` experiment: monolithic_padded vs monolithic_packed vs decoupled.

1. Allocator: profile encoder and backbone throughput on each candidate split of the devices,
   pick the throughput-matching one (:func:`jaxflow.flow.profile.choose_split`).
2. Train the three arms of :class:`jaxflow.flow.system.FlowTrainSystem` from the same initial
   parameters on the same samples, side by side: after ``warmup_rounds`` untimed rounds
   (compilation), each timed round runs every arm for ``block_steps`` steps (the order rotates
   per round); speedups are medians of per-round time ratios.
3. Held-out accuracy (``FlowTrainSystem.evaluate``): teacher-forced exact match of the answer
   on samples built only from held-out digit images.

``compile_programs`` (``--compile-only``) is ``FlowTrainSystem.programs``.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflow.compile_only.program import Program
from jaxflow.distributed import connect_collectives
from jaxflow.experiment import RunContext
from jaxflow.flow.meshes import resolve_meshes  # noqa: F401 (the driver's MeshResolver hook)
from jaxflow.flow.profile import choose_split, measured_peak_flops
from jaxflow.flow.programs import step_flops
from jaxflow.flow.report import merge_pool_stats, step_row, summarize_run
from jaxflow.flow.system import MODES, FlowTrainSystem, host_copy, run_samples, run_total_steps
from jaxflow.flow.vlm import resolve_backend
from jaxflow.mesh import experiment_devices
from jaxflow.models.transformer import param_count
from jaxflow.train.loop import last_row, run_steps


def _persistent_compile_cache(run: RunContext) -> None:
    """Compiled programs are cached under runs/.jax_cache: a rerun (quick, then default)
    skips most of the compilation that dominates short runs on a loaded 2-core CPU."""
    path = run.out_dir.parent.parent / ".jax_cache"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(config, run: RunContext) -> dict[str, Any]:
    _persistent_compile_cache(run)
    tc = config.train
    devices = experiment_devices(config.devices)
    backend = resolve_backend(config.flow.attention)
    total_steps = run_total_steps(config)
    steps = run_samples(config)
    full = config.mesh.make(devices)
    connect_collectives(full)  # across processes: before any long compile (see its doc)
    meshes: dict[str, Mesh] = {"monolithic": full}
    first = FlowTrainSystem("monolithic_padded").init(config, meshes, jax.random.key(config.seed))
    enc_host, bb_host = host_copy(first.enc), host_copy(first.bb)
    n_enc, n_bb = param_count(enc_host.params), param_count(bb_host.params)
    run.info(f"encoder {n_enc:,} params, backbone {n_bb:,}; {len(devices)} devices; attention "
             f"{backend.value}")

    # 1. Allocator.
    choice = choose_split(config, devices, enc_host, bb_host, steps[0][1], backend, run.info)
    alloc = choice.allocation
    run.info(f"allocator: encoder {alloc.encoder}, backbone {alloc.backbone}, predicted "
             f"{alloc.predicted_samples_per_s:.1f} samples/s (pipelined), "
             f"{alloc.predicted_serial_samples_per_s:.1f} (serial)")
    meshes.update(choice.meshes)

    # 2. Side-by-side training: one run_steps step is one round of every arm.
    systems = {m: FlowTrainSystem(m, choice.split if m == "decoupled" else None) for m in MODES}
    states = {m: systems[m].start(config, meshes, enc_host, bb_host) for m in MODES}
    for mode, system in systems.items():
        t0 = time.perf_counter()
        n_shapes = system.warm(states[mode], steps)
        run.info(f"{mode}: compiled {n_shapes} shape bucket(s) in {time.perf_counter() - t0:.0f}s")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    pool_calls, timers = [], {}
    run.set_total_steps(total_steps, "flowtrain")

    def round_fn(states, r):
        block = steps[r * tc.block_steps:(r + 1) * tc.block_steps]
        states = dict(states)
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            t0 = time.perf_counter()
            states[mode], out = systems[mode].step(states[mode], block)
            jax.block_until_ready(out["results"][-1]["metrics"]["loss"])
            if r >= tc.warmup_rounds:
                times[mode].append(time.perf_counter() - t0)
            results[mode] += out["results"]
            if mode == "decoupled":
                pool_calls.append(out["pool"])
                for k, v in out["timers"].items():
                    timers[k] = timers.get(k, 0.0) + v
        for step, _ in block:
            run.log(step + 1, step_row(results, step))
        return states, {}

    states = run_steps(round_fn, states, steps=tc.warmup_rounds + tc.rounds,
                       summarize=last_row).state

    # 3. Summary.
    timed = [s for k, s in steps[tc.warmup_rounds * tc.block_steps:]]
    flops = float(np.mean([sum(step_flops(first.eval_sides, s)) for s in timed]))  # no padding
    peak = measured_peak_flops()
    accuracy = {m: systems[m].evaluate(states[m])["heldout_accuracy"] for m in MODES}
    summary = summarize_run(config, times=times, results=results, flops=flops, peak=peak,
                            accuracy=accuracy, choice=choice, colocated=len(devices) == 1,
                            timers=timers, pool=merge_pool_stats(pool_calls),
                            params=(n_enc, n_bb), backend=backend.value)
    run.info(f"samples/s {({m: round(v, 2) for m, v in summary['samples_per_s'].items()})}; "
             f"speedup {summary['speedup_vs_monolithic_padded']}")
    return summary


def compile_programs(config, meshes: dict[str, Mesh]) -> list[Program]:
    """Every jitted program of a run on ``meshes`` (:func:`resolve_meshes`'s):
    :meth:`jaxflow.flow.system.FlowTrainSystem.programs`."""
    return FlowTrainSystem("monolithic_padded").programs(config, meshes)
