"""The ``--compile-only`` report: per program, memory against the chip, cost, roofline, the
efficiency figures, compile seconds and the kernels that fell back to XLA.

Every figure is per device: the compiled module is the SPMD-partitioned program of one device,
and ``compiled.cost_analysis()`` counts its flops and bytes (checked: a [1024, 2048] x
[2048, 4096] matmul split 4 ways on v5e reports a quarter of the global 2 x M x K x N flops).
Where the compiler gives no cost analysis (deviceless XLA:GPU executables do not implement it),
XLA's HLO cost analysis of the compiled module is run by the host's CPU client instead
(``cost_source`` says which).

Roofline time of one call (seconds, per device, the same for every device of an SPMD program):

    roofline = max(flops / peak_flops, bytes_accessed / hbm_bandwidth)
               + collective_bytes / ici_bandwidth

with flops = max(compiler flops, (model_flops + recompute_flops) / n_devices) (the analytic
count with remat's recomputed forward; ``cost_analysis`` counts a Pallas
call as ~0 flops, and a ``while`` body once however often it runs - a decode loop, layers run
as one scan - so the analytic count of :class:`~jaxflow.compile_only.program.Program`
stands in where it is larger), bytes_accessed the compiler's HBM traffic (a lower bound for a
program with loops: ``cost.bytes_lower_bound``, the trips in ``cost.loop_trips``; the
roofline's memory term is then optimistic) or the program's analytic ``model_bytes /
n_devices`` where that is larger (a decode step's weights and paged KV reads, which a Pallas
kernel hides from the cost analysis), collective_bytes the
result bytes of the collectives in the HLO (:mod:`jaxflow.compile_only.hlo`), and the chip
figures of :data:`pallas_kernels.targets.CHIPS`. Collectives are not overlapped with compute:
the estimate is pessimistic there and optimistic everywhere else (perfect overlap of compute
and HBM traffic, no launch or pipeline bubbles).

Efficiency of a "train" program (:mod:`jaxflow.compile_only.efficiency`): the **roofline MFU
bound** (model_flops / n_devices / peak_flops over the longest of the compute, HBM and
interconnect times: everything overlapped, an upper bound) and the **MFU estimate** (over
max(compute, HBM) + the exposed collectives, each collective's bytes by its ring algorithm
against the chip's ICI / NVLink bandwidth). Both assume peak FLOP/s; neither is measured.

Compile time: ``seconds`` {"lower", "compile"} of each program. Kernel fall-backs: the
kernels whose ``auto`` dispatch chose XLA while the program was traced
(``kernel_fallbacks``: kernel, platform, shapes, reason), so a pod program that lost its
kernel says so here and not only in a warning.

HBM per device: total = arguments + outputs + temporaries - aliased (donated) bytes, from
``compiled.memory_analysis()``; it fits when total <= the chip's HBM.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxflow.compile_only import efficiency
from jaxflow.compile_only.hlo import COLLECTIVES, HloSummary
from pallas_kernels import targets

GiB = 2**30
MiB = 2**20
ROOFLINE_FORMULA = ("max(max(flops, (model_flops + recompute_flops) / n_devices) / peak_flops, "
                    "max(bytes_accessed, "
                    "model_bytes / n_devices) / hbm_bandwidth) + collective_bytes / "
                    "ici_bandwidth")
ROOFLINE_MFU_BOUND_FORMULA = ("(model_flops / n_devices / peak_flops) / max(compute_seconds, "
                              "memory_seconds, interconnect_seconds)")
MFU_ESTIMATE_FORMULA = ("(model_flops / n_devices / peak_flops) / (max(compute_seconds, "
                        "memory_seconds) + (1 - overlap) * interconnect_seconds), overlap = "
                        f"{efficiency.OVERLAP}; interconnect_seconds = ring wire bytes of the "
                        "collectives / ici_bandwidth")
_REQUIRED = re.compile(r"memory required for ([\w ]+?) \(([0-9.]+)([KMGT])?\) exceeds")
_USED = re.compile(r"Used ([0-9.]+)([KMGT])? of ([0-9.]+)([KMGT])? hbm")
_ALLOCATE = re.compile(r"allocate ([0-9]+) bytes")
_UNIT = {None: 1, "": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of a compiled program (``compiled.memory_analysis()``)."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs + temporaries - aliased (donated) bytes."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @classmethod
    def of(cls, compiled) -> "Memory":
        mem = compiled.memory_analysis()
        return cls(*(int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
                     for k in ("argument", "output", "temp", "alias")))


def cost_of(compiled) -> tuple[float, float, str]:
    """(flops, bytes accessed, source) of one device's compiled program: the compiler's
    ``cost_analysis()``, else XLA's HLO cost analysis of the compiled module on the CPU client
    (deviceless XLA:GPU executables raise UNIMPLEMENTED for GetCostAnalysis)."""
    cost = None
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - "not supported" by this executable
        cost = None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if cost and "flops" in cost:
        return float(cost["flops"]), float(cost.get("bytes accessed", 0.0)), \
            "compiled.cost_analysis()"
    import jax
    from jax._src.lib import xla_client

    try:  # jaxlib's (private) binding of xla::HloCostAnalysis
        module = compiled.runtime_executable().hlo_modules()[0]
        cpu = jax.devices("cpu")[0].client
        cost = xla_client._xla.hlo_module_cost_analysis(cpu, module)
    except Exception as err:  # noqa: BLE001 - no cost figures: the roofline uses model_flops
        return 0.0, 0.0, f"unavailable ({type(err).__name__})"
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), \
        "HLO cost analysis of the compiled module (CPU client)"


def roofline(flops: float, bytes_accessed: float, collective_bytes: float,
             chip: targets.Chip) -> dict:
    """Roofline of one call on one device of ``chip`` (see the module docstring):
    {compute_seconds, memory_seconds, collective_seconds, seconds, bound}; ``flops`` is the
    compute term's flops (already the max of the compiler's and the analytic ones)."""
    compute = flops / chip.peak_flops
    memory = bytes_accessed / chip.hbm_bandwidth
    collective = collective_bytes / chip.ici_bandwidth
    seconds = max(compute, memory) + collective
    bound = "collective" if collective > max(compute, memory) else (
        "compute" if compute >= memory else "memory")
    return {"compute_seconds": compute, "memory_seconds": memory,
            "collective_seconds": collective, "seconds": seconds, "bound": bound}


def hbm_error_bytes(message: str) -> tuple[int | None, str]:
    """(per-device bytes, what they count) a RESOURCE_EXHAUSTED compile error names, or
    (None, ""): XLA:TPU's "the total memory required for HLO temporaries (29.01G) exceeds
    available HBM (15.75G)" (G = GiB), "Used 120.5G of 95.7G hbm", "allocate N bytes"."""
    if (m := _REQUIRED.search(message)) is not None:
        return int(float(m.group(2)) * _UNIT[m.group(3)]), m.group(1)
    if (m := _USED.search(message)) is not None:
        return int(float(m.group(1)) * _UNIT[m.group(2)]), "everything"
    if (m := _ALLOCATE.search(message)) is not None:
        return int(m.group(1)), "one allocation"
    return None, ""


def program_entry(program, chip: targets.Chip, *, memory: Memory | None = None,
                  cost: tuple[float, float, str] | None = None,
                  hlo: HloSummary | None = None, seconds: dict | None = None,
                  error: str = "", error_kind: str = "", fallbacks=()) -> dict:
    """The report's entry for one program (``program`` a
    :class:`~jaxflow.compile_only.program.Program`); without ``memory`` it failed to compile
    (``error``, ``error_kind``: "hbm" counts as not fitting). ``seconds``: {"lower",
    "compile"}; ``fallbacks``: the dicts ``pallas_kernels.dispatch.recording_fallbacks``
    collected while it was traced (listed once each)."""
    n = int(program.mesh.devices.size)
    entry: dict[str, Any] = {
        "name": program.name, "kind": program.kind, "note": program.note,
        "mesh": {k: int(v) for k, v in program.mesh.shape.items()}, "n_devices": n,
        "model_flops": program.model_flops, "tokens": program.tokens,
        "seconds": seconds or {},
        "kernel_fallbacks": [dict(t) for t in dict.fromkeys(
            tuple(sorted(f.items())) for f in fallbacks)],
        "efficiency": None, "roofline_mfu_bound": None, "mfu_estimate": None}
    capacity = chip.hbm_bytes
    if memory is None:
        needed, what = hbm_error_bytes(error) if error_kind == "hbm" else (None, "")
        entry.update(status="does_not_fit" if error_kind == "hbm" else "failed",
                     error=error, error_kind=error_kind,
                     memory={"total_bytes": None, "required_bytes": needed,
                             "required_for": what, "capacity_bytes": capacity,
                             "fits": False})
        return entry
    flops, bytes_accessed, source = cost
    analytic = (program.model_flops or 0.0) / n
    recompute = (program.recompute_flops or 0.0) / n
    used = max(flops, analytic + recompute)
    model_bytes = (program.model_bytes or 0.0) / n
    line = roofline(used, max(bytes_accessed, model_bytes), hlo.collective_bytes, chip)
    fits = memory.total_bytes <= capacity
    entry.update(
        status="ok" if fits else "does_not_fit", error="", error_kind="",
        memory={**dataclasses.asdict(memory), "total_bytes": memory.total_bytes,
                "capacity_bytes": capacity, "fits": fits},
        cost={"flops": flops, "bytes_accessed": bytes_accessed, "source": source,
              "scope": "per device", "model_flops_per_device": analytic,
              "recompute_flops_per_device": recompute,
              "roofline_flops": used, "model_bytes_per_device": model_bytes,
              "roofline_bytes": max(bytes_accessed, model_bytes),
              "loop_trips": list(hlo.loop_trips),
              "bytes_lower_bound": bool(hlo.loop_trips)},
        collectives=hlo.collectives, collective_bytes=hlo.collective_bytes,
        kernels={"pallas": hlo.pallas_kernels, "pallas_count": hlo.kernel_count,
                 "cudnn": hlo.cudnn_calls, "cudnn_count": sum(hlo.cudnn_calls.values())},
        roofline=line)
    figures = efficiency.of_entry(entry, chip)
    entry.update(efficiency=figures,
                 roofline_mfu_bound=figures and figures["roofline_mfu_bound"],
                 mfu_estimate=figures and figures["mfu_estimate"])
    return entry


def chip_figures(chip: targets.Chip) -> dict:
    """The chip figures the report used, with their source."""
    return {"name": chip.name, "platform": chip.platform, "device_kind": chip.device_kind,
            "hbm_bytes": chip.hbm_bytes, "peak_flops": chip.peak_flops,
            "hbm_bandwidth": chip.hbm_bandwidth, "ici_bandwidth": chip.ici_bandwidth,
            "source": chip.source,
            "ici_source": efficiency.INTERCONNECT_SOURCES.get(chip.name, "")}


def formulas() -> dict:
    """The report's formulas, as text."""
    return {"roofline_seconds": ROOFLINE_FORMULA,
            "roofline_mfu_bound": ROOFLINE_MFU_BOUND_FORMULA,
            "mfu_estimate": MFU_ESTIMATE_FORMULA,
            "compile_seconds": "lower + compile, wall seconds on the compiling host",
            "hbm_total_bytes": "argument + output + temp - alias (per device)",
            "collective_bytes": "sum of the collectives' result bytes in the compiled HLO "
                                f"(per device; kinds {', '.join(COLLECTIVES)})",
            "scope": "every figure is per device, per call"}


def fallback_summary(entries: list[dict], while_building=()) -> list[dict]:
    """Every distinct kernel fall-back of the run: {kernel, platform, shapes, reason,
    programs} (the programs whose trace made it; empty for one made only while the driver
    built its programs, ``while_building``, e.g. by an ``eval_shape`` whose trace jax then
    reused for the compile)."""
    seen: dict[tuple, list[str]] = {}
    for e in entries:
        for f in e.get("kernel_fallbacks", ()):
            seen.setdefault(tuple(sorted(f.items())), []).append(e["name"])
    for f in while_building:
        seen.setdefault(tuple(sorted(f.items())), [])
    return [{**dict(k), "programs": v} for k, v in seen.items()]


def not_fitting_line(entry: dict, chip: targets.Chip) -> str:
    """``PROGRAM needs X GiB per device on CHIP; capacity Y GiB`` (with what X counts when it
    is the compiler's figure, or the compiler's words when its error names no bytes)."""
    mem = entry["memory"]
    cap = f"capacity {chip.hbm_bytes / GiB:.2f} GiB"
    if mem.get("total_bytes") is not None:
        return (f"{entry['name']} needs {mem['total_bytes'] / GiB:.2f} GiB per device on "
                f"{chip.name}; {cap}")
    if mem.get("required_bytes") is not None:
        return (f"{entry['name']} needs {mem['required_bytes'] / GiB:.2f} GiB per device on "
                f"{chip.name} (the compiler's figure for {mem['required_for']}); {cap}")
    return (f"{entry['name']} does not fit {chip.name}'s HBM ({cap} per device): "
            f"{entry.get('error', '')[:200]}")


_COLUMNS = ("program", "HBM GiB (total/cap)", "fits", "TFLOP", "coll MiB", "kernels",
            "XLA fallbacks", "roofline ms", "roofline MFU bound", "MFU estimate", "compile s")


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(entries: list[dict]) -> str:
    """One row per program: HBM total / capacity, fits, TFLOP (the roofline's, per device),
    collective MiB, kernels (Pallas [+ cuDNN]), kernels whose ``auto`` dispatch fell back to
    XLA (their names), roofline ms (">=": a program with loops, whose compiler bytes are a
    lower bound), the roofline MFU bound and the MFU estimate of a train step, and its lower +
    compile seconds."""
    rows = [_COLUMNS]
    for e in entries:
        mem = e["memory"]
        cap = f"{mem['capacity_bytes'] / GiB:.1f}"
        if mem.get("total_bytes") is not None:
            total = f"{mem['total_bytes'] / GiB:.2f}"
        elif mem.get("required_bytes") is not None:
            total = f">{mem['required_bytes'] / GiB:.2f}"
        else:
            total = "?"
        fallbacks = ",".join(sorted({f["kernel"] for f in e.get("kernel_fallbacks", ())})) or "-"
        took = sum(e.get("seconds", {}).values())
        took = f"{took:.1f}" if took else "-"
        if e["status"] == "failed":
            rows.append((e["name"], f"{total}/{cap}", "-", "-", "-", "-", fallbacks, "-",
                         "compile failed", "-", took))
            continue
        if "cost" not in e:  # refused by the compiler for HBM
            rows.append((e["name"], f"{total}/{cap}", "no", "-", "-", "-", fallbacks, "-", "-",
                         "-", took))
            continue
        k = e["kernels"]
        kernels = str(k["pallas_count"]) + (f"+{k['cudnn_count']} cudnn" if k["cudnn_count"]
                                            else "")
        rows.append((e["name"], f"{total}/{cap}", "yes" if mem["fits"] else "no",
                     f"{e['cost']['roofline_flops'] / 1e12:.3f}",
                     f"{e['collective_bytes'] / MiB:.1f}", kernels, fallbacks,
                     (">=" if e["cost"].get("bytes_lower_bound") else "")
                     + f"{e['roofline']['seconds'] * 1e3:.2f}",
                     _percent(e["roofline_mfu_bound"]), _percent(e["mfu_estimate"]), took))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
