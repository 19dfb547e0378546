"""bench_rollout's cases (driver ``jaxflow/main/bench_rollout.py``, arms in
:mod:`jaxflow.rollout.bench_arms`).

For one model (:func:`run_model`) and each length case (:func:`run_case`: equal, long-tailed, GRPO
groups) the two arms (the paged engine, the static sampler) sample the same ``requests``
sequences at equal slots and KV budget: each runs once untimed on the exact workload (compiles
every shape it hits; its outputs are compared across arms), then ``pairs`` alternated timed
rounds. Reported per case: useful tokens/s per arm (medians), the per-round ratio engine /
static (median, min, max) by wall time and by CPU seconds of the process (every thread; less
moved by other processes' load), peak KV bytes, and for GRPO the peak KV bytes holding prompt
tokens (:func:`prompt_kv`).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxflow.experiment import RunContext
from jaxflow.models.transformer import Transformer
from jaxflow.rollout.bench_arms import (
    EngineArm,
    StaticArm,
    Workload,
    describe_lengths,
    kv_bytes_per_token,
    make_workload,
    sampling_config,
    timed,
    timed_cpu,
)

__all__ = ["ARMS", "TARGET_RATIO", "machine", "prompt_kv", "run_case", "run_model"]

#: engine / static sampler, useful tokens/s (same run)
TARGET_RATIO = {"equal": 0.9, "long_tail": 2.0, "grpo": 1.5}
ARMS = ("engine", "static")


def machine() -> dict[str, Any]:
    """Where the figures come from."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind)}


def _mismatched_rows(a, b) -> int:
    return int(((a.tokens != b.tokens) | (a.mask != b.mask)).any(axis=1).sum())


def prompt_kv(w: Workload, engine: EngineArm, slots: int, bytes_per_token: int) -> dict[str, Any]:
    """KV bytes holding prompt tokens, from the engine's traced warm-up run.

    Peak: the engine's most pages holding its running sequences' prompt tokens (shared prefix
    pages once, each sequence's own page with the prompt's tail) vs the baselines' (every row
    holds its own prompt: the most prompt tokens in one wave of ``slots`` rows; also the
    allocated [slots, P] region); the target bound is baselines / G + one page per slot.
    ``*_with_lookahead`` adds the prefix pages of requests the engine prefilled ahead of
    their slots."""
    _, lengths = w.rows()
    used = max(int(lengths[i:i + slots].sum()) for i in range(0, len(lengths), slots))
    pb, g = engine.page_bytes, w.group_size
    trace = np.asarray(engine.prompt_trace, np.int64)  # [steps, 4]
    baseline = used * bytes_per_token
    bound = baseline / g + slots * pb
    peak, peak_ahead = int(trace[:, 0].max()) * pb, int(trace[:, 1].max()) * pb
    return {"engine_peak_bytes": peak, "engine_peak_bytes_with_lookahead": peak_ahead,
            "baseline_bytes": baseline,
            "baseline_allocated_bytes": slots * w.prompts.shape[1] * bytes_per_token,
            "bound_bytes": bound, "met": peak <= bound, "met_with_lookahead": peak_ahead <= bound,
            "engine_over_baseline": peak / baseline}


def run_case(config, mc, case: str, arms: dict, run: RunContext) -> dict[str, Any]:
    """One (model, length case): warm-up + checks, ``mc.pairs`` alternated rounds."""
    w = make_workload(case, sequences=config.requests, group_size=config.group_size,
                      prompt_len=mc.prompt_len, max_new=mc.max_new, vocab=mc.model.vocab_size,
                      median_frac=config.tail_median_frac, sigma=config.tail_sigma,
                      seed=config.seed)
    load_before = os.getloadavg()
    warm, outs = {}, {}
    for name in ARMS:  # compile + first run; the engine's run traced for the prompt KV
        arm = arms[name]
        if name == "engine":
            t, outs[name] = timed(type("Traced", (), {"run": lambda _, w: arm.run_traced(w)})(), w)
        else:
            t, outs[name] = timed(arm, w)
        warm[name] = t
    useful = {name: int(o.mask.sum()) for name, o in outs.items()}
    engine_stats = vars(arms["engine"].last.stats).copy()
    lengths = outs["engine"].mask.sum(axis=1).astype(int)
    run.info(f"{mc.name}/{case}: warm-up (compile incl.) {warm}; useful tokens {useful}")

    seconds, cpu_seconds = {name: [] for name in ARMS}, {name: [] for name in ARMS}
    for i in range(mc.pairs):
        for name in (ARMS if i % 2 == 0 else ARMS[::-1]):
            t, cpu, _ = timed_cpu(arms[name], w)
            seconds[name].append(t)
            cpu_seconds[name].append(cpu)
    secs = {n: np.asarray(s) for n, s in seconds.items()}
    cpus = {n: np.asarray(s) for n, s in cpu_seconds.items()}
    tps = {n: useful["engine"] / s for n, s in secs.items()}
    ratios = tps["engine"] / tps["static"]
    cpu_ratios = cpus["static"] / cpus["engine"]  # tokens per CPU-second, engine / static
    mid = int(np.argsort(ratios)[len(ratios) // 2])
    medians = {n: float(np.median(v)) for n, v in tps.items()}
    bpt = kv_bytes_per_token(mc.model)
    engine = arms["engine"]
    result = {
        "sequences": w.sequences, "prompts": int(w.prompts.shape[0]), "group_size": w.group_size,
        "length_distribution": _length_doc(case, config, mc),
        "realised_lengths": describe_lengths(lengths, mc.max_new),
        "useful_tokens": useful["engine"],
        "useful_tokens_equal": len(set(useful.values())) == 1,
        "mismatched_rows_engine_vs_static": _mismatched_rows(outs["engine"], outs["static"]),
        "tokens_per_second": medians,
        "ratio_median": float(np.median(ratios)),
        "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
        "ratios": ratios.tolist(),
        "ratio_vs_static_median": float(np.median(tps["engine"] / tps["static"])),
        "median_round": {n: float(secs[n][mid]) for n in ARMS} | {"ratio": float(ratios[mid])},
        "seconds": {n: s.tolist() for n, s in secs.items()},
        "cpu_seconds": {n: s.tolist() for n, s in cpus.items()},
        "cpu_ratio_median": float(np.median(cpu_ratios)),
        "cpu_ratio_min": float(cpu_ratios.min()), "cpu_ratio_max": float(cpu_ratios.max()),
        "warmup_seconds_compile_included": warm,
        "target_ratio": TARGET_RATIO[case],
        "target_ratio_met": bool(np.median(ratios) >= TARGET_RATIO[case]),
        "peak_kv_bytes": {"engine": engine.peak_kv_bytes(),
                          "static": arms["static"].peak_kv_bytes(w, mc.model)},
        "engine_pool_bytes": engine.config.num_pages * engine.page_bytes,
        "engine_stats": engine_stats,
        "load_avg_1min": [load_before[0], os.getloadavg()[0]],
    }
    if case == "grpo":
        result["prompt_kv"] = prompt_kv(w, engine, mc.slots, bpt)
    run.info(f"{mc.name}/{case}: tokens/s {({k: round(v) for k, v in medians.items()})}; engine / "
             f"static {result['ratio_median']:.2f} [{result['ratio_min']:.2f}, "
             f"{result['ratio_max']:.2f}] (target {TARGET_RATIO[case]}); by CPU seconds "
             f"{result['cpu_ratio_median']:.2f} [{result['cpu_ratio_min']:.2f}, {result['cpu_ratio_max']:.2f}]")
    return result


def _length_doc(case: str, config, mc) -> dict[str, Any]:
    if case == "equal":
        return {"kind": "equal", "length": mc.max_new}
    return {"kind": "lognormal, clipped at the cap (mass above it at the cap)",
            "median": config.tail_median_frac * mc.max_new, "sigma": config.tail_sigma,
            "cap": mc.max_new}


def run_model(config, mc, run: RunContext) -> dict[str, Any]:
    """Every length case of one model (``mc``, a ``configs.bench_rollout.ModelCase``)."""
    graphdef, state = nnx.split(Transformer(mc.model, rngs=nnx.Rngs(config.seed)))
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
    sampling = sampling_config(mc.max_new, config.temperature)
    arms = {
        "engine": EngineArm(graphdef, state, sampling, slots=mc.slots, page_size=mc.page_size,
                            prompt_len=mc.prompt_len, prefill_rows=mc.prefill_rows,
                            prefill_calls=config.prefill_calls, decode_steps=mc.decode_steps,
                            loop_steps=mc.loop_steps, loop_refill=mc.loop_refill),
        "static": StaticArm(graphdef, state, sampling, mc.slots),
    }
    bpt = kv_bytes_per_token(mc.model)
    out = {"params": n_params, "prompt_len": mc.prompt_len, "max_new": mc.max_new,
           "slots": mc.slots, "page_size": mc.page_size, "pairs": mc.pairs,
           "kv_bytes_per_token": bpt,
           "kv_budget_bytes": mc.slots * (mc.prompt_len + mc.max_new) * bpt,
           "engine_config": vars(arms["engine"].config).copy(), "cases": {}}
    for case in config.cases:
        out["cases"][case] = run_case(config, mc, case, arms, run)
    return out
