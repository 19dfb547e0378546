"""The ``bench_kernels`` experiment: each Pallas kernel / attention backend vs its XLA reference.

The cases (arrays, tolerances, bytes / FLOP models) are ``jaxflow.bench.kernel_cases``; how one
case is built, checked and timed (alternated pairs, CONVENTIONS) is ``jaxflow.bench.kernels``.
This driver measures the copy-bandwidth yardstick, runs every case the config asks for and
writes one row per case (``rows.json`` after each, so a killed run keeps what it measured).
"""

from __future__ import annotations

import jax

from jaxflow.bench.kernel_cases import iter_cases
from jaxflow.bench.kernels import copy_bandwidth, run_case
from jaxflow.experiment import RunContext

__all__ = ["main"]


def _reference_only(row: dict) -> bool:
    return row["status"] != "ok" or row["reference_status"] != "ok"


def main(config, run: RunContext) -> dict:
    """Every case's row (``run_case``) and the summary."""
    platform = jax.default_backend()
    interpret = platform not in ("gpu", "tpu") if config.interpret is None else config.interpret
    run.info(f"{platform} ({jax.devices()[0].device_kind}); interpret={interpret}"
             + ("; times measure the Pallas interpreter, not the kernels" if interpret else ""))
    copy_bps = copy_bandwidth(config.copy_bytes)
    run.info(f"elementwise pass over {config.copy_bytes / 2**20:.0f} MiB: "
             f"{copy_bps / 1e9:.1f} GB/s (the bandwidth yardstick)")
    rows, references, family = [], {}, None
    for case in iter_cases(config, interpret):
        if case.kernel != family:  # a family's reference builds die with its arrays
            references, family = {}, case.kernel
        row = run_case(case, config.pairs, config.warmup, references)
        for side in ("kernel", "reference"):
            if row.get(f"{side}_GBps"):
                row[f"{side}_fraction_of_copy_bandwidth"] = row[f"{side}_GBps"] * 1e9 / copy_bps
        if row.get("naive_logits_bytes") and row.get("kernel_temp_bytes") is not None:
            row["kernel_temp_over_naive_logits"] = (row["kernel_temp_bytes"]
                                                    / row["naive_logits_bytes"])
        rows.append(row)
        del case
        run.write_json("rows.json", {"rows": rows, "interpret": interpret})  # survives a kill
        msg = f"{row['name']} [{row['shape']}]: kernel {row['status']}"
        if row.get("max_error") is not None:
            msg += f", max error {row['max_error']:.2e} (tol {row['tolerance']:.0e})"
        if row.get("speedup_vs_reference") is not None:
            msg += (f", {row['kernel_s'] * 1e3:.2f} ms vs {row['reference_s'] * 1e3:.2f} ms "
                    f"({row['speedup_vs_reference']:.2f}x)")
        if _reference_only(row):
            msg += f"; reference {row['reference_status']}"
        run.info(msg)
    references.clear()
    checked = [r for r in rows if r["within_tolerance"] is not None]
    return {
        "platform": platform,
        "device_kind": jax.devices()[0].device_kind,
        "interpret": interpret,
        "times_meaningful": not interpret,
        "size": config.size,
        "copy_GBps": copy_bps / 1e9,
        "copy_bytes": config.copy_bytes,
        "rows": rows,
        "rows_ok": sum(r["status"] == "ok" for r in rows),
        "rows_unavailable": sum(r["status"].startswith("unavailable") for r in rows),
        "all_within_tolerance": bool(checked) and all(r["within_tolerance"] for r in checked),
    }
