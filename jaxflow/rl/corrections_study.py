"""The ``corrections_study`` design and its ranking: every correction in each degraded regime.

:func:`study_cells` lists the study's :class:`jaxflow.rl.offpolicy_cells.Cell` runs in run order
(``configs/corrections_study.py``): per regime (``staleness``: k rollouts of staleness at N
updates per rollout; ``lr``: lr x s at policy lag N; ``moe``: the MoE policy sampled in bf16,
without R3 and with it) and algorithm, seeds outermost, each seed's cells the on-policy lag-1
control (dense regimes) then every correction. :func:`regime_of` names a record's regime;
:func:`rank_corrections` ranks the corrections of each (regime, algorithm) by their paired
final-pass@1 effect against none (95% t-interval over seeds); :func:`r3_rows` compares R3 with
no R3 in the MoE regime and reports the measured router disagreement; :func:`lag1_controls`
tests whether each regime's uncorrected runs are degraded against lag 1 at their own seeds.
On a partial study (a resumed or running one) :func:`planned_seeds` and :func:`progress` say
what each table still misses, so the rows of unfinished corrections show as missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxflow.rl.offpolicy_cells import Cell
from jaxflow.study import mean_of, paired_by_seed

__all__ = ["regime_block", "study_cells", "regime_of", "per_seed", "planned_seeds", "rank_corrections",
           "r3_rows", "lag1_controls", "progress"]


def _regime_cell(study, regime: str, *, algo: str, correction: str, seed: int, moe: str = "") -> Cell:
    if regime == "staleness":
        return Cell(algo, correction, "none", study.inner_lag, study.staleness, seed)
    if regime == "lr":
        return Cell(algo, correction, "none", study.lr_lag, 0, seed, lr_scale=float(study.lr_scale))
    if regime == "moe":
        return Cell(algo, correction, study.moe_mismatch, study.moe_lag, 0, seed, moe=moe)
    raise ValueError(f"unknown regime {regime!r}; valid: staleness, lr, moe")


def regime_block(study, regime: str, algo: str) -> list[Cell]:
    """The cells of one (regime, algorithm) block, seeds outermost: per seed the lag-1
    uncorrected control and every correction of ``study.corrections`` (dense regimes), or every
    correction of ``study.moe_corrections`` without R3 (``moe="record"``) then with it
    (``"replay"``) in the MoE regime."""
    out = []
    for seed in range(study.seeds):
        if regime == "moe":
            out += [_regime_cell(study, "moe", algo=algo, correction=c, seed=seed, moe=m)
                    for c in study.moe_corrections for m in ("record", "replay")]
            continue
        out.append(Cell(algo, "none", "none", 1, 0, seed))  # the on-policy control
        out += [_regime_cell(study, regime, algo=algo, correction=c, seed=seed) for c in study.corrections]
    return out


def study_cells(study) -> list[Cell]:
    """Every cell of the study (``configs.corrections_study.StudyGrid``) in run order: the
    first algorithm's first regime, then the MoE regime (when listed: it is short), then the
    other (regime, algorithm) blocks; duplicates (the lag-1 controls shared by both dense
    regimes) dropped, first occurrence kept."""
    dense = [r for r in study.regimes if r != "moe"]
    blocks = [(r, a) for r in dense for a in study.algos]
    moe = [("moe", a) for a in study.moe_algos] if "moe" in study.regimes else []
    order = blocks[:1] + moe + blocks[1:]
    seen: dict[str, Cell] = {}
    for regime, algo in order:
        for cell in regime_block(study, regime, algo):
            seen.setdefault(cell.label, cell)
    return list(seen.values())


def regime_of(rec: Mapping) -> str:
    """A cell record's regime: "moe" (MoE policy), "lag1" (the on-policy control),
    "staleness" (k > 0) or "lr" (lr scaled at a lag > 1); "other" for anything else."""
    if rec.get("moe"):
        return "moe"
    if rec["lag"] == 1 and not rec["staleness"] and rec.get("lr_scale", 1.0) == 1.0 and rec["mismatch"] == "none":
        return "lag1"
    if rec["staleness"]:
        return "staleness"
    if rec.get("lr_scale", 1.0) != 1.0:
        return "lr"
    return "other"


def per_seed(records: Sequence[Mapping], key: str = "final_accuracy") -> dict[tuple, dict[int, float]]:
    """``{(regime, algo, correction, moe): {seed: record[key]}}`` over the records."""
    out: dict[tuple, dict[int, float]] = {}
    for r in records:
        out.setdefault((regime_of(r), r["algo"], r["correction"], r.get("moe", "")), {})[r["seed"]] = r[key]
    return out


def _interval(treat: Mapping[int, float], control: Mapping[int, float]) -> tuple[float | None, float | None, int]:
    iv = paired_by_seed(treat, control)
    if iv is None:
        return None, None, 0
    half = iv.half_width if np.isfinite(iv.half_width) else None
    return float(iv.mean), half, len(set(treat) & set(control))


def planned_seeds(cells: Sequence[Cell]) -> dict[tuple, int]:
    """``{(regime, algo, correction, moe): number of seeds}`` the study plans (its cells, e.g.
    :func:`study_cells`), in cell order: what a partial ``cells.jsonl`` is measured against."""
    out: dict[tuple, int] = {}
    for c in cells:
        key = (regime_of(c._asdict()), c.algo, c.correction, c.moe)
        out[key] = out.get(key, 0) + 1
    return out


def _missing_row(regime: str, algo: str, corr: str, planned: int) -> dict:
    return {"regime": regime, "algo": algo, "correction": corr, "seeds": 0, "planned": planned, "rank": None,
            "final_mean": None, "diff": None, "half_width": None, "auc_diff": None, "auc_half_width": None,
            "masked_fraction": None, "mismatch_kl": None, "overhead": None, "overhead_range": None}


def rank_corrections(records: Sequence[Mapping], overheads: Mapping[str, Mapping] | None = None, *,
                     planned: Mapping[tuple, int] | None = None) -> list[dict]:
    """Per dense regime (staleness, lr) and algorithm, one row per correction, ranked by the
    paired final-pass@1 difference to none (best first; none itself with 0, ahead of the
    corrections whose difference is exactly 0): ``rank``,
    ``seeds`` (pairs with none), ``final_mean``, ``diff`` / ``half_width`` (95% t over paired
    seeds; None with one pair), ``auc_diff``, the mean ``masked_fraction`` and ``mismatch_kl``,
    and the policy-loss step ``overhead`` (median time ratio to none; None when not measured)
    and its ``overhead_range`` from ``overheads`` (``{correction: {"ratio_median", "ratio_min",
    "ratio_max"}}``). Corrections without a paired none seed are left out, unless ``planned``
    (:func:`planned_seeds` of the study's cells) lists them: then every planned (regime, algo,
    correction) has a row, ``planned`` its planned seeds, the missing ones after the ranked
    ones with ``rank`` None, ``seeds`` 0 and no figures (a partial study)."""
    finals, aucs = per_seed(records), per_seed(records, "auc")
    by_key = {}
    for r in records:
        by_key.setdefault((regime_of(r), r["algo"], r["correction"]), []).append(r)
    planned = planned or {}
    rows = []
    for regime in ("staleness", "lr"):
        algos = [k[1] for k in planned if k[0] == regime] + [r["algo"] for r in records if regime_of(r) == regime]
        for algo in dict.fromkeys(algos):
            control = finals.get((regime, algo, "none", ""), {})
            block = []
            for (reg, alg, corr, _), vals in finals.items():
                if reg != regime or alg != algo:
                    continue
                diff, half, pairs = _interval(vals, control)
                if not pairs:
                    continue
                auc_diff, auc_half, _ = _interval(aucs[(reg, alg, corr, "")], aucs[(reg, alg, "none", "")])
                have = by_key[(reg, alg, corr)]
                over = (overheads or {}).get(corr) or {}
                block.append({
                    "regime": regime, "algo": algo, "correction": corr, "seeds": pairs,
                    "final_mean": float(np.mean(list(vals.values()))), "diff": diff, "half_width": half,
                    "auc_diff": auc_diff, "auc_half_width": auc_half,
                    "masked_fraction": mean_of(have, "masked_fraction"),
                    "mismatch_kl": mean_of(have, "mismatch_kl"),
                    "overhead": 1.0 if corr == "none" else over.get("ratio_median"),
                    "overhead_range": ([over["ratio_min"], over["ratio_max"]] if "ratio_min" in over else None)})
            # none (0 by definition) before the corrections that change nothing (identities here)
            block.sort(key=lambda row: (-row["diff"], row["correction"] != "none", row["correction"]))
            rows += [dict(row, rank=i + 1, planned=planned.get((regime, algo, row["correction"], ""), row["seeds"]))
                     for i, row in enumerate(block)]
            ranked = {row["correction"] for row in block}
            rows += [_missing_row(regime, algo, corr, n) for (reg, alg, corr, _), n in planned.items()
                     if (reg, alg) == (regime, algo) and corr not in ranked]
    return rows


def r3_rows(records: Sequence[Mapping], *, planned: Mapping[tuple, int] | None = None) -> list[dict]:
    """The MoE regime, per algorithm and correction: seed-mean final pass@1 without R3
    (``record``) and with it (``replay``), the paired R3-minus-no-R3 difference (95% t), and the
    measured router disagreement (share of (token, layer) whose top-k expert set differs between
    the bf16 sampler and the f32 trainer) of each arm, with its min / max over seeds. An arm
    without records has None figures (``seeds_no_r3`` / ``seeds_r3``: its finished seeds);
    ``planned`` (:func:`planned_seeds`) adds the planned (algo, correction) pairs none of whose
    cells has finished."""
    finals = per_seed(records)
    dis = per_seed([r for r in records if r.get("router_disagreement") is not None], "router_disagreement")
    pairs = [(k[1], k[2]) for k in planned or {} if k[0] == "moe"]
    pairs += [(algo, corr) for (regime, algo, corr, _) in finals if regime == "moe"]
    rows = []
    for algo, corr in dict.fromkeys(pairs):
        base = finals.get(("moe", algo, corr, "record"), {})
        vals = finals.get(("moe", algo, corr, "replay"), {})
        diff, half, n = _interval(vals, base)
        row = {"algo": algo, "correction": corr, "seeds": n, "seeds_no_r3": len(base), "seeds_r3": len(vals),
               "planned": (planned or {}).get(("moe", algo, corr, "replay")), "diff": diff, "half_width": half,
               "final_no_r3": float(np.mean(list(base.values()))) if base else None,
               "final_r3": float(np.mean(list(vals.values()))) if vals else None}
        for arm in ("record", "replay"):
            d = list(dis.get(("moe", algo, corr, arm), {}).values())
            row[f"disagreement_{arm}"] = float(np.mean(d)) if d else None
            row[f"disagreement_{arm}_range"] = [float(min(d)), float(max(d))] if d else None
        rows.append(row)
    return rows


def lag1_controls(records: Sequence[Mapping]) -> list[dict]:
    """Per dense regime and algorithm: the uncorrected run minus the lag-1 run, paired by seed
    (final pass@1, 95% t): is the regime degraded at the study's own seeds?"""
    finals = per_seed(records)
    rows = []
    for (regime, algo, corr, _), vals in finals.items():
        if corr != "none" or regime not in ("staleness", "lr"):
            continue
        base = finals.get(("lag1", algo, "none", ""), {})
        diff, half, pairs = _interval(vals, base)
        if pairs:
            rows.append({"regime": regime, "algo": algo, "seeds": pairs, "final_mean": float(np.mean(
                list(vals.values()))), "lag1_mean": float(np.mean([base[s] for s in vals if s in base])),
                "diff": diff, "half_width": half})
    return rows


def progress(cells: Sequence[Cell], records: Sequence[Mapping]) -> list[dict]:
    """Per (regime, algo) block of the study's ``cells`` (in run order, the lag-1 controls a
    block of their own): ``{"regime", "algo", "done", "planned", "missing"}``: the block's cells
    with a record (by label), all of them, and those without one."""
    have = {r["label"] for r in records}
    blocks: dict[tuple, dict] = {}
    for c in cells:
        row = blocks.setdefault((regime_of(c._asdict()), c.algo), {
            "regime": regime_of(c._asdict()), "algo": c.algo, "done": 0, "planned": 0, "missing": 0})
        row["planned"] += 1
        row["done" if c.label in have else "missing"] += 1
    return list(blocks.values())
