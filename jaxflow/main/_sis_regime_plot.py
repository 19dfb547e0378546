"""``plots/sis_regime_map.png``: the regime map of ``sis_regime`` (final held-out pass@1 against
each off-policy knob, uncorrected, seed means with 95% t-intervals of the difference to N = 1),
with every correction's seed mean overlaid at the phase-2 settings."""

from __future__ import annotations

import pathlib

import numpy as np

_PANELS = (("lag", "policy lag N (updates per rollout)"), ("lr", "lr scale (N=1 solid, N=8 dashed)"),
           ("staleness", "async staleness k (rollouts)"), ("mismatch", "sampler mismatch"))
_MARKERS = {"sis": "o", "tis": "s", "mis": "^", "rs": "v", "sis+tis": "D", "none": "x"}


def _x(family: str, value, mismatches: list) -> float:
    if family == "lr":
        return float(value[0])
    if family == "mismatch":
        return float(mismatches.index(value))
    return float(value)


def plot_regime_map(out: pathlib.Path, regime: list[dict], compared: list[dict],
                    chosen: dict[str, dict]) -> pathlib.Path | None:
    """Writes the figure; returns its path (None without regime rows)."""
    if not regime:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    base = next(r for r in regime if r["family"] == "lag" and r["value"] == 1)
    mismatches = [r["value"] for r in regime if r["family"] == "mismatch"]
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4), dpi=90, sharey=True)
    for ax, (family, title) in zip(axes, _PANELS):
        rows = [r for r in regime if r["family"] == family]
        if family in ("staleness", "mismatch", "lr"):
            rows = [base] + rows if family != "lr" else rows
        groups = ({n: [r for r in rows if r["value"][1] == n] for n in
                   sorted({r["value"][1] for r in rows})} if family == "lr" else {None: rows})
        for n, grp in groups.items():
            if family == "lr":
                grp = [dict(base, value=[1.0, n])] + grp if n == 1 else grp
            xs = [0.0 if (r is base and family == "staleness") else
                  (-1.0 if (r is base and family == "mismatch") else _x(family, r["value"],
                                                                         mismatches))
                  for r in grp]
            ys = [r["final_mean"] for r in grp]
            err = [r["half_width"] for r in grp]
            ax.errorbar(xs, ys, yerr=err, marker="x", ls="-" if n in (None, 1) else "--",
                        color="k", capsize=2, label="none" + (f" N={n}" if n else ""))
        pick = chosen.get(family)
        if pick is not None:
            key_match = [r for r in compared if _family_value(r) == (family, _norm(pick["value"]))]
            by: dict[tuple, list[float]] = {}
            for r in key_match:
                by.setdefault((r["algo"], r["correction"]), []).append(r["final_accuracy"])
            x0 = _x(family, pick["value"], mismatches)
            for i, ((algo, corr), vals) in enumerate(sorted(by.items())):
                ax.plot(x0 + 0.08 * (i - len(by) / 2), np.mean(vals),
                        _MARKERS.get(corr, "."), ms=5, label=f"{algo} {corr}",
                        color="C0" if algo == "grpo" else "C1", fillstyle="none")
        if family == "mismatch":
            ax.set_xticks([-1.0, *range(len(mismatches))], ["none", *mismatches], rotation=30,
                          fontsize=7)
        elif family in ("lag", "staleness"):
            ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel(title, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final held-out pass@1")
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, fontsize=6, loc="lower center", ncol=min(len(labels), 8))
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = out / "sis_regime_map.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _norm(value):
    return list(value) if isinstance(value, tuple) else value


def _family_value(rec: dict) -> tuple:
    """(family, value) of a phase-2 record, in :func:`jaxflow.main.sis_regime.regime_rows`'
    terms."""
    if rec["mismatch"] != "none":
        return "mismatch", rec["mismatch"]
    if rec["staleness"]:
        return "staleness", rec["staleness"]
    if rec.get("lr_scale", 1.0) != 1.0:
        return "lr", [rec["lr_scale"], rec["lag"]]
    return "lag", rec["lag"]
