"""Headline builders of the learning experiments (``HEADLINES`` of ``configs/<name>.py``): RL
(flagship, rl, the SIS studies), alignment (figa), recommendation (oxygenrec), data selection
(decoratelm), pruning calibration, pretraining and weight sync. Each reads the experiment's
summary and returns its :class:`jaxflow.study.Headline` list; accuracy figures carry the 95%
t-interval over paired seeds where the summary holds per-seed figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxflow.study.headline import Headline, headline_from_arms

__all__ = ["flagship", "rl", "figa", "sis_offpolicy", "sis_regime", "sis_exact_gradient", "lm_pretrain",
           "oxygenrec", "decoratelm", "calibration_tradeoffs", "sparse_sync", "sync_cost_model",
           "sis_vs_strongest", "corrections_study"]


def _by_seed(rows: Sequence[Mapping[str, Any]], key: str) -> dict[int, float]:
    return {i: float(r[key]) for i, r in enumerate(rows) if r.get(key) is not None}


def _rl_gain(summary: Mapping[str, Any], algorithm: str) -> Headline:
    per_seed = summary.get("per_seed") or []
    final = _by_seed(per_seed, "heldout_pass_at_1_final")
    initial = _by_seed(per_seed, "heldout_pass_at_1_initial")
    return headline_from_arms(
        "heldout_pass_at_1_gain", "held-out pass@1 after RL minus the warm start's", algorithm,
        {algorithm: summary["heldout_pass_at_1_final"], "warm start": summary["heldout_pass_at_1_initial"]},
        baselines=("warm start",), compare="difference", unit="pass@1",
        per_seed={algorithm: final, "warm start": initial} if final else None)


def flagship(summary: Mapping[str, Any]) -> list[Headline]:
    """The held-out pass@1 gain over the warm start, and SparseRL-Sync's bytes vs the dense
    bf16 sync baseline (the ratio dense / sent; absent with ``sync=none``)."""
    out = [_rl_gain(summary, "GRPO + SIS + SparseRL-Sync")]
    per_seed = [s for s in summary.get("per_seed") or [] if s.get("sync_sent_bytes")]
    if summary.get("sync_ratio_vs_dense") is not None and per_seed:
        sent, dense = _by_seed(per_seed, "sync_sent_bytes"), _by_seed(per_seed, "sync_dense_bytes")
        out.append(headline_from_arms(
            "sync_ratio_vs_dense", "weight-sync bytes per run (dense / sent)", "SparseRL-Sync",
            {"SparseRL-Sync": sum(sent.values()) / len(sent), "dense bf16": sum(dense.values()) / len(dense)},
            baselines=("dense bf16",), higher_is_better=False,
            per_seed={"SparseRL-Sync": sent, "dense bf16": dense}))
    return out


def rl(summary: Mapping[str, Any]) -> list[Headline]:
    """The held-out pass@1 gain over the starting checkpoint (per-seed paired interval)."""
    return [_rl_gain(summary, f"{summary.get('task', 'rl')} RL")]


def figa(summary: Mapping[str, Any]) -> list[Headline]:
    """FIGA's final held-out greedy accuracy minus the strongest other method trained in the
    run (SFT on revisions, DPO; not the figa_constant ablation)."""
    means = {r["method"]: r.get("heldout_greedy_mean") for r in summary["results"]}
    per_seed = {m: {int(s): float(v) for s, v in by.items()}
                for m, by in (summary.get("final_by_seed") or {}).items()}
    return [headline_from_arms(
        "figa_vs_strongest", "final held-out greedy accuracy difference", "figa", means,
        baselines=[m for m in means if m not in ("figa", "figa_constant")], compare="difference",
        unit="accuracy", per_seed=per_seed or None, target=0.0,
        target_text="> 0: FIGA above the strongest baseline", )]


def sis_vs_strongest(rows: Sequence[Mapping[str, Any]], arm: str = "sis") -> list[Headline]:
    """Per setting (algo, mismatch, lag, staleness, lr scale, prompts) of the
    ``jaxflow.rl.offpolicy_report.aggregate`` rows that ran ``arm``: its final held-out pass@1
    minus the strongest other correction (``none`` included) of that setting, with the paired
    t-interval over seeds (the rows' ``acc_per_seed``, in seed order)."""
    groups: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        key = tuple(r.get(k) for k in ("algo", "mismatch", "lag", "staleness", "lr_scale", "prompts"))
        groups.setdefault(key, {})[r["correction"]] = r
    out = []
    for (algo, mismatch, lag, k, lr_scale, prompts), by in groups.items():
        if arm not in by or len(by) < 2:
            continue
        setting = f"{algo}, mismatch={mismatch}, lag={lag}, k={k}" + (
            f", lr x{lr_scale}" if lr_scale not in (None, 1, 1.0) else "") + (
            f", prompts={prompts}" if prompts is not None else "")
        out.append(headline_from_arms(
            f"{arm}_vs_strongest[{setting}]", "final held-out pass@1 difference", f"{algo} + {arm}",
            {c: r["acc_mean"] for c, r in by.items()}, arm=arm, baselines=[c for c in by if c != arm],
            compare="difference", unit="pass@1",
            per_seed={c: dict(enumerate(r.get("acc_per_seed") or ())) for c, r in by.items()}))
    return out


def sis_offpolicy(summary: Mapping[str, Any]) -> list[Headline]:
    """SIS vs the strongest other correction in every setting the study ran
    (:func:`sis_vs_strongest` of ``results``)."""
    return sis_vs_strongest(summary["results"])


def sis_regime(summary: Mapping[str, Any]) -> list[Headline]:
    """SIS vs the strongest other correction in the chosen off-policy regime(s)
    (:func:`sis_vs_strongest` of ``compare``)."""
    return sis_vs_strongest(summary["compare"])


def corrections_study(summary: Mapping[str, Any]) -> list[Headline]:
    """Per regime and algorithm, the correction with the best mean final held-out pass@1
    (``none`` included) minus the strongest other one, and in the MoE regime R3 against no R3,
    each with the paired t-interval over seeds (``summary["finals"]``: per (regime, algo,
    correction, moe) ``{seed: final pass@1}``)."""
    blocks: dict[tuple, dict[str, dict]] = {}
    for row in summary["finals"]:
        if row["regime"] in ("staleness", "lr"):
            blocks.setdefault((row["regime"], row["algo"]), {})[row["correction"]] = row["per_seed"]
        elif row["regime"] == "moe":
            arm = "r3" if row["moe"] == "replay" else "no r3"
            blocks.setdefault(("moe", row["algo"], row["correction"]), {})[arm] = row["per_seed"]
    out = []
    for key, arms in blocks.items():
        means = {a: sum(v.values()) / len(v) for a, v in arms.items() if v}
        if len(means) < 2:
            continue
        if key[0] == "moe":
            if set(means) != {"r3", "no r3"}:
                continue
            name, algorithm, arm = f"r3_vs_no_r3[moe, {key[1]}, {key[2]}]", f"{key[1]} + {key[2]} + R3", "r3"
        else:
            arm = max(means, key=lambda a: (means[a], a == "none"))
            name, algorithm = f"best_correction_vs_strongest[{key[0]}, {key[1]}]", f"{key[1]} + {arm}"
        out.append(headline_from_arms(name, "final held-out pass@1 difference", algorithm, means, arm=arm,
                                      baselines=[a for a in means if a != arm], compare="difference",
                                      unit="pass@1", per_seed=arms))
    return out


def sis_exact_gradient(summary: Mapping[str, Any]) -> list[Headline]:
    """At the largest perturbation, per algorithm: the strongest other estimator's gradient
    MSE over SIS's (> 1: SIS is closer to the exact gradient); sequence IS is a baseline of
    every algorithm."""
    rows = summary["estimators"]
    top = max(r["perturbation"] for r in rows)
    at = [r for r in rows if r["perturbation"] == top]
    out = []
    for algo in dict.fromkeys(r["algo"] for r in at if r["name"] == "sis"):
        arms = {r["name"]: r["mse"] for r in at if r["algo"] in (algo, "seq_is") or
                (algo == "grpo" and r["name"] in ("tis", "mis"))}
        out.append(headline_from_arms(
            f"sis_gradient_mse_vs_strongest[{algo}, perturbation={top:g}]",
            "exact-gradient MSE ratio (baseline / SIS)", f"{algo} + sis", arms, arm="sis",
            baselines=[n for n in arms if n != "sis"], higher_is_better=False))
    return out


def lm_pretrain(summary: Mapping[str, Any]) -> list[Headline]:
    """Held-out exact-match accuracy of the pretrained LM (one run, no baseline)."""
    return [headline_from_arms("heldout_accuracy", "held-out exact-match accuracy", "lm", {
        "lm": summary["heldout_accuracy"]}, baselines=(), compare="value", unit="accuracy")]


def oxygenrec(summary: Mapping[str, Any]) -> list[Headline]:
    """OxygenREC's recall@k minus the strongest other system of the run (TIGER, its
    instruction variant, SASRec, popularity), with the paired t-interval over seeds."""
    keys = [k for k in summary if k.startswith("recall_at_") and not k.endswith("_std")]
    if not keys:
        raise KeyError("recall_at_<k>: the oxygenrec summary has no recall figure")
    key = keys[0]
    per_seed = {}
    for i, row in enumerate(summary.get("per_seed") or []):
        for system, figs in row.items():
            per_seed.setdefault(system, {})[i] = figs["recall"]
    return [headline_from_arms(
        "recall_vs_strongest", f"{key.replace('_at_', '@')} difference", "oxygenrec", summary[key],
        baselines=[s for s in summary[key] if s != "oxygenrec"], compare="difference", unit="recall",
        per_seed=per_seed or None)]


def decoratelm(summary: Mapping[str, Any]) -> list[Headline]:
    """The full DecorateLM selection (rating + tags + edit): held-out real-text perplexity of
    the strongest other selection arm over its own (> 1: lower perplexity); the teacher arm
    (the teacher's labels on the whole pool) is an upper reference, not a baseline."""
    arm = "rating+tags+edit"
    per_seed = {a: {i: float(r["heldout_real_ppl"]) for i, r in enumerate(rs)}
                for a, rs in (summary.get("per_seed") or {}).items()}
    ppl = summary["heldout_real_ppl"]
    return [headline_from_arms(
        "heldout_ppl_vs_strongest", "held-out real-text perplexity ratio (baseline / DecorateLM)",
        "decoratelm " + arm, ppl, arm=arm, baselines=[a for a in ppl if a not in (arm, "teacher")],
        higher_is_better=False, per_seed=per_seed or None)]


def calibration_tradeoffs(summary: Mapping[str, Any]) -> list[Headline]:
    """The mixed calibration set's total capability retention minus the best single source's
    at the reported sparsity (the best single source's own figure without a mix)."""
    at = str(summary["spearman_sparsity"])
    totals = {s: by[at] for s, by in summary["total_retention"].items() if at in by}
    arm = next((s for s in ("mix", "igsp") if s in totals), None)
    singles = [s for s in totals if s not in ("mix", "igsp")]
    if arm is None:
        best = summary["best_single_source"]["source"]
        return [headline_from_arms(f"best_single_source_retention[sparsity {at}]", "total retention",
                                   best, totals, arm=best, baselines=(), compare="value", unit="retention")]
    return [headline_from_arms(f"{arm}_vs_best_single_source[sparsity {at}]", "total retention difference",
                               f"sparsegpt calibrated on {arm}", totals, arm=arm, baselines=singles,
                               compare="difference", unit="retention")]


def sparse_sync(summary: Mapping[str, Any]) -> list[Headline]:
    """The auto codec's weight-sync bytes against dense bf16 on real GRPO publishes (the
    ratio dense / sent at the first sync interval)."""
    ratios = summary["ratio_vs_dense"]
    arm = "auto" if "auto" in ratios else max(ratios, key=lambda c: ratios[c] or 0.0)
    return [headline_from_arms(
        "sync_bytes_vs_dense", f"weight-sync bytes ratio (dense / sent, every {summary.get('ratio_interval')} "
        "steps)", f"SparseRL-Sync {arm}", {arm: 1.0 / ratios[arm], "dense bf16": 1.0}, arm=arm,
        baselines=("dense bf16",), higher_is_better=False)]


def sync_cost_model(summary: Mapping[str, Any]) -> list[Headline]:
    """The projected wire-time speed-up of the auto codec over dense bf16 (the measured bytes
    ratio it is projected from; the codec's own time is not modelled)."""
    ratios = summary["ratio_vs_dense"]
    arm = "auto" if "auto" in ratios else max(ratios, key=lambda c: ratios[c])
    return [headline_from_arms(
        "projected_wire_speedup", "projected sync wire-time ratio (dense / sparse)", f"SparseRL-Sync {arm}",
        {arm: 1.0 / ratios[arm], "dense bf16": 1.0}, arm=arm, baselines=("dense bf16",), higher_is_better=False)]
