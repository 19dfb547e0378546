"""corrections_study: the cell list as specified (every correction in both dense regimes, the MoE
regime with and without R3), the ranking / R3 / control rows and the headlines on hand-made
records, the overhead arm on tiny shapes; no training run."""

import dataclasses
import json

import jax
import pytest

from configs.corrections_study import Config, StudyGrid, get_config
from configs.sis_regime import get_config as regime_config
from jaxflow.rl import corrections_study as cs
from jaxflow.rl import sis_regime
from jaxflow.rl.correction_overhead import loss_step_overheads, recorded_sis_overhead
from jaxflow.rl.corrections_study_report import (
    format_progress,
    format_r3,
    format_ranking,
    main,
    report_from_dir,
    seed_figures,
    standing,
)
from jaxflow.rl.offpolicy_cells import Cell
from jaxflow.rl.policy_loss import CORRECTIONS
from jaxflow.study import headlines_rl


def test_default_cells_cover_every_correction_in_both_regimes_and_the_moe_regime():
    study = get_config("default").study
    cells = cs.study_cells(study)
    labels = [c.label for c in cells]
    assert len(labels) == len(set(labels))
    # staleness: lag-1 control + 19 corrections, lr: 19 (control shared), MoE: record + replay
    assert len(CORRECTIONS) == 19
    assert len(cells) == 2 * 8 * (1 + 19) + 2 * 8 * 19 + 2 * 8
    for regime in ("staleness", "lr"):
        for algo in ("grpo", "dapo"):
            got = {(c.correction, c.seed) for c in cells if c.algo == algo and cs.regime_of(c._asdict()) == regime}
            assert got == {(c, s) for c in CORRECTIONS for s in range(8)}
    moe = [c for c in cells if c.moe]
    assert {(c.moe, c.mismatch, c.lag, c.algo) for c in moe} == {(m, "bf16", 4, "grpo") for m in ("record", "replay")}
    # run order: GRPO staleness first (seeds outermost: the lag-1 control opens each seed), then MoE
    assert cells[0] == Cell("grpo", "none", "none", 1, 0, 0)
    assert [c.seed for c in cells[:21]] == [0] * 20 + [1]
    assert all(c.staleness == 4 and c.algo == "grpo" for c in cells[1:160] if c.lag != 1)
    assert cells[160].moe == "record"


def test_cell_labels_equal_sis_regime_labels_so_its_runs_can_be_reused():
    study = get_config("default").study
    regime = regime_config("default")
    got = {c.label for c in cs.study_cells(study)}
    assert sis_regime.regime_cell(regime, "staleness", 4, algo="dapo", correction="tis", seed=3,
                                  inner_lag=4).label in got
    assert sis_regime.regime_cell(regime, "lr", (3.0, 8), algo="grpo", correction="sis", seed=7).label in got
    assert Cell("grpo", "none", "none", 1, 0, 0).label == "grpo-none-none-lag1-k0-s0"
    assert Cell("grpo", "none", "bf16", 4, 0, 1, moe="replay").label == "grpo-none-bf16-lag4-k0-moe-replay-s1"


def test_quick_variant_runs_every_code_path():
    quick = get_config("quick")
    cells = cs.study_cells(quick.study)
    assert {c.correction for c in cells} == {"none", "sis_b"}
    assert {c.moe for c in cells} == {"", "record", "replay"}
    assert {cs.regime_of(c._asdict()) for c in cells} == {"lag1", "staleness", "lr", "moe"}
    assert len(cells) == 2 * (1 + 2 + 2 + 2)
    # the stale version advances within the quick run (rollout r samples version r - 1 - k)
    assert quick.train.rollouts > quick.study.staleness + 1


@pytest.mark.parametrize("kw, match", [
    (dict(corrections=("none", "vtrace")), r"^study.corrections=\('none', 'vtrace'\): unknown \['vtrace'\]; valid: "),
    (dict(corrections=("tis",)), r"^study.corrections=\('tis',\): need 'none' \(the control\)$"),
    (dict(moe_mismatch="none"), r"^study.moe_mismatch='none': the MoE regime needs a sampler mismatch"),
    (dict(regimes=("lag",)), r"^study.regimes=\('lag',\): unknown \['lag'\]"),
    (dict(seeds=0), r"^study.seeds=0: need an int >= 1$")])
def test_bad_study_settings_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        StudyGrid(**kw)


def test_the_moe_warm_start_must_be_an_moe_and_lags_must_split_the_rollout():
    base = Config()
    with pytest.raises(ValueError, match=r"^moe_pretrain.model.n_experts=0: "):
        dataclasses.replace(base, moe_pretrain=base.pretrain)
    with pytest.raises(ValueError, match=r"^lag 3: 256 rows per rollout do not split into 3 mini-batches$"):
        dataclasses.replace(base, study=StudyGrid(lr_lag=3))
    assert base.moe_pretrain.model.n_experts == 4 and base.moe_pretrain.model.architecture == "qwen3_moe"


def _rec(cell: Cell, final: float, **extra) -> dict:
    return {"label": cell.label, **cell._asdict(), "final_accuracy": final, "auc": final / 2,
            "masked_fraction": None, "mismatch_kl": 1e-3, **extra}


def _records():
    study = StudyGrid(algos=("grpo",), corrections=("none", "tis", "icepop", "sis"), seeds=3)
    finals = {"none": [0.5, 0.6, 0.55], "tis": [0.7, 0.75, 0.72], "icepop": [0.6, 0.62, 0.66], "sis": [0.4, 0.5, 0.5]}
    recs = []
    for cell in cs.study_cells(study):
        if cell.moe:
            recs.append(_rec(cell, 0.3 + 0.1 * (cell.moe == "replay") + 0.01 * cell.seed,
                             router_disagreement=0.02 + 0.01 * cell.seed if cell.moe == "record" else 0.0))
        elif cell.lag == 1:
            recs.append(_rec(cell, 0.8))
        else:
            shift = 0.0 if cell.staleness else -0.1
            recs.append(_rec(cell, finals[cell.correction][cell.seed] + shift, masked_fraction=0.01))
    return study, recs


def test_ranking_orders_corrections_by_paired_effect_none_at_zero():
    study, recs = _records()
    overheads = {"tis": {"ratio_median": 1.01, "ratio_min": 0.9, "ratio_max": 1.2}}
    rows = cs.rank_corrections(recs, overheads)
    stale = [r for r in rows if r["regime"] == "staleness"]
    assert [r["correction"] for r in stale] == ["tis", "icepop", "none", "sis"]
    assert [r["rank"] for r in stale] == [1, 2, 3, 4]
    tis = stale[0]
    assert tis["diff"] == pytest.approx((0.2 + 0.15 + 0.17) / 3) and tis["seeds"] == 3 and tis["half_width"] > 0
    assert (tis["overhead"], tis["overhead_range"]) == (1.01, [0.9, 1.2])
    assert stale[1]["overhead"] is None and stale[2]["overhead"] == 1.0 and stale[3]["diff"] < 0
    # a correction equal to none (an identity in the regime) ranks after none
    same = [dict(r, final_accuracy=0.5) if r["correction"] in ("none", "icepop") and r["staleness"] else r
            for r in recs]
    assert [r["correction"] for r in cs.rank_corrections(same) if r["regime"] == "staleness"][1:3] == ["none", "icepop"]
    assert {r["regime"] for r in rows} == {"staleness", "lr"}
    # a correction without a paired none seed is left out
    no_none = [r for r in recs if not (r["correction"] == "none" and r["staleness"])]
    assert not [r for r in cs.rank_corrections(no_none) if r["regime"] == "staleness"]
    text = format_ranking(rows, study)
    assert "**grpo, async staleness k=4, N=4**" in text and "| 1 | tis | 3 | 0.723 | +0.173 +- " in text
    # icepop's interval holds 0, sis's lies below it
    lines = [x for x in text.splitlines() if x.startswith("Standing: best tis +0.173 +- ")]  # staleness, lr
    assert len(lines) == 2
    ends = " against none; 95% interval above 0: tis; below 0: sis; none rank 3 of 4, sis rank 4 of 4."
    assert all(x.endswith(ends) for x in lines)
    assert "Standing: best none" not in text and standing([]) == "Standing: no correction has a paired seed yet."


def test_controls_and_r3_rows():
    _, recs = _records()
    controls = {r["regime"]: r for r in cs.lag1_controls(recs)}
    assert controls["staleness"]["diff"] == pytest.approx(0.55 - 0.8)
    assert controls["lr"]["diff"] == pytest.approx(0.45 - 0.8)
    (r3,) = cs.r3_rows(recs)
    assert r3["diff"] == pytest.approx(0.1) and r3["seeds"] == 3
    assert r3["disagreement_record"] == pytest.approx(0.03)
    assert r3["disagreement_record_range"] == pytest.approx([0.02, 0.04])
    assert r3["disagreement_replay"] == 0.0
    assert "| grpo | none | 3 | 0.310 | 0.410 | +0.100 +- 0.000 | 0.0300 [0.0200, 0.0400] |" in format_r3([r3])


def test_a_partial_study_shows_its_missing_cells_as_missing():
    study, recs = _records()
    # icepop has not run at all, lr has not started, the MoE regime has its no-R3 arm only
    part = [r for r in recs if r["correction"] != "icepop" and cs.regime_of(r) != "lr" and r["moe"] != "replay"]
    planned = cs.planned_seeds(cs.study_cells(study))
    rows = cs.rank_corrections(part, planned=planned)
    stale = [(r["correction"], r["rank"], r["seeds"], r["planned"]) for r in rows if r["regime"] == "staleness"]
    assert stale == [("tis", 1, 3, 3), ("none", 2, 3, 3), ("sis", 3, 3, 3), ("icepop", None, 0, 3)]
    assert {r["correction"] for r in rows if r["regime"] == "lr"} == {"none", "tis", "icepop", "sis"}
    assert all(r["rank"] is None and r["diff"] is None for r in rows if r["regime"] == "lr")
    text = format_ranking(rows, study)
    assert "| - | icepop | 0/3 | missing | - |" in text
    assert "**grpo, lr x3 at policy lag N=8**: missing (no correction has a finished seed paired with none's; " \
           "12 cells planned)" in text
    (r3,) = cs.r3_rows(part, planned=planned)
    assert (r3["seeds"], r3["seeds_no_r3"], r3["seeds_r3"], r3["final_r3"], r3["diff"]) == (0, 3, 0, None, None)
    assert "| grpo | none | 0/3 | 0.310 | missing | - | 0.0300 [0.0200, 0.0400] | - |" in format_r3([r3])
    progress = {(p["regime"], p["algo"]): (p["done"], p["planned"], p["missing"])
                for p in cs.progress(cs.study_cells(study), part)}
    assert progress == {("lag1", "grpo"): (3, 3, 0), ("staleness", "grpo"): (9, 12, 3), ("moe", "grpo"): (3, 6, 3),
                        ("lr", "grpo"): (0, 12, 12)}
    assert format_progress(cs.progress(cs.study_cells(study), part)).startswith("Cells: 15/33 finished, 18 missing:")
    assert format_progress(cs.progress(cs.study_cells(study), recs)) == "Cells: 33/33, complete."
    # no cell at all: every table says so instead of failing
    assert "missing" in format_ranking(cs.rank_corrections([], planned=planned), study)
    assert [r["seeds_no_r3"] for r in cs.r3_rows([], planned=planned)] == [0]


def _study_dir(tmp_path, study, records, torn=""):
    config = {"experiment": "corrections_study", "variant": "default",
              "config": {"study": json.loads(json.dumps(dataclasses.asdict(study)))}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    stray = dict(records[0], label="grpo-other-s0")  # not a cell of this study: not counted
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*records, stray]) + torn)
    return tmp_path


def test_report_from_a_run_directory_reads_a_partial_study_without_running_anything(tmp_path, capsys):
    study, recs = _records()
    part = [r for r in recs if r["seed"] < 2 and not r["moe"]]
    run_dir = _study_dir(tmp_path, study, part, torn='{"label": "grpo-tis-none-lag4-k4-s2", "fin')
    before = sorted(p.name for p in tmp_path.iterdir())
    text = report_from_dir(run_dir, bench_records=tmp_path / "no_records")
    assert text.startswith(f"corrections_study report of {run_dir} (default)")
    assert "Cells: 18/33 finished, 15 missing:" in text and "| moe | grpo | 0/6 |" in text
    assert "| 1 | tis | 2/3 | 0.725 | +0.175 +- " in text and "| grpo | none | 0/3 | missing | missing |" in text
    assert "Overheads: not measured in this run yet" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # wrote nothing
    # the same tables as the driver's results.md for the same records
    from jaxflow.rl.corrections_study_report import study_report

    assert "\n\n".join(study_report(study, part, {}, None)[1]) in text
    assert main([str(run_dir)]) == 0 and "| 1 | tis |" in capsys.readouterr().out
    # without this run's overheads the sis column is bench_policy_loss's recorded SIS figure
    bench = tmp_path / "bench"
    bench.mkdir()
    head = {"name": "sis_overhead", "value": 1.2, "spread": {"low": 1.0, "high": 1.4, "n": 10}}
    (bench / "r.json").write_text(json.dumps({"started": "2026-12-06 10:00 UTC", "headlines": [head],
                                              "load": {"start_1min": 6.5, "end_1min": 9.0}}))
    text = report_from_dir(run_dir, bench_records=bench)
    sis = [line for line in text.splitlines() if "| sis | 2/3 |" in line]  # staleness, lr
    assert len(sis) == 2 and all(line.endswith("| 1.200 [1.00, 1.40] |") for line in sis)
    assert "recorded SIS step (the sis column): 1.200x [1.000, 1.400], 10 pairs, r.json (" in text
    assert "load 6.5 -> 9.0)" in text


def test_report_of_a_directory_that_is_no_study_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m jaxflow.rl.corrections_study_report: error: ")
    assert "cannot read config.json" in err and "valid: the --out directory of a corrections_study run" in err
    (tmp_path / "config.json").write_text(json.dumps({"experiment": "sis_regime", "config": {}}))
    with pytest.raises(ValueError, match=r"experiment 'sis_regime'; valid: a corrections_study run$"):
        report_from_dir(tmp_path)
    study, recs = _records()
    _study_dir(tmp_path, study, recs[:2], torn="not json\n" + json.dumps(recs[2]) + "\n")
    with pytest.raises(ValueError, match=r"cells.jsonl: line 4 is not JSON; valid: one cell record per line$"):
        report_from_dir(tmp_path)


def test_headlines_name_the_winner_against_the_strongest_other_and_r3():
    _, recs = _records()
    summary = json.loads(json.dumps({"finals": seed_figures(cs.per_seed(recs))}))
    heads = {h.name: h for h in headlines_rl.corrections_study(summary)}
    stale = heads["best_correction_vs_strongest[staleness, grpo]"]
    assert (stale.algorithm, stale.baseline) == ("grpo + tis", "icepop")
    assert stale.value == pytest.approx((0.7 + 0.75 + 0.72 - 0.6 - 0.62 - 0.66) / 3)
    assert stale.spread.n == 3 and stale.spread.low < stale.value < stale.spread.high
    r3 = heads["r3_vs_no_r3[moe, grpo, none]"]
    assert (r3.baseline, r3.value) == ("no r3", pytest.approx(0.1))
    assert "best_correction_vs_strongest[lr, grpo]" in heads


def test_loss_step_overheads_time_every_correction_against_none():
    from configs.bench_policy_loss import get_config as bench_config

    bench = dataclasses.replace(bench_config("quick"), batch=2, seq_len=8, d_model=8, vocab=32, vocab_tile=32,
                                topk=4)
    out = loss_step_overheads(bench, ("none", "sis_b"), key=jax.random.key(0), pairs=2)  # sis_b: every input
    assert set(out) == {"sis_b"}
    for o in out.values():
        assert o["pairs"] == 2 and 0 < o["ratio_min"] <= o["ratio_median"] <= o["ratio_max"]


def test_recorded_sis_overhead_reads_the_newest_record(tmp_path):
    assert recorded_sis_overhead(tmp_path) is None
    for started, value in (("2026-12-06 10:00 UTC", 1.5), ("2026-12-06 13:00 UTC", 1.2)):
        head = {"name": "sis_overhead", "value": value, "spread": {"low": 1.0, "high": 1.4, "n": 10}}
        (tmp_path / f"{value}.json").write_text(json.dumps({"started": started, "headlines": [head],
                                                            "variant": "quick", "commit": "abcdef0123"}))
    got = recorded_sis_overhead(tmp_path)
    assert (got["ratio_median"], got["pairs"]) == (1.2, 10) and got["source"].startswith("1.2.json")


def test_report_joins_run_directories_of_one_study_split_by_regime(tmp_path, capsys):
    study, recs = _records()
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    dense.mkdir(), moe.mkdir()
    _study_dir(dense, dataclasses.replace(study, regimes=("staleness", "lr")), [r for r in recs if not r["moe"]])
    _study_dir(moe, dataclasses.replace(study, regimes=("moe",)), [r for r in recs if r["moe"]])
    alone = report_from_dir(dense, bench_records=tmp_path / "no_records")
    assert "Cells: 27/27, complete." in alone and "| moe |" not in alone
    text = report_from_dir(dense, moe, bench_records=tmp_path / "no_records")
    assert text.startswith(f"corrections_study report of {dense}, {moe} (default)")
    assert "Cells: 33/33, complete." in text  # the plan of the one study, the cells of both
    from jaxflow.rl.corrections_study_report import study_report

    assert "\n\n".join(study_report(study, recs, {}, None)[1]) in text
    assert main([str(dense), str(moe)]) == 0 and "Cells: 33/33, complete." in capsys.readouterr().out
    _study_dir(moe, dataclasses.replace(study, regimes=("moe",), seeds=2), [r for r in recs if r["moe"]])
    with pytest.raises(ValueError, match=r"study.seeds=2 differs from .*'s 3; valid: run directories of one "
                                         r"study split only by study.regimes$"):
        report_from_dir(dense, moe)
