"""The ``corrections_study`` report (markdown): the ranking of the corrections per regime, the
regimes' uncorrected runs against lag 1, R3 in the MoE regime with the router disagreement, and
where the overhead figures come from. Rows come from :mod:`jaxflow.rl.corrections_study`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxflow.study import format_pm

__all__ = ["REGIME_WORDS", "format_ranking", "format_controls", "format_r3", "format_overhead_sources",
           "seed_figures"]

#: each regime in the tables' words (``configs.corrections_study.StudyGrid`` fields)
REGIME_WORDS = {"staleness": "async staleness k={staleness}, N={inner_lag}",
                "lr": "lr x{lr_scale:g} at policy lag N={lr_lag}",
                "moe": "Qwen3-MoE, {moe_mismatch} sampler vs f32 trainer, N={moe_lag}"}


def _f(value, fmt=".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _pm(mean, half) -> str:
    if mean is None:
        return "-"
    return format_pm(mean, half) if half is not None else f"{mean:+.3f} (1 pair)"


def format_ranking(rows: Sequence[Mapping], study) -> str:
    """Markdown: one table per (regime, algorithm) of :func:`jaxflow.rl.corrections_study.
    rank_corrections` rows, best correction first."""
    out = []
    blocks = dict.fromkeys((r["regime"], r["algo"]) for r in rows)
    for regime, algo in blocks:
        out += [f"**{algo}, {REGIME_WORDS[regime].format(**vars(study))}**", "",
                "| rank | correction | seeds | final pass@1 | minus none (95% t) | AUC minus none | "
                "masked share | KL(mu, pi_old) | loss-step time / none's [range] |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if (r["regime"], r["algo"]) == (regime, algo)):
            over = _f(r["overhead"]) + ("" if r["overhead_range"] is None else
                                        f" [{r['overhead_range'][0]:.2f}, {r['overhead_range'][1]:.2f}]")
            out.append(f"| {r['rank']} | {r['correction']} | {r['seeds']} | {_f(r['final_mean'])} | "
                       f"{_pm(r['diff'], r['half_width'])} | {_pm(r['auc_diff'], r['auc_half_width'])} | "
                       f"{_f(r['masked_fraction'], '.4f')} | {_f(r['mismatch_kl'], '.2e')} | {over} |")
        out.append("")
    return "\n".join(out) if out else "(no dense-regime correction has a paired none seed yet)"


def format_controls(rows: Sequence[Mapping]) -> str:
    """Markdown: each dense regime's uncorrected run minus the lag-1 run
    (:func:`jaxflow.rl.corrections_study.lag1_controls`)."""
    lines = ["Each regime's uncorrected run against the on-policy lag-1 run (is it degraded?):", "",
             "| regime | algo | seeds | none final pass@1 | lag-1 final pass@1 | minus lag 1 (95% t) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['regime']} | {r['algo']} | {r['seeds']} | {r['final_mean']:.3f} | {r['lag1_mean']:.3f} | "
              f"{_pm(r['diff'], r['half_width'])} |" for r in rows]
    return "\n".join(lines)


def format_r3(rows: Sequence[Mapping]) -> str:
    """Markdown: R3 against no R3 in the MoE regime, and the router disagreement measured in
    each arm (:func:`jaxflow.rl.corrections_study.r3_rows`)."""
    def dis(r, arm):
        rng = r[f"disagreement_{arm}_range"]
        return "-" if rng is None else f"{r[f'disagreement_{arm}']:.4f} [{rng[0]:.4f}, {rng[1]:.4f}]"

    lines = ["MoE regime: routing replay (R3) against none, and the measured router disagreement:", "",
             "| algo | correction | seeds | no R3 final | R3 final | R3 minus no R3 (95% t) | router "
             "disagreement, no R3 (mean [min, max] over seeds) | with R3 |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['correction']} | {r['seeds']} | {_f(r['final_no_r3'])} | {_f(r['final_r3'])} | "
              f"{_pm(r['diff'], r['half_width'])} | {dis(r, 'record')} | {dis(r, 'replay')} |" for r in rows]
    return "\n".join(lines)


def format_overhead_sources(overheads: Mapping[str, Mapping], recorded_sis: Mapping | None) -> str:
    """One paragraph: where the overhead column comes from, and the recorded SIS figure of
    ``bench_policy_loss`` beside this run's."""
    sources = sorted({o["source"] for o in overheads.values()})
    text = ("Overheads: " + ("; ".join(sources) if sources else "not measured") +
            " (median of the (correction / none) ratios of alternated pairs, range in brackets).")
    if recorded_sis:
        text += (f" bench_policy_loss's recorded SIS step: {recorded_sis['ratio_median']:.3f}x "
                 f"[{_f(recorded_sis['ratio_min'])}, {_f(recorded_sis['ratio_max'])}], "
                 f"{recorded_sis['pairs']} pairs, {recorded_sis['source']}.")
    return text


def seed_figures(finals: Mapping[tuple, Mapping[int, float]]) -> list[dict]:
    """The per-seed final pass@1 of every (regime, algo, correction, moe)
    (:func:`jaxflow.rl.corrections_study.per_seed`) as JSON rows, for the headline builder."""
    return [{"regime": k[0], "algo": k[1], "correction": k[2], "moe": k[3],
             "per_seed": {str(s): v for s, v in sorted(vals.items())}} for k, vals in finals.items()]
