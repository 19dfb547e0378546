"""The ``sync_cost_model`` experiment: projected wire time of a full vs a sparse weight sync.

Wire time only: bytes / link bandwidth, bf16 weights (2 bytes per parameter) for the dense
sync and dense / ratio for each codec, the ratio being the median ratio vs dense that
``sparse_sync`` measured on a real GRPO run (its summary.json; the newest under
``runs/sparse_sync`` unless ``source`` names one). Codec (encode / apply) time is not modelled:
it was measured on this CPU only, not on an H200. The assumption that a large model shows the
same changed fraction as the small measured one is the caveat of the whole table; the paper's
measured full-vs-sparse broadcast times are reported beside it for comparison.
"""

from __future__ import annotations

import json
import pathlib

from jaxflow.config import ConfigError
from jaxflow.experiment import RunContext

# SparseRL-Sync (arXiv 2605.07330): measured broadcast seconds, full -> sparse.
PAPER_TABLE = [
    {"model": "106B", "network": "InfiniBand", "full_s": 2.97, "sparse_s": 0.28, "speedup": 10.6},
    {"model": "106B", "network": "TCP", "full_s": 45.6, "sparse_s": 2.26, "speedup": 20.2},
    {"model": "671B", "network": "InfiniBand", "full_s": 18.8, "sparse_s": 1.31},
    {"model": "671B", "network": "TCP", "full_s": 288.6, "sparse_s": 10.5, "speedup": 27.4},
]


def find_source(source: str, runs_root: str) -> pathlib.Path:
    if source:
        path = pathlib.Path(source)
        path = path / "summary.json" if path.is_dir() else path
        if not path.exists():
            raise ConfigError(f"source={source!r}: no sparse_sync summary.json there; valid: a "
                              "sparse_sync run directory or its summary.json")
        return path
    found = sorted(pathlib.Path(runs_root).glob("sparse_sync/*/summary.json"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise ConfigError(f"no sparse_sync run under {runs_root}/sparse_sync; run "
                          "`python -m jaxflow.run --exp=sparse_sync --variant=quick` first "
                          "or pass --set source=PATH")
    return found[-1]


def project(params: float, gbps: float, ratio: float) -> dict:
    """Seconds to move ``params`` bf16 parameters over ``gbps`` Gbit/s, dense and sparse."""
    dense_bytes = 2.0 * params
    bytes_per_s = gbps * 1e9 / 8.0
    dense_s = dense_bytes / bytes_per_s
    return {"dense_bytes": dense_bytes, "sparse_bytes": dense_bytes / ratio,
            "dense_s": dense_s, "sparse_s": dense_s / ratio, "speedup": ratio}


def main(config, run: RunContext) -> dict:
    src = find_source(config.source, config.runs_root)
    measured = json.loads(src.read_text())
    ratios = {c: r for c, r in measured["ratio_vs_dense"].items()
              if c in config.codecs and r is not None}
    rows = []
    for model, params in config.models:
        for net, gbps in config.networks:
            for codec, ratio in ratios.items():
                rows.append({"model": model, "params": params, "network": net, "gbps": gbps,
                             "codec": codec, "ratio_vs_dense": ratio,
                             **project(params, gbps, ratio)})
    for r in rows:
        run.info(f"{r['model']:>5} {r['network']:>9} {r['codec']:>8}: dense {r['dense_s']:9.2f} s"
                 f" -> sparse {r['sparse_s']:8.3f} s ({r['ratio_vs_dense']:.1f}x)")
    return {"source": str(src), "measured_changed_fraction": measured.get(
                "changed_fraction_median"), "measured_interval": measured.get("ratio_interval"),
            "ratio_vs_dense": ratios, "rows": rows, "paper_table": PAPER_TABLE,
            "codec_time": "not modelled (no H200 measurement)"}
