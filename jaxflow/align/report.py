"""The report of an alignment study: per-method aggregates over seeds, a markdown table and
the held-out curves' plot.

``records``: one dict per (seed, method) cell, ``{"seed", "method", "curve": [{"step",
"heldout_greedy", ("heldout_pass1")}], "final": curve[-1], "first_step_metrics": {...}}``.
"""

from __future__ import annotations

import numpy as np


def aggregate(records: list[dict], methods) -> list[dict]:
    """Per method: final held-out accuracies' mean / sample std / min / max over seeds, and the
    seed-mean curve."""
    out = []
    for m in methods:
        recs = [r for r in records if r["method"] == m]
        row = {"method": m, "seeds": len(recs)}
        for key in ("heldout_greedy", "heldout_pass1"):
            vals = [r["final"][key] for r in recs if key in r["final"]]
            if vals:
                row[f"{key}_mean"] = float(np.mean(vals))
                row[f"{key}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
                row[f"{key}_min"], row[f"{key}_max"] = float(min(vals)), float(max(vals))
        steps = [c["step"] for c in recs[0]["curve"]]
        row["curve"] = [{"step": st, **{k: float(np.mean([r["curve"][i][k] for r in recs]))
                                        for k in recs[0]["curve"][i] if k != "step"}}
                        for i, st in enumerate(steps)]
        neg = [r["first_step_metrics"] for r in recs if "negative_tokens" in
               r["first_step_metrics"]]
        if neg:
            row["negative_kept_fraction_first_step"] = float(
                np.sum([n["negative_kept"] for n in neg]) /
                max(np.sum([n["negative_tokens"] for n in neg]), 1))
        out.append(row)
    return out


def format_table(results: list[dict], warm_eval: dict) -> str:
    """Markdown: one row per method, final held-out accuracy mean +- std (min..max)."""
    pass1 = "heldout_pass1_mean" in results[0]
    head = "| method | seeds | held-out greedy acc | " + ("held-out pass@1 (T=1) |" if pass1 else "")
    lines = [head, "|---|---|---|" + ("---|" if pass1 else "")]
    w = f"| warm start | - | {warm_eval['heldout_greedy']:.3f} | "
    lines.append(w + (f"{warm_eval['heldout_pass1']:.3f} |" if pass1 else ""))
    for r in results:
        def cell(k, r=r):
            return (f"{r[k + '_mean']:.3f} +- {r[k + '_std']:.3f} "
                    f"({r[k + '_min']:.3f}..{r[k + '_max']:.3f})")

        line = f"| {r['method']} | {r['seeds']} | {cell('heldout_greedy')} | "
        lines.append(line + (f"{cell('heldout_pass1')} |" if pass1 else ""))
    return "\n".join(lines)


def plot_curves(run, records: list[dict], methods) -> None:
    """plots/figa_curves.png (``run.save_figure``, primary process only): seed-mean held-out
    greedy accuracy vs step, min..max band."""
    if not run.is_primary:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for m in methods:
        recs = [r for r in records if r["method"] == m]
        x = [c["step"] for c in recs[0]["curve"]]
        y = np.array([[c["heldout_greedy"] for c in r["curve"]] for r in recs])
        ax.plot(x, y.mean(0), label=m)
        ax.fill_between(x, y.min(0), y.max(0), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"figa: seed mean ({len(recs)} seeds), band = min..max", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    run.save_figure(fig, "figa_curves.png")
