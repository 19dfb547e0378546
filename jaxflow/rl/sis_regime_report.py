"""The ``sis_regime`` study's report: the regime table, each phase-2 control against lag 1, the
corrections' comparison, their wall-time overheads (markdown), and ``plots/sis_regime_map.png``
(final held-out pass@1 against each off-policy knob, uncorrected, seed means with 95%
t-intervals of the difference to N = 1, every correction's seed mean overlaid at the phase-2
settings). Rows come from :mod:`jaxflow.rl.sis_regime` and :mod:`jaxflow.rl.offpolicy_report`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from jaxflow.rl.sis_regime import record_setting
from jaxflow.study import format_bounds, format_pm

__all__ = ["format_regime_table", "format_degradation", "format_compare", "format_overheads",
           "plot_regime_map"]


def format_regime_table(rows: Sequence[dict], baseline: float | None) -> str:
    """Markdown: one row per phase-1 setting (:func:`jaxflow.rl.sis_regime.regime_rows`), after
    the lag-1 ``baseline``'s final pass@1."""
    def f(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    lines = [f"Baseline (N=1, on-policy) final pass@1: {f(baseline)}", "",
             "| knob | setting | seeds | final pass@1 (sd) | minus N=1 (95% t) | in regime | "
             "clip frac | D_original | SIS accept (would be) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['setting']} | {r['seeds']} | {f(r['final_mean'])} "
              f"({f(r['final_sd'])}) | {format_pm(r['diff'], r['half_width'])} | "
              f"{'yes' if r['in_regime'] else 'no'} | {f(r['clip_fraction'], '.4f')} | "
              f"{f(r['d_original'], '.4f')} | {f(r['sis_accept_expected'])} |" for r in rows]
    return "\n".join(lines)


def format_degradation(rows: Sequence[dict]) -> str:
    """Markdown: each phase-2 setting's uncorrected run against lag 1
    (:func:`jaxflow.rl.sis_regime.control_degradation`)."""
    lines = ["| algo | mismatch | N | k | pairs | none final pass@1 | minus N=1 none (95% t) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['mismatch']} | {r['lag']} | {r['staleness']} | {r['pairs']} | "
              f"{r['final_mean']:.3f} | {format_pm(r['diff'], r['half_width'])} |" for r in rows]
    return "\n".join(lines)


def format_compare(rows: Sequence[dict], paired: Sequence[dict]) -> str:
    """Markdown: per (algo, setting, correction) the seed-mean final pass@1 and AUC
    (:func:`jaxflow.rl.offpolicy_report.aggregate` rows), and the paired correction-minus-none
    differences (``paired_differences`` rows; 95% t-interval, bootstrap)."""
    diffs = {(p["algo"], record_setting(p), p["correction"]): p for p in paired}
    lines = ["| algo | setting | correction | seeds | final pass@1 (sd) | AUC | SIS accept "
             "(mb > 1) | final - none (95% t) | bootstrap | AUC - none (95% t) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (record_setting(r), r["algo"])):
        d = diffs.get((r["algo"], record_setting(r), r["correction"]))
        acc = "-" if r["accept_rate_later"] is None else f"{r['accept_rate_later']:.3f}"
        tail = ("- | - | -" if d is None else
                f"{format_pm(d['final_diff'], d['final_half_width'])} | "
                f"{format_bounds(d['final_boot'])} | {format_pm(d['auc_diff'], d['auc_half_width'])}")
        lines.append(f"| {r['algo']} | {record_setting(r)} | {r['correction']} | {r['seeds']} | "
                     f"{r['acc_mean']:.3f} ({r['acc_std']:.3f}) | {r['auc_mean']:.3f} | {acc} | "
                     f"{tail} |")
    return "\n".join(lines)


def format_overheads(rows: Sequence[dict]) -> str:
    """Markdown: wall-time ratio of each correction to none
    (:func:`jaxflow.rl.sis_regime.overheads`)."""
    lines = ["| algo | mismatch | N | k | correction | pairs | rollout time / none's (median) "
             "| range |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['mismatch']} | {r['lag']} | {r['staleness']} | "
              f"{r['correction']} | {r['pairs']} | {r['time_ratio_median']:.3f} | "
              f"[{r['time_ratio_range'][0]:.3f}, {r['time_ratio_range'][1]:.3f}] |" for r in rows]
    return "\n".join(lines)

_PANELS = (("lag", "policy lag N (updates per rollout)"), ("lr", "lr scale (N=1 solid, N=8 dashed)"),
           ("staleness", "async staleness k (rollouts)"), ("mismatch", "sampler mismatch"))
_MARKERS = {"sis": "o", "tis": "s", "mis": "^", "rs": "v", "sis+tis": "D", "none": "x"}


def _x(family: str, value, mismatches: list) -> float:
    if family == "lr":
        return float(value[0])
    if family == "mismatch":
        return float(mismatches.index(value))
    return float(value)


def plot_regime_map(out: pathlib.Path, regime: Sequence[dict], compared: Sequence[dict],
                    chosen: Mapping[str, dict]) -> pathlib.Path | None:
    """Writes ``out/sis_regime_map.png``: one panel per knob family of the ``regime`` rows, the
    ``compared`` phase-2 records' seed means at the ``chosen`` settings; returns its path (None
    without regime rows)."""
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
    """(family, value) of a phase-2 record, in :func:`jaxflow.rl.sis_regime.regime_rows`'
    terms."""
    if rec["mismatch"] != "none":
        return "mismatch", rec["mismatch"]
    if rec["staleness"]:
        return "staleness", rec["staleness"]
    if rec.get("lr_scale", 1.0) != 1.0:
        return "lr", [rec["lr_scale"], rec["lag"]]
    return "lag", rec["lag"]
