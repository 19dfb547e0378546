"""Driver of the kernel_footprints experiment (see ``configs/kernel_footprints.py``).

Each Pallas kernel case of ``pallas_kernels.catalog`` is compiled by the real compiler of each
chip in ``pallas_kernels.targets`` (nothing runs); the figures are the compiler's: whether it
compiles, HBM temp and argument bytes per device (``memory_analysis``), the smallest scoped VMEM
limit that compiles (TPU) or the smallest opt-in shared memory per block (GPU), bisected, and the
block-footprint estimate of ``pallas_kernels.lowering`` beside them (the old fallback rule).
"""

from __future__ import annotations

import time

from pallas_kernels import catalog, lowering, targets

EXPORT_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}


def _fmt(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"


def _estimate(fn, args, platform: str) -> int:
    fps = lowering.pallas_footprints(fn, *args)
    if not fps:
        return 0
    return max(fp.tpu_bytes if platform == "tpu" else fp.triton_bytes for fp in fps)


def compile_case(case: catalog.KernelCase, chip: str, *, bisect: bool, step: int) -> dict:
    """One (case, chip): compiles?, the compiler's figures, and the footprint estimate."""
    spec = targets.chip(chip)
    row = {"kernel": case.kernel, "size": case.size, "chip": chip, "platform": spec.platform}
    if case.arg_bytes() > spec.hbm_bytes:
        row.update(compiles=None, note="does not fit: arguments exceed HBM")
        return row
    fn, args = case.build(EXPORT_PLATFORM[spec.platform], chip=chip)
    t0 = time.perf_counter()
    result = targets.compile_on(fn, args, chip)
    row.update(compiles=result.ok, compile_s=round(time.perf_counter() - t0, 1),
               temp_bytes=result.temp_bytes, argument_bytes=result.argument_bytes,
               estimate_bytes=_estimate(fn, args, spec.platform))
    if not result.ok:
        row["error"] = result.error[:300]
        return row
    if bisect and spec.platform == "tpu":
        row["min_vmem_limit"] = targets.min_vmem_limit(fn, args, chip, step=step, lo=step)
        row["onchip_floor"] = row["min_vmem_limit"] == step  # compiles at the search's floor
    elif bisect:
        lo = max(step // 64, 2**10)
        row["min_smem"] = targets.min_smem(fn, args, chip, lo=lo, step=lo)
        row["onchip_floor"] = row["min_smem"] == lo
    return row


def table(rows: list[dict]) -> str:
    """Markdown: one line per (kernel case, chip)."""
    out = ["| kernel | size | chip | compiles | smallest VMEM limit / shared memory that compiles "
           "| footprint estimate | HBM temp | compile s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = {True: "yes", False: "NO", None: "does not fit"}[r["compiles"]]
        onchip = _fmt(r.get("min_vmem_limit", r.get("min_smem")))
        onchip = f"<= {onchip}" if r.get("onchip_floor") else onchip
        out.append(f"| {r['kernel']} | {r['size']} | {r['chip']} | {ok} | {onchip} | "
                   f"{_fmt(r.get('estimate_bytes'))} | {_fmt(r.get('temp_bytes'))} | "
                   f"{r.get('compile_s', '-')} |")
    return "\n".join(out)


def main(config, run) -> dict:
    for platform in sorted({targets.chip(c).platform for c in config.chips}):
        targets.require(platform)
    cases = [c for c in catalog.kernel_cases() if c.size in config.sizes
             and (not config.kernels or c.kernel in config.kernels)]
    run.set_total_steps(len(cases) * len(config.chips), "compiles")
    rows = []
    for case in cases:
        for chip in config.chips:
            row = compile_case(case, chip, bisect=config.bisect, step=config.vmem_step)
            rows.append(row)
            run.log(len(rows), {"kernel": case.kernel, "size": case.size, "chip": chip,
                                "compiles": row["compiles"]})
    text = table(rows)
    (run.out_dir / "table.md").write_text(text + "\n", encoding="utf-8")
    run.info("\n" + text)
    run.write_json("compiled.json", {"rows": rows})
    compiled = [r for r in rows if r["compiles"] is not None]
    per_chip = {chip: {"compiled": sum(bool(r["compiles"]) for r in compiled if r["chip"] == chip),
                       "cases": sum(r["chip"] == chip for r in compiled)}
                for chip in config.chips}
    return {"cases": len(rows), "compiled": sum(bool(r["compiles"]) for r in compiled),
            "does_not_fit": len(rows) - len(compiled), "per_chip": per_chip,
            "failures": [f"{r['kernel']}[{r['size']}] on {r['chip']}: {r.get('error', '')}"
                         for r in compiled if not r["compiles"]]}
