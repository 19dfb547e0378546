"""Results of an off-policy RL study (:mod:`jaxflow.rl.offpolicy_cells`): seed means per
setting, paired correction-minus-control differences, their markdown tables and the curves'
plots.

Records are the cells' ``cells.jsonl`` dicts (:func:`jaxflow.rl.offpolicy_cells.run_cell`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.rl.offpolicy_cells import group_key
from jaxflow.study import format_bounds, format_pm, mean_of, normalized_auc, paired_interval, sample_sd

__all__ = ["aggregate", "paired_differences", "format_table", "format_paired_table", "plot_curves"]


def aggregate(records: Sequence[dict]) -> list[dict]:
    """Rows {algo, correction, mismatch, lag, staleness, seeds, acc_mean, acc_std, ...}, one per
    setting (:func:`jaxflow.rl.offpolicy_cells.group_key`) in first-seen order.

    acc = final held-out pass@1 at the RL temperature (``train.eval_samples`` samples per
    prompt); greedy_acc = final held-out greedy accuracy. Stds are sample stds over seeds
    (ddof=1; 0.0 for one seed)."""
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault(group_key(rec), []).append(rec)
    rows = []
    for (algo, corr, mismatch, lag, k, lr_scale, prompts), recs in groups.items():
        accs = [float(r["final_accuracy"]) for r in recs]
        greedy = [float(r["final_greedy_accuracy"]) for r in recs]
        sis = corr.startswith("sis")
        rows.append({
            "algo": algo, "correction": corr, "mismatch": mismatch, "lag": lag, "staleness": k,
            "lr_scale": lr_scale, "prompts": prompts, "seeds": len(recs),
            "acc_mean": float(np.mean(np.array(accs, np.float64))),
            "acc_std": sample_sd(accs),
            "acc_per_seed": accs,
            "auc_mean": float(np.mean([normalized_auc(r["curve"]) for r in recs])),
            "greedy_acc_mean": float(np.mean(np.array(greedy, np.float64))),
            "greedy_acc_std": sample_sd(greedy),
            # SIS accept rates (None without SIS); "later" = mini-batches 2..N of a rollout
            "accept_rate": mean_of(recs, "accept_rate") if sis else None,
            "accept_rate_later": mean_of(recs, "accept_rate_later") if sis else None,
            "clip_fraction": mean_of(recs, "clip_fraction"),
            "d_original": mean_of(recs, "d_original"),
            "sis_accept_expected": mean_of(recs, "sis_accept_expected"),
            "reward_first": mean_of(recs, "reward_first"),
            "reward_last": mean_of(recs, "reward_last"),
            "reward_last5": mean_of(recs, "reward_last5"),
        })
    return rows


def _final_accuracy(record: dict) -> float:
    return record["final_accuracy"]


def _auc(record: dict) -> float:
    return normalized_auc(record["curve"])


def paired_differences(records: Sequence[dict], *, control: str = "none",
                       level: float = 0.95) -> list[dict]:
    """Per (algo, mismatch, lag, staleness) and correction != ``control``: the paired
    correction-minus-control difference over the seeds both ran (same seed = same warm start,
    prompts and sampling keys), of the final held-out pass@1 (``final``) and of the area under
    the pass@1 curve divided by its length (``auc``; :func:`jaxflow.stats.normalized_auc`).
    Each as mean, t-interval half width and bootstrap bounds
    (:func:`jaxflow.stats.paired_interval`)."""
    by: dict[tuple, dict[str, dict[int, dict]]] = {}
    for rec in records:
        algo, corr, mismatch, lag, k, lr_scale, prompts = group_key(rec)
        key = (algo, mismatch, lag, k, lr_scale, prompts)
        by.setdefault(key, {}).setdefault(corr, {})[rec["seed"]] = rec
    rows = []
    for (algo, mismatch, lag, k, lr_scale, prompts), corrs in by.items():
        if control not in corrs:
            continue
        for corr, recs in corrs.items():
            seeds = sorted(set(recs) & set(corrs[control]))
            if corr == control or not seeds:
                continue
            row = {"algo": algo, "correction": corr, "control": control, "mismatch": mismatch,
                   "lag": lag, "staleness": k, "lr_scale": lr_scale, "prompts": prompts,
                   "pairs": len(seeds)}
            for name, value in (("final", _final_accuracy), ("auc", _auc)):
                iv = paired_interval([value(recs[s]) for s in seeds],
                                     [value(corrs[control][s]) for s in seeds], level=level)
                row.update({f"{name}_diff": iv.mean, f"{name}_half_width": iv.half_width,
                            f"{name}_sd": iv.sd, f"{name}_boot": [iv.boot_low, iv.boot_high]})
            rows.append(row)
    return rows


def format_paired_table(rows: Sequence[dict]) -> str:
    """A markdown table of :func:`paired_differences` rows (95% t-intervals, bootstrap)."""
    head = ("| algo | correction - control | mismatch | lag | k | pairs | final pass@1 diff "
            "(95% t) | bootstrap | AUC diff (95% t) | bootstrap |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['algo']} | {r['correction']} - {r['control']} | {r['mismatch']} | "
             f"{r['lag']} | {r['staleness']} | {r['pairs']} | "
             f"{format_pm(r['final_diff'], r['final_half_width'])} | {format_bounds(r['final_boot'])} | "
             f"{format_pm(r['auc_diff'], r['auc_half_width'])} | {format_bounds(r['auc_boot'])} |"
             for r in rows]
    return "\n".join([head, *lines])


def format_table(rows: Sequence[dict]) -> str:
    """A markdown table of :func:`aggregate` rows."""
    head = ("| algo | correction | mismatch | lag | k | seeds | acc_mean | acc_std | greedy_mean | "
            "greedy_std | train reward (last 5) | accept | accept (mb>1) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"| {r['algo']} | {r['correction']} | {r['mismatch']} | {r['lag']} | "
             f"{r['staleness']} | {r['seeds']} | {r['acc_mean']:.3f} | {r['acc_std']:.3f} | "
             f"{r['greedy_acc_mean']:.3f} | {r['greedy_acc_std']:.3f} | {fmt(r['reward_last5'])} | "
             f"{fmt(r['accept_rate'])} | {fmt(r['accept_rate_later'])} |" for r in rows]
    return "\n".join([head, *lines])


def plot_curves(run: RunContext, records: Sequence[dict], *, prefix: str = "sis_offpolicy") -> None:
    """plots/<prefix>_<algo>.png: seed-mean held-out accuracy vs rollout, one line per
    (correction, mismatch, lag, staleness) (process 0 only)."""
    if not run.is_primary or not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_algo: dict[str, dict[tuple, list]] = {}
    for rec in records:
        key = (rec["correction"], rec["mismatch"], rec["lag"], rec["staleness"])
        by_algo.setdefault(rec["algo"], {}).setdefault(key, []).append(rec["curve"])
    out = run.out_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    for algo, lines in by_algo.items():
        fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
        for (corr, mismatch, lag, k), curves in sorted(lines.items()):
            steps = [s for s, _ in curves[0]]
            acc = np.mean([[a for _, a in c] for c in curves if len(c) == len(steps)], axis=0)
            style = "-" if corr.startswith("sis") else "--"
            ax.plot(steps, acc, style, marker="o", ms=3,
                    label=f"{corr} {mismatch} N={lag} k={k} ({len(curves)} seeds)")
        ax.set_xlabel("rollout")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"{prefix}: {algo}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"{prefix}_{algo}.png")
        plt.close(fig)
