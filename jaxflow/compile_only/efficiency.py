"""Two efficiency figures of a compiled train step, and how they stand beside MaxText's MFU.

Both are model-FLOPs utilisation: the time the step's model FLOPs would take at the chip's
peak (``model_compute = model_flops / n_devices / peak_flops``) over a modelled step time.
Neither is measured; both assume the chip's peak dense bf16 FLOP/s and HBM bandwidth
(:data:`pallas_kernels.targets.CHIPS`), so both sit above what a real step reaches.

* **roofline MFU bound** (``roofline_mfu_bound``): ``model_compute / max(compute, memory,
  interconnect)``: compute, HBM traffic and collectives all overlap perfectly, so nothing is
  faster; an upper bound.
* **MFU estimate** (``mfu_estimate``): ``model_compute / (max(compute, memory) +
  (1 - overlap) * interconnect)``: compute and HBM traffic overlap (the roofline), the
  collectives are exposed except for the ``overlap`` fraction hidden behind compute.
  :data:`OVERLAP` = 0: XLA's latency-hiding scheduler does hide part of the FSDP gathers
  and gradient reductions behind the layer scan in practice, but how much is not known
  ahead of a run, so the estimate credits none of it (the pessimistic end on collectives).

``compute`` / ``memory`` are the report's roofline terms (the larger of the compiler's and
the analytic flops / bytes, per device). ``interconnect`` is the time one device's
collectives take on its links: the result bytes of each collective in the HLO
(:mod:`jaxflow.compile_only.hlo`) turned into bytes each device sends by the ring algorithm
of its kind, over a group of ``g`` devices (the program's mesh; a collective over a sub-group
moves less, so this errs long):

    all-reduce          2 (g - 1) / g x result   (reduce-scatter + all-gather)
    all-gather          (g - 1) / g x result     (the gathered array)
    reduce-scatter      (g - 1) x result         (the result is one shard)
    all-to-all          (g - 1) / g x result
    collective-permute  1 x result

divided by the chip's interconnect bandwidth (``Chip.ici_bandwidth``, sources in
:data:`INTERCONNECT_SOURCES`).

:data:`MAXTEXT` holds MaxText's published MFU for the same models and chips, and
``python -m jaxflow.compile_only.efficiency REPORT.json ...`` prints the comparison for the
Llama-3-8B compile reports given (``experiments/compile_reports/lm_pretrain-full-*.json``).
"""

from __future__ import annotations

import argparse
import json
import sys

from pallas_kernels import targets

#: Fraction of the collectives' interconnect time the estimate takes as hidden behind compute.
OVERLAP = 0.0

#: Where each chip's ``ici_bandwidth`` (bytes/s per chip) comes from.
INTERCONNECT_SOURCES = {
    # Google gives a bidirectional per-chip ICI figure; a ring step sends and receives at once,
    # so one direction's half is the rate a device's ring collective moves its bytes at.
    # TPU v5e: 400 GBps bidirectional ICI per chip (= the older page's 1,600 Gbps one way)
    "v5e": "ICI 400 GB/s per chip bidirectional, 200 GB/s each way "
           "(cloud.google.com/tpu/docs/v5e)",
    # TPU v5p: 1,200 GBps bidirectional ICI per chip (= the older page's 4,800 Gbps)
    "v5p": "ICI 1,200 GB/s per chip bidirectional, 600 GB/s each way "
           "(cloud.google.com/tpu/docs/v5p)",
    # TPU v6e: 3,584 Gbps = 448 GB/s in an earlier revision of the page; the current one gives
    # 800 GBps bidirectional (400 GB/s each way, 11% less): the table keeps 448 GB/s
    "v6e": "ICI 3,584 Gbps = 448 GB/s per chip (cloud.google.com/tpu/docs/v6e, earlier "
           "revision; current: 800 GB/s bidirectional = 400 GB/s each way)",
    # H100 SXM: NVLink 4, 900 GB/s per GPU both directions together (NVIDIA H100 datasheet)
    "h100": "NVLink 4: 900 GB/s per GPU bidirectional, 450 GB/s each way (NVIDIA H100 "
            "datasheet)",
    # H200 SXM: the same NVLink 4, 900 GB/s per GPU (NVIDIA H200 datasheet)
    "h200": "NVLink 4: 900 GB/s per GPU bidirectional, 450 GB/s each way (NVIDIA H200 "
            "datasheet)",
}

#: MaxText's published MFU (docs/reference/models/tiering.md of AI-Hypercomputer/maxtext at
#: commit 20a91e12a17cbaa7b786ac388b192b63392cd855: measured pre-training runs, BF16).
MAXTEXT_SOURCE = ("AI-Hypercomputer/maxtext docs/reference/models/tiering.md @ 20a91e12 "
                  "(\"Optimized Models Tiering\")")
MAXTEXT = (
    {"model": "Llama-3.1-8B", "chip": "v6e", "chips": 256, "seq_len": 8192, "mfu": 0.4546},
    {"model": "Llama-3.1-70B", "chip": "v6e", "chips": 256, "seq_len": 8192, "mfu": 0.5033},
    {"model": "Llama-2-70B", "chip": "v6e", "chips": 256, "seq_len": 4096, "mfu": 0.438},
    {"model": "Llama-2-70B", "chip": "v5p", "chips": 512, "seq_len": 4096, "mfu": 0.654},
)


def wire_bytes(collectives: dict, group: int) -> float:
    """Bytes one device sends over the interconnect for ``collectives`` ({kind: {"count",
    "bytes"}} with result bytes per device, as in the report) by ring algorithms over
    ``group`` devices (factors in the module docstring); ``group`` 1 sends nothing."""
    if group < 1:
        raise ValueError(f"group={group}; valid: the devices a collective spans, >= 1")
    if group == 1:
        return 0.0
    share = (group - 1) / group
    factor = {"all-reduce": 2 * share, "all-gather": share, "reduce-scatter": group - 1,
              "all-to-all": share, "collective-permute": 1.0}
    unknown = set(collectives) - set(factor)
    if unknown:
        raise ValueError(f"collective kinds {sorted(unknown)}; valid: {sorted(factor)}")
    return sum(factor[k] * float(v["bytes"]) for k, v in collectives.items())


def figures(*, model_flops: float, n_devices: int, compute_seconds: float,
            memory_seconds: float, collectives: dict, chip: targets.Chip,
            overlap: float = OVERLAP) -> dict:
    """The two figures of one train step on ``chip`` (module docstring): {model_compute_seconds,
    interconnect_seconds, exposed_collective_seconds, estimate_seconds, roofline_mfu_bound,
    mfu_estimate, overlap}. ``compute_seconds`` / ``memory_seconds``: the roofline's terms
    (per device); ``collectives``: the report's (per device, the group taken as
    ``n_devices``)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap}; valid: a fraction in [0, 1]")
    model_compute = model_flops / n_devices / chip.peak_flops
    interconnect = wire_bytes(collectives, n_devices) / chip.ici_bandwidth
    exposed = (1.0 - overlap) * interconnect
    estimate = max(compute_seconds, memory_seconds) + exposed
    longest = max(compute_seconds, memory_seconds, interconnect)
    return {"model_compute_seconds": model_compute, "interconnect_seconds": interconnect,
            "exposed_collective_seconds": exposed, "estimate_seconds": estimate,
            "roofline_mfu_bound": model_compute / longest if longest > 0 else None,
            "mfu_estimate": model_compute / estimate if estimate > 0 else None,
            "overlap": overlap}


def of_entry(entry: dict, chip: targets.Chip) -> dict | None:
    """:func:`figures` of a compiled "train" entry of a compile report with model flops;
    None for another kind or an entry that did not compile."""
    if entry.get("kind") != "train" or not entry.get("model_flops") or "roofline" not in entry:
        return None
    line = entry["roofline"]
    return figures(model_flops=entry["model_flops"], n_devices=entry["n_devices"],
                   compute_seconds=line["compute_seconds"],
                   memory_seconds=line["memory_seconds"], collectives=entry["collectives"],
                   chip=chip)


def comparison_rows(reports: list[dict], model: str = "Llama-3-8B") -> list[dict]:
    """One row per compiled train program of ``reports`` (compile_report.json dicts, of
    ``model``) with its two figures, beside MaxText's published rows for the same chip: its
    figure for the same model family and size where :data:`MAXTEXT` has one, else None, with
    the chip's other published rows in ``maxtext_other``."""
    size = model.rsplit("-", 1)[-1]
    rows = []
    for report in reports:
        chip = targets.CHIPS[report["chip"]["name"]]
        for entry in report["programs"]:
            got = of_entry(entry, chip)
            if got is None:
                continue
            same = [m for m in MAXTEXT if m["chip"] == chip.name
                    and m["model"].startswith("Llama-3") and m["model"].endswith(size)]
            other = [m for m in MAXTEXT if m["chip"] == chip.name and m not in same]
            rows.append({"model": model, "target": report["target"]["text"], "chip": chip.name,
                         "program": entry["name"], "status": entry["status"],
                         "git_commit": report.get("git_commit"), **got,
                         "maxtext": same[0] if same else None, "maxtext_other": other})
    return rows


def comparison_table(rows: list[dict]) -> str:
    """The rows of :func:`comparison_rows` as an aligned text table."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    head = ("model", "target", "program", "fits", "roofline MFU bound", "MFU estimate",
            "MaxText MFU (same model, chip)")
    out = [head]
    for r in rows:
        m = r["maxtext"]
        if m is not None:
            theirs = f"{pct(m['mfu'])} ({m['model']}, {m['chips']} chips, SL {m['seq_len']})"
        else:
            others = "; ".join(f"{o['model']} {pct(o['mfu'])} on {o['chips']}"
                               for o in r["maxtext_other"])
            theirs = "none published" + (f" (other: {others})" if others else "")
        out.append((r["model"], r["target"], r["program"],
                    "yes" if r["status"] == "ok" else "no", pct(r["roofline_mfu_bound"]),
                    pct(r["mfu_estimate"]), theirs))
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in out)


#: The chips the comparison covers: a TPU v5p and a v6e pod, and NVIDIA H100s.
COMPARED_CHIPS = ("v5p", "v6e", "h100")


def missing_chips(rows: list[dict], model: str = "Llama-3-8B") -> list[str]:
    """One line per chip of :data:`COMPARED_CHIPS` no row covers: what MaxText publishes for
    ``model``'s size there, so the table says which comparison is still to be compiled."""
    size = model.rsplit("-", 1)[-1]
    covered = {r["chip"] for r in rows}
    lines = []
    for chip in COMPARED_CHIPS:
        if chip in covered:
            continue
        theirs = [m for m in MAXTEXT if m["chip"] == chip and m["model"].endswith(size)]
        said = "; ".join(f"{m['model']} {100 * m['mfu']:.2f}% on {m['chips']} chips, SL "
                         f"{m['seq_len']}" for m in theirs) or "none published"
        lines.append(f"{chip}: no compile report given (MaxText: {said})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxflow.compile_only.efficiency REPORT.json ... [--model NAME]``: the
    comparison table of the reports' train programs beside MaxText's published MFU."""
    parser = argparse.ArgumentParser(prog="python -m jaxflow.compile_only.efficiency",
                                     description=main.__doc__)
    parser.add_argument("reports", nargs="+", help="compile_report.json files")
    parser.add_argument("--model", default="Llama-3-8B", help="the reports' model")
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        try:
            with open(path, encoding="utf-8") as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"{parser.prog}: error: {path}: {e}", file=sys.stderr)
            return 2
    rows = comparison_rows(reports, args.model)
    print(comparison_table(rows))
    for line in missing_chips(rows, args.model):
        print(line)
    print(f"MaxText: {MAXTEXT_SOURCE}; estimate overlap = {OVERLAP}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
