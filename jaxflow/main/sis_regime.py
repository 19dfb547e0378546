"""The ``sis_regime`` experiment: map where uncorrected RL degrades, then compare corrections there.

See ``configs/sis_regime.py``. Cells are :class:`jaxflow.main.sis_offpolicy.Cell` runs through
``sis_offpolicy.run_cell`` (same resume: finished cells in ``cells.jsonl``, the running cell
from its checkpoint). Phase 1 runs the knob sweep without correction; :func:`regime_rows`
compares each setting with the lag-1 run seed by seed; :func:`choose_settings` picks the phase-2
settings from that map; phase 2 runs every correction there. Outputs: ``results.md`` (regime
table, comparison table, overheads), ``summary.json`` and ``plots/sis_regime_map.png``.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.main import sis_offpolicy as grid_runner
from jaxflow.main.sis_offpolicy import Cell
from jaxflow.mesh import RolesConfig, trainer_rollout_meshes
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.stats import paired_interval
from jaxflow.train.lm_state import lm_functions

#: the knob families of the regime map, in table order
FAMILIES = ("lag", "lr", "staleness", "mismatch")


def lag_prompts(config, lag: int) -> int:
    """Prompts per rollout at policy lag ``lag``: the configured rollout, grown to
    ``min_minibatch_rows * lag`` rows when that is larger (0 = the configured one)."""
    size = config.rl.prompts_per_rollout * config.rl.group_size
    rows = config.grid.min_minibatch_rows * lag
    return 0 if rows <= size else rows // config.rl.group_size


def _cell(config, family: str, value, *, algo: str, correction: str, seed: int,
          inner_lag: int = 1) -> Cell:
    if family == "lag":
        return Cell(algo, correction, "none", value, 0, seed, prompts=lag_prompts(config, value))
    if family == "lr":
        scale, lag = value
        return Cell(algo, correction, "none", lag, 0, seed, lr_scale=float(scale),
                    prompts=lag_prompts(config, lag))
    if family == "staleness":
        return Cell(algo, correction, "none", inner_lag, value, seed,
                    prompts=lag_prompts(config, inner_lag))
    if family == "mismatch":
        return Cell(algo, correction, value, inner_lag, 0, seed,
                    prompts=lag_prompts(config, inner_lag))
    raise ValueError(f"unknown knob family {family!r}; valid: {FAMILIES}")


def regime_settings(grid) -> list[tuple[str, object]]:
    """(family, value) of every phase-1 setting, the lag-1 baseline first."""
    out: list[tuple[str, object]] = [("lag", 1)]
    out += [("lag", n) for n in grid.lags if n != 1]
    out += [("lr", (s, n)) for n in grid.lr_lags for s in grid.lr_scales]
    out += [("staleness", k) for k in grid.stalenesses]
    out += [("mismatch", m) for m in grid.mismatches]
    return out


def phase1_cells(config) -> list[Cell]:
    """Phase 1: every regime setting without correction, ``grid.seeds`` seeds each."""
    grid = config.grid
    return [_cell(config, fam, val, algo=grid.algo, correction="none", seed=s)
            for fam, val in regime_settings(grid) for s in range(grid.seeds)]


def _setting_label(family: str, value) -> str:
    if family == "lr":
        return f"lr x{value[0]:g} at N={value[1]}"
    return {"lag": "N={}", "staleness": "k={}", "mismatch": "{}"}[family].format(value)


def regime_rows(config, records: dict[str, dict]) -> list[dict]:
    """Per phase-1 setting: seed-mean final pass@1, clip fraction, D_original, the accept rate
    SIS would have, and the paired setting-minus-lag-1 difference of the final pass@1 (95%
    t-interval); ``in_regime`` when the difference is <= -threshold and the interval's upper
    end is < 0. Settings with missing cells are skipped."""
    grid = config.grid
    base = {s: records.get(_cell(config, "lag", 1, algo=grid.algo, correction="none",
                                 seed=s).label) for s in range(grid.seeds)}
    rows = []
    for fam, val in regime_settings(grid):
        recs = {s: records.get(_cell(config, fam, val, algo=grid.algo, correction="none",
                                     seed=s).label) for s in range(grid.seeds)}
        seeds = [s for s in recs if recs[s] is not None and base[s] is not None]
        if not seeds:
            continue
        iv = paired_interval([recs[s]["final_accuracy"] for s in seeds],
                             [base[s]["final_accuracy"] for s in seeds])

        def mean(key, seeds=seeds, recs=recs):
            vals = [recs[s][key] for s in seeds if recs[s].get(key) is not None]
            return float(np.mean(vals)) if vals else None

        rows.append({
            "family": fam, "value": list(val) if isinstance(val, tuple) else val,
            "setting": _setting_label(fam, val), "seeds": len(seeds),
            "final_mean": mean("final_accuracy"),
            "final_sd": float(np.std([recs[s]["final_accuracy"] for s in seeds], ddof=1))
            if len(seeds) > 1 else 0.0,
            "auc_mean": mean("auc"), "clip_fraction": mean("clip_fraction"),
            "d_original": mean("d_original"), "sis_accept_expected": mean("sis_accept_expected"),
            "diff": iv.mean, "half_width": iv.half_width,
            "in_regime": bool(iv.mean <= -grid.threshold and iv.mean + iv.half_width < 0),
        })
    return rows


def choose_settings(config, rows: list[dict]) -> dict[str, dict]:
    """The phase-2 settings by family ("staleness", "mismatch", "lr", "lag"): the configured
    one, else the smallest knob value in the regime, else (no setting of the family in the
    regime) the largest knob value, the most off-policy. For "lr" only settings at N > 1
    whose N = 1 run at the same scale is outside the regime count (the lag degrades them)."""
    from configs.sis_regime import parse_lr_setting

    grid = config.grid
    fixed = {"staleness": grid.compare_staleness, "mismatch": grid.compare_mismatch,
             "lr": grid.compare_lr, "lag": grid.compare_lag}
    on_policy_lr = {r["value"][0]: r["in_regime"] for r in rows
                    if r["family"] == "lr" and r["value"][1] == 1}
    out = {}
    for fam, want in fixed.items():
        if want in (-1, "off"):
            continue
        cands = [r for r in rows if r["family"] == fam and not (fam == "lag" and r["value"] == 1)]
        if fam == "lr":
            cands = [r for r in cands if r["value"][1] > 1]
        if want not in (0, "auto"):
            value = list(parse_lr_setting(want)) if fam == "lr" else want
            match = [r for r in cands if r["value"] == value]
            out[fam] = {"value": value, "why": "configured",
                        "in_regime": bool(match and match[0]["in_regime"])}
            continue
        inside = [r for r in cands if r["in_regime"] and not (
            fam == "lr" and on_policy_lr.get(r["value"][0], False))]
        if fam == "lr" and not inside:
            continue  # no lr setting where the lag is what hurts
        if not cands:
            continue
        pick = inside[0] if inside else cands[-1]
        out[fam] = {"value": pick["value"], "in_regime": pick["in_regime"],
                    "why": ("smallest knob value in the regime" if inside else
                            "no setting in the regime: the largest knob value")}
    return out


def phase2_cells(config, chosen: dict[str, dict]) -> list[Cell]:
    """Every correction x algorithm x ``compare_seeds`` seeds in the chosen settings (only
    none and sis corrections at a policy-lag setting; staleness and mismatch at
    ``grid.compare_inner_lag`` updates per rollout), and the lag-1 baseline to the same seeds."""
    grid = config.grid
    if not chosen:
        return []
    cells = [_cell(config, "lag", 1, algo=a, correction="none", seed=s)
             for a in grid.compare_algos for s in range(grid.compare_seeds)]
    for fam, pick in chosen.items():
        pure_lag = fam in ("lag", "lr")  # TIS / MIS / RS are identities under pure policy lag
        corrs = [c for c in grid.compare_corrections if not pure_lag or c in ("none", "sis")]
        inner = grid.compare_inner_lag if fam in ("staleness", "mismatch") else 1
        algos = (grid.compare_mismatch_algos or grid.compare_algos) if fam == "mismatch" else (
            grid.compare_algos)
        value = tuple(pick["value"]) if fam == "lr" else pick["value"]
        cells += [_cell(config, fam, value, algo=a, correction=c, seed=s, inner_lag=inner)
                  for a in algos for c in corrs for s in range(grid.compare_seeds)]
    return cells


def control_degradation(records: list[dict]) -> list[dict]:
    """Per algorithm and phase-2 setting: the uncorrected run minus the same algorithm's lag-1
    run, paired by seed (final pass@1, 95% t-interval): is the comparison's setting in the
    regime at its own seeds?"""
    by: dict[str, dict[tuple, dict[int, float]]] = {}
    for r in records:
        if r["correction"] != "none":
            continue
        key = (r["mismatch"], r["lag"], r["staleness"], r.get("lr_scale", 1.0))
        by.setdefault(r["algo"], {}).setdefault(key, {})[r["seed"]] = r["final_accuracy"]
    rows = []
    for algo, settings in by.items():
        base = settings.get(("none", 1, 0, 1.0), {})
        for key, vals in settings.items():
            seeds = sorted(set(vals) & set(base))
            if key == ("none", 1, 0, 1.0) or not seeds:
                continue
            iv = paired_interval([vals[s] for s in seeds], [base[s] for s in seeds])
            rows.append({"algo": algo, "mismatch": key[0], "lag": key[1], "staleness": key[2],
                         "lr_scale": key[3], "pairs": len(seeds), "final_mean": float(
                             np.mean([vals[s] for s in seeds])), "diff": iv.mean,
                         "half_width": iv.half_width})
    return rows


def format_degradation(rows: list[dict]) -> str:
    """Markdown: each phase-2 setting's uncorrected run against lag 1."""
    lines = ["| algo | mismatch | N | k | pairs | none final pass@1 | minus N=1 none (95% t) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['mismatch']} | {r['lag']} | {r['staleness']} | {r['pairs']} | "
              f"{r['final_mean']:.3f} | {r['diff']:+.3f} +- {r['half_width']:.3f} |" for r in rows]
    return "\n".join(lines)


def overheads(records: list[dict]) -> list[dict]:
    """Per (algo, setting, correction != none): the median over paired seeds of the ratio of
    the median rollout wall time (sample + update, first rollout excluded) to none's."""
    by: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in records:
        if r.get("rollout_seconds_median") is None:
            continue
        key = (r["algo"], r["mismatch"], r["lag"], r["staleness"], r.get("lr_scale", 1.0))
        by.setdefault(key, {}).setdefault(r["correction"], {})[r["seed"]] = (
            r["rollout_seconds_median"])
    rows = []
    for key, corrs in by.items():
        for corr, secs in corrs.items():
            seeds = sorted(set(secs) & set(corrs.get("none", {})))
            if corr == "none" or not seeds:
                continue
            ratios = [secs[s] / corrs["none"][s] for s in seeds]
            rows.append({"algo": key[0], "mismatch": key[1], "lag": key[2], "staleness": key[3],
                         "correction": corr, "pairs": len(seeds),
                         "time_ratio_median": float(np.median(ratios)),
                         "time_ratio_range": [float(min(ratios)), float(max(ratios))]})
    return rows


def format_regime_table(rows: list[dict], baseline: float | None) -> str:
    """Markdown: one row per phase-1 setting."""
    def f(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    lines = [f"Baseline (N=1, on-policy) final pass@1: {f(baseline)}", "",
             "| knob | setting | seeds | final pass@1 (sd) | minus N=1 (95% t) | in regime | "
             "clip frac | D_original | SIS accept (would be) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['setting']} | {r['seeds']} | {f(r['final_mean'])} "
              f"({f(r['final_sd'])}) | {r['diff']:+.3f} +- {r['half_width']:.3f} | "
              f"{'yes' if r['in_regime'] else 'no'} | {f(r['clip_fraction'], '.4f')} | "
              f"{f(r['d_original'], '.4f')} | {f(r['sis_accept_expected'])} |" for r in rows]
    return "\n".join(lines)


def record_setting(rec: dict) -> str:
    """A record's off-policy setting in the regime map's words, e.g. "k=4, N=4"."""
    parts = []
    if rec.get("lr_scale", 1.0) != 1.0:
        parts.append(f"lr x{rec['lr_scale']:g}")
    if rec["staleness"]:
        parts.append(f"k={rec['staleness']}")
    if rec["mismatch"] != "none":
        parts.append(rec["mismatch"])
    parts.append(f"N={rec['lag']}")
    return ", ".join(parts)


def format_compare(rows: list[dict], paired: list[dict]) -> str:
    """Markdown: per (algo, setting, correction) the seed-mean final pass@1 and AUC, and the
    paired correction-minus-none differences (95% t-interval, bootstrap)."""
    diffs = {(p["algo"], record_setting(p), p["correction"]): p for p in paired}
    lines = ["| algo | setting | correction | seeds | final pass@1 (sd) | AUC | SIS accept "
             "(mb > 1) | final - none (95% t) | bootstrap | AUC - none (95% t) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (record_setting(r), r["algo"])):
        d = diffs.get((r["algo"], record_setting(r), r["correction"]))
        acc = "-" if r["accept_rate_later"] is None else f"{r['accept_rate_later']:.3f}"
        tail = ("- | - | -" if d is None else
                f"{d['final_diff']:+.3f} +- {d['final_half_width']:.3f} | [{d['final_boot'][0]:+.3f}, "
                f"{d['final_boot'][1]:+.3f}] | {d['auc_diff']:+.3f} +- {d['auc_half_width']:.3f}")
        lines.append(f"| {r['algo']} | {record_setting(r)} | {r['correction']} | {r['seeds']} | "
                     f"{r['acc_mean']:.3f} ({r['acc_std']:.3f}) | {r['auc_mean']:.3f} | {acc} | "
                     f"{tail} |")
    return "\n".join(lines)


def format_overheads(rows: list[dict]) -> str:
    """Markdown: wall-time ratio of each correction to none."""
    lines = ["| algo | mismatch | N | k | correction | pairs | rollout time / none's (median) "
             "| range |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['mismatch']} | {r['lag']} | {r['staleness']} | "
              f"{r['correction']} | {r['pairs']} | {r['time_ratio_median']:.3f} | "
              f"[{r['time_ratio_range'][0]:.3f}, {r['time_ratio_range'][1]:.3f}] |" for r in rows]
    return "\n".join(lines)


def _run_cells(cells, config, run, done, state, *, meshes, warm_params, initial) -> list[dict]:
    out = []
    for cell in cells:
        if cell.label in done:
            out.append(done[cell.label])
            continue
        if config.report_only:
            state["missing"].append(cell.label)
            continue
        index = state["index"]
        state["index"] += 1
        record = grid_runner.run_cell(cell, index, config, run, meshes=meshes,
                                      warm_params=warm_params, initial_accuracy=initial)
        grid_runner._append_done(run, record)
        shutil.rmtree(run.checkpoint_dir / cell.label, ignore_errors=True)
        run.info(f"{cell.label}: pass@1 {record['final_accuracy']:.3f}, clip "
                 f"{record['clip_fraction']:.4f}, SIS accept (expected) "
                 f"{record['sis_accept_expected'] or float('nan'):.3f}, "
                 f"{record['cell_seconds']:.0f} s")
        done[cell.label] = record
        out.append(record)
    return out


def _reused(config, run: RunContext) -> dict[str, dict]:
    """Finished cells of the run directories in ``config.reuse`` (by label)."""
    out: dict[str, dict] = {}
    for d in config.reuse:
        path = pathlib.Path(d) / "cells.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"reuse={d!r}: {path} does not exist; valid: run directories "
                                    "of sis_regime holding cells.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out.update({r["label"]: r for r in rows})
    if out:
        run.info(f"reusing {len(out)} finished cells from {', '.join(config.reuse)}")
    return out


def main(config, run: RunContext) -> dict:
    from jaxflow.main._sis_regime_plot import plot_regime_map

    meshes, roles = trainer_rollout_meshes(RolesConfig(colocate=True))
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    warm_params, pre_summary = load_pretrained_params(config.pretrain, config.cache_root, fns,
                                                      log=run.info)
    own = grid_runner._load_done(run)
    reused = {k: v for k, v in _reused(config, run).items() if k not in own}
    for record in reused.values():  # the run directory holds every record it reports
        grid_runner._append_done(run, record)
    done = reused | own
    first = phase1_cells(config)
    grid = config.grid
    estimate = len(first) + 2 * len(grid.compare_algos) * len(grid.compare_corrections) * (
        grid.compare_seeds)
    run.set_total_steps(estimate * config.train.rollouts, "sis_regime")
    initial = grid_runner.warm_start_accuracy(config, meshes, warm_params)
    run.info(f"warm start held-out pass@1 {initial[0]:.3f}, greedy {initial[1]:.3f}")
    # a cell's global step is its position in the run (resumed cells keep theirs via labels)
    state = {"index": len(done), "missing": []}
    kw = dict(meshes=meshes, warm_params=warm_params, initial=initial)
    records = _run_cells(first, config, run, done, state, **kw)
    by_label = {r["label"]: r for r in records}
    regime = regime_rows(config, by_label)
    chosen = choose_settings(config, regime)
    run.info("regime map:\n" + format_regime_table(regime, regime[0]["final_mean"] if regime
                                                   else None))
    run.info(f"phase 2 settings: {chosen}")
    second = _run_cells(phase2_cells(config, chosen), config, run, done, state, **kw)
    if state["missing"]:
        run.info(f"report_only: {len(state['missing'])} cells not run (summary['missing'])")
    compared = list({r["label"]: r for r in second}.values())
    paired = grid_runner.paired_differences(compared)
    rows = grid_runner.aggregate(compared)
    times = overheads(compared)
    degraded = control_degradation(compared)
    run.write_json("results.json", {"regime": regime, "chosen": chosen, "compare": rows,
                                    "paired": paired, "control_degradation": degraded,
                                    "overheads": times})
    if run.is_primary:
        tables = "\n\n".join([
            format_regime_table(regime, regime[0]["final_mean"] if regime else None),
            format_degradation(degraded), format_compare(rows, paired),
            format_overheads(times)]) + "\n"
        (run.out_dir / "results.md").write_text(tables)
        run.info("results:\n" + tables)
        plot_regime_map(run.out_dir / "plots", regime, compared, chosen)
    return {
        "task": config.task_name,
        "regime": regime, "chosen": chosen, "compare": rows, "paired": paired,
        "control_degradation": degraded, "overheads": times, "pass_at_1": grid_runner.pass_at_1_definition(config),
        "roles": roles, "cells_run": len(done), "missing": state["missing"],
        "warm_start": {"cache": cache_dir(config.pretrain, config.cache_root).name,
                       "pretrain_heldout_accuracy": pre_summary.get("heldout_accuracy"),
                       "heldout_accuracy": initial[0], "heldout_greedy_accuracy": initial[1]},
    }
