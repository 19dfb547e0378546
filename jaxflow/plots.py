"""PNG plots of the curves in a run's metrics.jsonl (one file per numeric metric)."""

from __future__ import annotations

import json
import math
import pathlib


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """Rows of a metrics.jsonl file ([] when it does not exist)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_metrics(run_dir: str | pathlib.Path, max_plots: int = 24) -> list[pathlib.Path]:
    """Writes ``run_dir/plots/<metric>.png`` for every numeric metric logged at >= 2 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = pathlib.Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        step = row.get("step")
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((step, value))
    written = []
    for key, points in list(series.items())[:max_plots]:
        if len(points) < 2:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=90)
        xs, ys = zip(*points)
        ax.plot(xs, ys, lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{run_dir.parent.name}: {key}", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        out = run_dir / "plots" / f"{key.replace('/', '_')}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
        plt.close(fig)
        written.append(out)
    return written
