"""The machine a record was measured on: CPU model, the instruction-set flags that change
XLA:CPU's rounding, core count, and a short name for file names and tables.

Figures of one commit differ across machines (XLA:CPU picks other vector code for other ISA
flags), so a record names its machine and pages show every machine recorded.
"""

from __future__ import annotations

import os
import pathlib
import platform
import re

#: The CPU flags a record keeps (those that change which vector code XLA:CPU emits).
FLAGS_KEPT = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
              "amx_bf16", "amx_tile", "asimd", "sve")


def _cpuinfo(path: pathlib.Path) -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        text = path.read_text()
    except OSError:
        return platform.processor() or platform.machine(), flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), flags


def machine_info(cpuinfo: "str | os.PathLike" = "/proc/cpuinfo") -> dict:
    """``{"cpu_model", "flags", "cores", "short"}`` of this machine: ``flags`` is the subset of
    :data:`FLAGS_KEPT` the CPU has (sorted), ``cores`` ``os.cpu_count()``, ``short`` :func:`short_name`."""
    model, flags = _cpuinfo(pathlib.Path(cpuinfo))
    info = {"cpu_model": model, "flags": sorted(f for f in FLAGS_KEPT if f in flags),
            "cores": os.cpu_count() or 0}
    return info | {"short": short_name(info)}


def short_name(info: dict) -> str:
    """A file-name-safe name of a machine: the CPU model's words (vendor marks dropped), the
    core count, and ``avx512`` when the CPU has it, e.g. ``intel-xeon-2c-avx512``."""
    words = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@.*$|\bwith\b.*$", " ", info["cpu_model"])
    slug = re.sub(r"[^a-z0-9]+", "-", words.lower()).strip("-")[:32].strip("-") or "cpu"
    isa = "-avx512" if "avx512f" in info.get("flags", ()) else ""
    return f"{slug}-{info['cores']}c{isa}"
