"""The ``bench_checkpoint`` experiment (see configs/bench_checkpoint.py): the three measurements
of ``jaxflow.bench.checkpoint`` in turn, ``results.json`` and a markdown table."""

from __future__ import annotations

import os
import shutil
import tempfile

from jaxflow.bench.checkpoint import bench_forward, bench_load, bench_moe
from jaxflow.experiment import RunContext

__all__ = ["main"]


def _table(results: dict) -> str:
    lo, fw, mo = results["load"], results["forward"], results["moe"]
    return "\n".join([
        "| part | measurement | value |", "|---|---|---|",
        f"| load | params / tensor GiB ({lo['dtype']}) | {lo['params'] / 1e9:.3f}B / "
        f"{lo['tensor_bytes'] / 2**30:.2f} |",
        f"| load | from_pretrained seconds (GB/s) | {lo['load_seconds']:.1f} "
        f"({lo['GB_per_s']:.2f}) |",
        f"| load | peak RSS growth / tensor bytes (target <= 1.2) | "
        f"{lo['peak_rss_growth_ratio']:.3f} |",
        f"| forward | jaxflow / transformers tokens/s ({fw['params'] / 1e6:.1f}M params, "
        f"B={fw['batch']}, T={fw['seq_len']}) | {fw['jaxflow_tokens_per_s']:.0f} / "
        f"{fw['transformers_tokens_per_s']:.0f} |",
        f"| forward | jaxflow speed-up, median of {fw['pairs']} pairs | "
        f"{fw['speedup_jaxflow_over_transformers']:.2f}x |",
        f"| moe | all-to-all / dense ms ({mo['experts']} experts, {mo['devices']} devices, "
        f"{mo['tokens']} tokens) | {mo['all_to_all_ms']:.2f} / {mo['dense_ms']:.2f} |",
        f"| moe | all-to-all speed-up, median of {mo['pairs']} pairs | "
        f"{mo['speedup_all_to_all_over_dense']:.2f}x |",
        f"| moe | dropped fraction at capacity factor {mo['capacity_factor']} | "
        f"{mo['dropped_fraction']:.4f} |",
    ])


def main(config, run: RunContext) -> dict:
    """Load, forward and MoE results (in a scratch directory removed afterwards)."""
    scratch = config.scratch_dir or tempfile.mkdtemp(prefix="bench_checkpoint-")
    os.makedirs(scratch, exist_ok=True)
    try:
        results = {"load": bench_load(config.load, scratch, run)}
        run.info(f"load: {results['load']}")
        results["forward"] = bench_forward(config.forward, scratch, config.seed)
        run.info(f"forward: {results['forward']}")
        results["moe"] = bench_moe(config.moe, config.seed)
        run.info(f"moe: {results['moe']}")
    finally:
        if not config.scratch_dir:
            shutil.rmtree(scratch, ignore_errors=True)
    run.write_json("results.json", results)
    table = _table(results)
    if run.is_primary:
        (run.out_dir / "results.md").write_text(table + "\n")
    run.info("results:\n" + table)
    return results
