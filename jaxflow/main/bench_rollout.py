"""Entry of the `bench_rollout` experiment (config: configs/bench_rollout.py).

For each model case (the flagship's shape; a ~100M-parameter shape) and each length case
(equal, long-tailed, GRPO groups) it samples the same ``requests`` sequences with two arms at
equal slots and KV budget (:mod:`jaxflow.rollout.bench_arms`): the paged engine
(:mod:`jaxflow.rollout`) and the static sampler (``make_sampler``). (The MARL engine's
compacting decode, a third arm until the paged engine was faster in every case, is gone:
FlexMARL samples through the paged engine.) Each arm runs once untimed on the exact workload, then ``pairs`` alternated
timed rounds (:func:`jaxflow.rollout.bench.run_case`). Reported per case: useful tokens/s per
arm (medians), the per-round ratio engine / static (median, min, max), peak KV bytes,
and for GRPO the peak KV bytes holding prompt tokens.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxflow.experiment import RunContext
from jaxflow.rollout.bench import TARGET_RATIO, machine, run_model
from jaxflow.rollout.bench_arms import sampling_config


def main(config, run: RunContext) -> dict[str, Any]:
    """Every model's cases; the results (also ``results.json``)."""
    results = {
        "machine": machine(), "load_avg_start": list(os.getloadavg()),
        "budget": "equal slots and KV bytes: static waves of `slots` rows with a [slots, "
                  "P + N] cache; the engine `slots` decode rows and a pool of slots * ceil((P + N) "
                  "/ page_size) pages + the null page",
        "useful_tokens": "generated tokens up to and including EOS (equal across arms)",
        "ratio": "per round: engine useful tokens/s / static useful tokens/s of the same round",
        "targets": TARGET_RATIO | {"grpo_prompt_kv": "engine peak <= baseline / G + one page "
                                                     "per slot"},
        "models": {},
    }
    for mc in config.models():
        results["models"][mc.name] = run_model(config, mc, run)
    results["load_avg_end"] = list(os.getloadavg())
    run.write_json("results.json", results)
    return results


def serve_case(config):
    """The ``serve`` case ``--compile-only`` compiles; one line when the variant has none."""
    from jaxflow.errors import UserError

    if config.serve is None:
        raise UserError("bench_rollout --compile-only compiles the `serve` engine: use "
                        "--variant=full (or --set serve=ServeCase-fields)")
    return config.serve


def resolve_meshes(config, devices=None) -> dict:
    """``{"rollout": mesh}``: one engine replica on the first ``serve.model_parallel`` devices
    (axis "model"); a larger target runs one such engine per group of that many chips. Without
    ``serve`` (the CPU benchmark) no mesh: the arms run on one device."""
    from jaxflow.mesh import MeshError, make_mesh

    if config.serve is None:
        return {}
    devices = list(jax.devices() if devices is None else devices)
    tp = config.serve.model_parallel
    if len(devices) < tp:
        raise MeshError(f"serve.model_parallel={tp}: {len(devices)} devices present; the serve "
                        f"engine needs {tp} (valid: serve.model_parallel in 1..{len(devices)})")
    return {"rollout": make_mesh({"model": tp}, devices[:tp])}


def compile_programs(config, meshes) -> list:
    """``--compile-only``: the engine's prefill and decode programs
    (:func:`jaxflow.rollout.programs.engine_programs`) for ``serve``'s model with bf16 weights
    (SparseRL-Sync's replica) on ``meshes["rollout"]``."""
    from jaxflow.models.architectures import shipped_config
    from jaxflow.rollout import EngineConfig
    from jaxflow.rollout.pages import pool_pages
    from jaxflow.rollout.programs import engine_programs

    serve = serve_case(config)
    width = serve.prompt_len + serve.max_new
    layers = {} if serve.n_layers is None else {"n_layers": serve.n_layers}
    model = shipped_config(serve.model, max_seq_len=width, **layers)
    engine = EngineConfig(slots=serve.slots, page_size=serve.page_size,
                          num_pages=pool_pages(serve.slots, width, serve.page_size),
                          prefill_chunk=serve.prefill_chunk, prefill_rows=serve.prefill_rows,
                          decode_steps=serve.decode_steps, max_seq_len=width,
                          attention=serve.attention)
    sampling = sampling_config(serve.max_new, config.temperature)
    return engine_programs(model, meshes["rollout"], engine, sampling,
                           prompt_len=serve.prompt_len)
