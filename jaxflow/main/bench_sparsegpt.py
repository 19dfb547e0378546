"""The ``bench_sparsegpt`` experiment: jaxflow SparseGPT vs llmcompressor's ``sparsify_weight``.

Per layer shape x sparsity, both sides prune the same weights with the same calibration
activations; reported: the speedup (torch time / jaxflow time, A B A B pairs after a warm-up)
and the held-out reconstruction errors. The measurement and its known differences (the
reference prunes ``int(size * s) + 1`` weights per unstructured block) are documented in
``jaxflow.prune.bench``; the reference is the optional ``bench`` extra.
"""

from __future__ import annotations

import statistics

import jax.numpy as jnp

from jaxflow.experiment import RunContext
from jaxflow.prune.bench import layer_data, load_reference, measure_cell
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.sparsegpt import hessian_from_inputs

__all__ = ["main"]


def main(config, run: RunContext) -> dict:
    """Every layer x sparsity cell (``measure_cell``), one metrics row each; the summary."""
    torch, ref = load_reference()
    torch.set_num_threads(config.torch_threads)
    results, ratios_all = [], []
    run.set_total_steps(len(config.layers) * len(config.sparsities), "bench_sparsegpt")
    for shape in config.layers:
        rows, cols = (int(v) for v in shape.split("x"))
        weight, x_cal, x_held = layer_data(rows, cols, config.tokens, seed=config.seed)
        h = hessian_from_inputs(jnp.asarray(x_cal))
        for sp in config.sparsities:
            cell, ratios = measure_cell(torch, ref, weight, x_cal, x_held, h, parse_sparsity(sp),
                                        block_size=config.block_size, damp=config.damp,
                                        warmup=config.warmup, pairs=config.pairs)
            row = {"layer": shape, **cell}
            ratios_all.append(statistics.median(ratios))
            results.append(row)
            run.log(len(results), row)
    return {
        "speedup_vs_torch": statistics.median(ratios_all),
        "rel_error_vs_torch": max(r["rel_error"] for r in results),
        "rel_error_vs_torch_own_count": max(r["rel_error_own_count"] for r in results),
        "per_layer": results,
        "torch_version": torch.__version__,
        "torch_threads": config.torch_threads,
        "pairs": config.pairs,
    }
