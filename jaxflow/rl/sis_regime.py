"""The ``sis_regime`` study's design: where uncorrected RL degrades, and which settings the
corrections are compared in.

Phase 1 runs every off-policy knob setting (:func:`regime_settings`: policy lag, learning rate
at a lag, staleness, sampler mismatch) without correction; :func:`regime_rows` compares each
with the lag-1 run seed by seed and marks the settings *in the regime*; :func:`choose_settings`
picks the phase-2 settings from that map; :func:`phase2_cells` runs every correction there.
Cells are :class:`jaxflow.rl.offpolicy_cells.Cell` runs; :func:`control_degradation` and
:func:`overheads` summarize phase 2. The tables and the map's plot are
:mod:`jaxflow.rl.sis_regime_report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxflow.rl.offpolicy_cells import Cell
from jaxflow.study import mean_of, paired_by_seed, sample_sd

__all__ = ["FAMILIES", "parse_lr_setting", "lag_prompts", "regime_cell", "regime_settings",
           "phase1_cells", "setting_label", "regime_rows", "choose_settings", "phase2_cells",
           "control_degradation", "overheads", "record_setting"]

#: the knob families of the regime map, in table order
FAMILIES = ("lag", "lr", "staleness", "mismatch")


def parse_lr_setting(text: str) -> tuple[float, int]:
    """``"3x8"`` -> (3.0, 8): learning rate x3 at policy lag N = 8."""
    try:
        scale, lag = text.split("x")
        out = float(scale), int(lag)
    except ValueError:
        out = (0.0, 0)
    if not (out[0] > 0 and out[1] >= 1):
        raise ValueError(f"grid.compare_lr={text!r}; valid: 'auto', 'off' or 'SCALExN' with "
                         "SCALE > 0 and N >= 1 (e.g. '3x8')")
    return out


def lag_prompts(config, lag: int) -> int:
    """Prompts per rollout at policy lag ``lag``: the configured rollout, grown to
    ``min_minibatch_rows * lag`` rows when that is larger (0 = the configured one)."""
    size = config.rl.prompts_per_rollout * config.rl.group_size
    rows = config.grid.min_minibatch_rows * lag
    return 0 if rows <= size else rows // config.rl.group_size


def regime_cell(config, family: str, value, *, algo: str, correction: str, seed: int,
                inner_lag: int = 1) -> Cell:
    """The cell of knob ``family`` (one of :data:`FAMILIES`) at ``value`` (an lr value is
    ``(scale, lag)``); staleness and mismatch run at ``inner_lag`` updates per rollout."""
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
    return [regime_cell(config, fam, val, algo=grid.algo, correction="none", seed=s)
            for fam, val in regime_settings(grid) for s in range(grid.seeds)]


def setting_label(family: str, value) -> str:
    """A phase-1 setting in the regime table's words: ``N=8``, ``lr x3 at N=8``, ``k=4``,
    ``bf16``."""
    if family == "lr":
        return f"lr x{value[0]:g} at N={value[1]}"
    return {"lag": "N={}", "staleness": "k={}", "mismatch": "{}"}[family].format(value)


def regime_rows(config, records: Mapping[str, dict]) -> list[dict]:
    """Per phase-1 setting: seed-mean final pass@1, clip fraction, D_original, the accept rate
    SIS would have, and the paired setting-minus-lag-1 difference of the final pass@1 (95%
    t-interval); ``in_regime`` when the difference is <= -threshold and the interval's upper
    end is < 0. Settings with missing cells are skipped."""
    grid = config.grid
    base = {s: records.get(regime_cell(config, "lag", 1, algo=grid.algo, correction="none",
                                       seed=s).label) for s in range(grid.seeds)}
    rows = []
    for fam, val in regime_settings(grid):
        recs = {s: records.get(regime_cell(config, fam, val, algo=grid.algo, correction="none",
                                           seed=s).label) for s in range(grid.seeds)}
        seeds = [s for s in recs if recs[s] is not None and base[s] is not None]
        if not seeds:
            continue
        iv = paired_by_seed({s: recs[s]["final_accuracy"] for s in seeds},
                            {s: base[s]["final_accuracy"] for s in seeds})
        have = [recs[s] for s in seeds]
        rows.append({
            "family": fam, "value": list(val) if isinstance(val, tuple) else val,
            "setting": setting_label(fam, val), "seeds": len(seeds),
            "final_mean": mean_of(have, "final_accuracy"),
            "final_sd": sample_sd([r["final_accuracy"] for r in have]),
            "auc_mean": mean_of(have, "auc"), "clip_fraction": mean_of(have, "clip_fraction"),
            "d_original": mean_of(have, "d_original"),
            "sis_accept_expected": mean_of(have, "sis_accept_expected"),
            "diff": iv.mean, "half_width": iv.half_width,
            "in_regime": bool(iv.mean <= -grid.threshold and iv.mean + iv.half_width < 0),
        })
    return rows


def choose_settings(config, rows: Sequence[dict]) -> dict[str, dict]:
    """The phase-2 settings by family ("staleness", "mismatch", "lr", "lag"): the configured
    one, else the smallest knob value in the regime, else (no setting of the family in the
    regime) the largest knob value, the most off-policy. For "lr" only settings at N > 1
    whose N = 1 run at the same scale is outside the regime count (the lag degrades them)."""
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


def phase2_cells(config, chosen: Mapping[str, dict]) -> list[Cell]:
    """Every correction x algorithm x ``compare_seeds`` seeds in the chosen settings (only
    none and sis corrections at a policy-lag setting; staleness and mismatch at
    ``grid.compare_inner_lag`` updates per rollout), and the lag-1 baseline to the same seeds."""
    grid = config.grid
    if not chosen:
        return []
    cells = [regime_cell(config, "lag", 1, algo=a, correction="none", seed=s)
             for a in grid.compare_algos for s in range(grid.compare_seeds)]
    for fam, pick in chosen.items():
        pure_lag = fam in ("lag", "lr")  # TIS / MIS / RS are identities under pure policy lag
        corrs = [c for c in grid.compare_corrections if not pure_lag or c in ("none", "sis")]
        inner = grid.compare_inner_lag if fam in ("staleness", "mismatch") else 1
        algos = (grid.compare_mismatch_algos or grid.compare_algos) if fam == "mismatch" else (
            grid.compare_algos)
        value = tuple(pick["value"]) if fam == "lr" else pick["value"]
        cells += [regime_cell(config, fam, value, algo=a, correction=c, seed=s, inner_lag=inner)
                  for a in algos for c in corrs for s in range(grid.compare_seeds)]
    return cells


def control_degradation(records: Sequence[dict]) -> list[dict]:
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
            iv = None if key == ("none", 1, 0, 1.0) else paired_by_seed(vals, base)
            if iv is None:
                continue
            seeds = sorted(set(vals) & set(base))
            rows.append({"algo": algo, "mismatch": key[0], "lag": key[1], "staleness": key[2],
                         "lr_scale": key[3], "pairs": len(seeds), "final_mean": float(
                             np.mean([vals[s] for s in seeds])), "diff": iv.mean,
                         "half_width": iv.half_width})
    return rows


def overheads(records: Sequence[dict]) -> list[dict]:
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


def record_setting(rec: Mapping) -> str:
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
