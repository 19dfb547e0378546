"""The ``corrections_study`` report (markdown): the finished cells against the plan, the
ranking of the corrections per regime, the regimes' uncorrected runs against lag 1, R3 in the
MoE regime with the router disagreement, and where the overhead figures come from. Rows come
from :mod:`jaxflow.rl.corrections_study`; :func:`study_report` builds them all (the driver's
``results.md``), :func:`report_from_dir` reads a run directory without running or measuring
anything, also while the study runs::

    python -m jaxflow.rl.corrections_study_report experiments/studies/corrections_study_dense \
        experiments/studies/corrections_study_moe
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

from jaxflow.rl.correction_overhead import recorded_sis_overhead
from jaxflow.rl.corrections_study import (
    lag1_controls,
    per_seed,
    planned_seeds,
    progress,
    r3_rows,
    rank_corrections,
    study_cells,
)
from jaxflow.study import CELLS_FILE, format_pm

__all__ = ["REGIME_WORDS", "format_ranking", "standing", "format_controls", "format_r3", "format_overhead_sources",
           "format_progress", "seed_figures", "study_report", "report_from_dir", "main"]

#: bench_policy_loss's results records, beside this package in the repository
_BENCH_RECORDS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "results" / "bench_policy_loss"

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
        block = [r for r in rows if (r["regime"], r["algo"]) == (regime, algo)]
        title = f"**{algo}, {REGIME_WORDS[regime].format(**vars(study))}**"
        if all(r["rank"] is None for r in block):
            out += [f"{title}: missing (no correction has a finished seed paired with none's; "
                    f"{sum(r['planned'] for r in block)} cells planned)", ""]
            continue
        out += [title, "",
                "| rank | correction | seeds | final pass@1 | minus none (95% t) | AUC minus none | "
                "masked share | KL(mu, pi_old) | loss-step time / none's [range] |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in block:
            if r["rank"] is None:
                out.append(f"| - | {r['correction']} | 0/{r['planned']} | missing | - | - | - | - | - |")
                continue
            over = _f(r["overhead"]) + ("" if r["overhead_range"] is None else
                                        f" [{_f(r['overhead_range'][0], '.2f')}, {_f(r['overhead_range'][1], '.2f')}]")
            seeds = f"{r['seeds']}" + (f"/{r['planned']}" if r.get("planned", r["seeds"]) != r["seeds"] else "")
            out.append(f"| {r['rank']} | {r['correction']} | {seeds} | {_f(r['final_mean'])} | "
                       f"{_pm(r['diff'], r['half_width'])} | {_pm(r['auc_diff'], r['auc_half_width'])} | "
                       f"{_f(r['masked_fraction'], '.4f')} | {_f(r['mismatch_kl'], '.2e')} | {over} |")
        out += ["", standing(block), ""]
    return "\n".join(out) if out else "(no dense-regime correction has a paired none seed yet)"


def standing(block: Sequence[Mapping]) -> str:
    """One line on one (regime, algo) block of ranked rows: the best correction, those whose
    95% interval against none lies wholly above / below 0, and where none, SIS and ``sis_b``
    rank."""
    ranked = [r for r in block if r["rank"] is not None and r["correction"] != "none"]
    if not ranked:
        return "Standing: no correction has a paired seed yet."
    best = ranked[0]
    above = [r["correction"] for r in ranked if r["half_width"] is not None and r["diff"] - r["half_width"] > 0]
    below = [r["correction"] for r in ranked if r["half_width"] is not None and r["diff"] + r["half_width"] < 0]
    n = len([r for r in block if r["rank"] is not None])
    text = (f"Standing: best {best['correction']} {_pm(best['diff'], best['half_width'])} against none; "
            f"95% interval above 0: {', '.join(above) or '-'}; below 0: {', '.join(below) or '-'}")
    places = [f"{r['correction']} rank {r['rank']} of {n}" for r in block
              if r["rank"] is not None and r["correction"] in ("none", "sis", "sis_b")]
    return text + ("; " + ", ".join(places) if places else "") + "."


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
    for r in rows:
        seeds = f"{r['seeds']}" if r.get("planned") in (None, r["seeds"]) else f"{r['seeds']}/{r['planned']}"
        final_no_r3 = "missing" if not r.get("seeds_no_r3", 1) else _f(r["final_no_r3"])
        final_r3 = "missing" if not r.get("seeds_r3", 1) else _f(r["final_r3"])
        lines.append(f"| {r['algo']} | {r['correction']} | {seeds} | {final_no_r3} | {final_r3} | "
                     f"{_pm(r['diff'], r['half_width'])} | {dis(r, 'record')} | {dis(r, 'replay')} |")
    return "\n".join(lines)


def format_progress(rows: Sequence[Mapping]) -> str:
    """Markdown: the finished cells of each (regime, algo) block of the study against its plan
    (:func:`jaxflow.rl.corrections_study.progress`); "complete" when nothing is missing."""
    missing = sum(r["missing"] for r in rows)
    done, planned = sum(r["done"] for r in rows), sum(r["planned"] for r in rows)
    if not missing:
        return f"Cells: {done}/{planned}, complete."
    lines = [f"Cells: {done}/{planned} finished, {missing} missing:", "", "| regime | algo | finished / planned |",
             "|---|---|---|"]
    lines += [f"| {r['regime']} | {r['algo']} | {r['done']}/{r['planned']} |" for r in rows]
    return "\n".join(lines)


def format_overhead_sources(overheads: Mapping[str, Mapping], recorded_sis: Mapping | None) -> str:
    """One paragraph: where the overhead column comes from, and the recorded SIS figure of
    ``bench_policy_loss`` beside this run's."""
    sources = sorted({o["source"] for o in overheads.values()})
    text = ("Overheads: " + "; ".join(sources) + " (median of the (correction / none) ratios of alternated pairs, "
            "range in brackets)." if sources else "Overheads: not measured in this run yet (the study measures "
            "them once, after its cells: overheads.json).")
    if recorded_sis:
        text += (f" bench_policy_loss's recorded SIS step{'' if 'sis' in overheads else ' (the sis column)'}: "
                 f"{recorded_sis['ratio_median']:.3f}x "
                 f"[{_f(recorded_sis['ratio_min'])}, {_f(recorded_sis['ratio_max'])}], "
                 f"{recorded_sis['pairs']} pairs, {recorded_sis['source']}.")
    return text


def seed_figures(finals: Mapping[tuple, Mapping[int, float]]) -> list[dict]:
    """The per-seed final pass@1 of every (regime, algo, correction, moe)
    (:func:`jaxflow.rl.corrections_study.per_seed`) as JSON rows, for the headline builder."""
    return [{"regime": k[0], "algo": k[1], "correction": k[2], "moe": k[3],
             "per_seed": {str(s): v for s, v in sorted(vals.items())}} for k, vals in finals.items()]


def study_report(study, records: Sequence[Mapping], overheads: Mapping[str, Mapping],
                 recorded_sis: Mapping | None) -> tuple[dict[str, Any], list[str]]:
    """(results, markdown sections) of the study ``study`` (``configs.corrections_study.
    StudyGrid`` or any object with its fields) over the finished cell ``records``, which may
    be any part of the study (the rest shows as missing): ``results`` holds ``progress``,
    ``ranking``, ``controls``, ``r3``, ``overheads``, ``recorded_sis_overhead`` and ``finals``."""
    cells = study_cells(study)
    planned = planned_seeds(cells)
    per_step = dict(overheads)  # the column: this run's pairs, else bench_policy_loss's recorded SIS pairs
    if recorded_sis and "sis" not in per_step:
        per_step["sis"] = {k: recorded_sis[k] for k in ("ratio_median", "ratio_min", "ratio_max")}
    results = {"progress": progress(cells, records), "ranking": rank_corrections(records, per_step, planned=planned),
               "controls": lag1_controls(records), "r3": r3_rows(records, planned=planned),
               "overheads": dict(overheads), "recorded_sis_overhead": recorded_sis,
               "finals": seed_figures(per_seed(records))}
    return results, [format_progress(results["progress"]), format_ranking(results["ranking"], study),
                     format_controls(results["controls"]), format_r3(results["r3"]),
                     format_overhead_sources(overheads, recorded_sis)]


def _read_records(path: pathlib.Path) -> list[dict]:
    """cells.jsonl's records; a last line the running study is still writing is left out."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON; valid: one cell record per line") from None
    return records


def _read_run(run_dir: pathlib.Path) -> tuple[dict, dict[str, Any], list[dict]]:
    """(saved config.json, its study grid's fields, cells.jsonl's records) of one run directory;
    ValueError names a directory that is no corrections_study run."""
    config_path = run_dir / "config.json"
    try:
        saved = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{run_dir}: cannot read {config_path.name} ({e}); valid: the --out directory "
                         "of a corrections_study run") from None
    if saved.get("experiment") != "corrections_study":
        raise ValueError(f"{run_dir}: experiment {saved.get('experiment')!r}; valid: a corrections_study run")
    grid = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["config"]["study"].items()}
    cells_path = run_dir / CELLS_FILE
    return saved, grid, _read_records(cells_path) if cells_path.exists() else []


def report_from_dir(run_dir: str | pathlib.Path, *more: str | pathlib.Path,
                    bench_records: str | pathlib.Path = _BENCH_RECORDS) -> str:
    """The report (markdown) of the ``corrections_study`` run directory ``run_dir``, running no
    cell and measuring nothing, writing nothing: its ``config.json``'s study grid, the finished
    cells of ``cells.jsonl`` (those of the grid; none yet is fine), ``overheads.json`` when the
    study measured it (the first of the directories that has one), and the newest
    ``bench_policy_loss`` record under ``bench_records``.

    ``more``: run directories of the same study split by regime (``--set study.regimes=...``,
    run side by side, one per core): the grid is ``run_dir``'s with the regimes of all of
    them (in order of appearance), their cells join ``run_dir``'s (``run_dir``'s record wins
    for a label run twice). Every other grid field must be equal across them. ValueError names
    a directory that is no corrections_study run, or the field that differs."""
    run_dir = pathlib.Path(run_dir)
    saved, grid, found = _read_run(run_dir)
    regimes = list(grid["regimes"])
    for other in map(pathlib.Path, more):
        _, other_grid, other_found = _read_run(other)
        for field in sorted(set(grid) | set(other_grid)):
            if field != "regimes" and grid.get(field) != other_grid.get(field):
                raise ValueError(f"{other}: study.{field}={other_grid.get(field)!r} differs from "
                                 f"{run_dir}'s {grid.get(field)!r}; valid: run directories of one study "
                                 "split only by study.regimes")
        regimes += [r for r in other_grid["regimes"] if r not in regimes]
        found = other_found + found  # run_dir's records last: they win below
    study = types.SimpleNamespace(**{**grid, "regimes": tuple(regimes)})
    labels = {c.label for c in study_cells(study)}
    records = list({r["label"]: r for r in found if r["label"] in labels}.values())
    # the overheads of the first directory that measured them (each measures all corrections)
    overheads = next((json.loads(p.read_text(encoding="utf-8")) for d in (run_dir, *map(pathlib.Path, more))
                      if (p := d / "overheads.json").exists()), {})
    _, sections = study_report(study, records, overheads, recorded_sis_overhead(bench_records))
    dirs = ", ".join(map(str, (run_dir, *more)))
    return f"corrections_study report of {dirs} ({saved.get('variant')})\n\n" + "\n\n".join(sections)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxflow.rl.corrections_study_report RUN_DIR [RUN_DIR ...]``: prints
    :func:`report_from_dir` (several directories: one study split by regime); exit status 2 with
    one line on stderr for a directory that is no corrections_study run or not of the same study."""
    parser = argparse.ArgumentParser(prog="python -m jaxflow.rl.corrections_study_report",
                                     description="The corrections_study tables of a run directory, "
                                                 "partial or complete, without running anything.")
    parser.add_argument("run_dir", help="the study's --out directory (holding config.json, cells.jsonl)")
    parser.add_argument("more", nargs="*", help="more --out directories of the same study, split by "
                                                "study.regimes (their regimes and cells join)")
    args = parser.parse_args(argv)
    try:
        print(report_from_dir(args.run_dir, *args.more))
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
