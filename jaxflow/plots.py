"""PNG plots of the curves in a run's metrics.jsonl (one file per numeric metric, counters left
out; see :func:`is_counter`)."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Sequence

from jaxflow.metric_writers import COUNTER_NAMES, COUNTER_SUFFIXES, is_counter_name  # noqa: F401


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """Rows of a metrics.jsonl file ([] when it does not exist)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def is_counter(key: str, values: Sequence[float]) -> bool:
    """True when the field ``key`` with these logged ``values`` (in row order, as read from the
    JSON: ints stay ints) counts or identifies rather than measures, so it is not plotted:

    - its name is ``step``, ``seed`` or ``epoch``, ends in ``_index``, ``_seed`` or
      ``_version``, or starts with ``version/`` (identifiers,
      :func:`jaxflow.metric_writers.is_counter_name`); or
    - every value was logged as an integer (averaged metrics are floats) and the values never
      decrease, except by going back to the first value (a counter restarted per seed or sweep
      cell: ``rollout`` 1..N, 1..N; ``tokens_seen``); or
    - every value is the same whole number (a flag or size that never changed:
      ``sync_bit_exact`` = 1.0).

    An integer series that drops other than back to its start (correct answers per batch), and
    any float series that varies, whole-numbered or not (``sync_payload_bytes``), are plotted.
    """
    if is_counter_name(key):
        return True
    if not values:
        return False
    if all(v == values[0] for v in values) and float(values[0]).is_integer():
        return True
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return False
    return all(b >= a or b == values[0] for a, b in zip(values, values[1:]))


def _title(run_dir: pathlib.Path) -> str:
    """The experiment's name from the run's config.json, else the directory's name."""
    try:
        return str(json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["experiment"])
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name


def plot_metrics(run_dir: str | pathlib.Path, max_plots: int = 24, *,
                 title: str | None = None) -> list[pathlib.Path]:
    """Writes ``run_dir/plots/<metric>.png`` for every numeric metric logged at >= 2 steps that
    is not a counter (:func:`is_counter`), at most ``max_plots``; each titled ``"<title>:
    <metric>"`` (``title``: the experiment's name; default from ``run_dir/config.json``), its
    step axis with integer ticks. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = pathlib.Path(run_dir)
    title = _title(run_dir) if title is None else title
    series: dict[str, list[tuple[float, float]]] = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        step = row.get("step")
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((step, value))
    curves = {k: p for k, p in series.items() if len(p) >= 2 and not is_counter(k, [v for _, v in p])}
    written = []
    for key, points in list(curves.items())[:max_plots]:
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=90)
        xs, ys = zip(*points)
        ax.plot(xs, ys, lw=1.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{title}: {key}", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        out = run_dir / "plots" / f"{key.replace('/', '_')}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
        plt.close(fig)
        written.append(out)
    return written
