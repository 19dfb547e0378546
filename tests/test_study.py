"""jaxflow.study: seed grids, cell resume (finished cells skipped, rows read back), seed
intervals and their text, step timing, the warm start's curve point and the results files."""

import itertools
import json
import math

import pytest

from jaxflow.experiment import RunContext
from jaxflow.study import (
    cell_seed,
    curve_from_rows,
    finished_cells,
    format_bounds,
    format_pm,
    mean_of,
    median_after_warmup,
    paired_by_seed,
    paired_interval,
    read_cells,
    record_cell,
    rows_of_cell,
    run_cells,
    sample_sd,
    seed_grid,
    seed_interval,
    timed,
    warm_start_report,
    write_results,
)


class _Cell:
    def __init__(self, label):
        self.label = label


def _run(tmp_path, resume=False):
    return RunContext(name="study", variant="quick", out_dir=tmp_path, resume=resume,
                      tensorboard=False)


def test_seed_grid_seeds_innermost_and_first_block_wins():
    grid = seed_grid([(["a", "b"], 2), (["b", "c"], 3)])
    assert grid == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1), ("c", 2)]
    assert seed_grid([(["a", "a"], 1)]) == [("a", 0)]
    with pytest.raises(ValueError, match="seeds=-1"):
        seed_grid([(["a"], -1)])
    assert cell_seed(3, 7) == 3007 and cell_seed(0, 0) == 0
    with pytest.raises(ValueError, match="index=1000; valid: 0 <= index < stride=1000"):
        cell_seed(1, 1000)


def test_run_cells_records_skips_finished_and_clears_checkpoints(tmp_path):
    run = _run(tmp_path)
    (run.checkpoint_dir / "a").mkdir(parents=True)
    calls = []

    def run_one(cell, index):
        calls.append((cell.label, index))
        return {"label": cell.label, "index": index}

    cells = [_Cell("a"), _Cell("b")]
    done = finished_cells(run)  # a fresh run reads nothing back
    assert done == {}
    out = run_cells(cells, run_one, run=run, done=done, describe=lambda r: f"done {r['label']}")
    assert calls == [("a", 0), ("b", 1)] and out.missing == []
    assert [r["label"] for r in out.records] == ["a", "b"] and set(done) == {"a", "b"}
    assert not (run.checkpoint_dir / "a").exists()
    lines = (tmp_path / "cells.jsonl").read_text().splitlines()
    assert [json.loads(x)["label"] for x in lines] == ["a", "b"]

    # --resume: "a" and "b" are read back, "c" runs with the next index of the counter
    resumed = _run(tmp_path, resume=True)
    done = finished_cells(resumed)
    assert set(done) == {"a", "b"}
    calls.clear()
    out = run_cells([*cells, _Cell("c")], run_one, run=resumed, done=done,
                    indices=itertools.count(len(done)))
    assert calls == [("c", 2)] and [r["index"] for r in out.records] == [0, 1, 2]
    assert read_cells(tmp_path).keys() == {"a", "b", "c"}
    out = run_cells([_Cell("d")], run_one, run=resumed, done=done, report_only=True)
    assert out == ([], ["d"]) and calls == [("c", 2)]


def test_read_cells_names_the_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="reuse='.*nowhere'.*cells.jsonl does not exist"):
        read_cells(tmp_path / "nowhere")


def test_rows_of_cell_reads_back_the_rows_before_the_checkpoint(tmp_path):
    run = _run(tmp_path)
    rows = [{"step": i, "cell": c, "rollout": r} for i, (c, r) in
            enumerate([("a", 1), ("a", 2), ("a", 3), ("b", 1)])] + [{"step": 9, "cell": "a"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["rollout"] for r in rows_of_cell(run, field="cell", value="a", upto=2)] == [1, 2]
    assert rows_of_cell(run, field="cell", value="a", upto=0) == []
    record_cell(run, {"label": "x"})
    assert finished_cells(_run(tmp_path, resume=True)) == {"x": {"label": "x"}}


def test_paired_by_seed_pairs_only_shared_seeds():
    iv = paired_by_seed({0: 1.0, 1: 2.0, 2: 4.0, 5: 9.0}, {2: 1.0, 0: 0.5, 1: 0.5})
    ref = paired_interval([1.0, 2.0, 4.0], [0.5, 0.5, 1.0])
    assert iv == ref and iv.n == 3 and iv.mean == pytest.approx(5.0 / 3)
    assert paired_by_seed({0: 1.0}, {1: 1.0}) is None


def test_seed_interval_and_means():
    one = seed_interval([0.5])
    assert one["n"] == 1 and one["mean"] == 0.5 and one["half_width"] is None
    iv = seed_interval([1.0, 2.0, 3.0])
    # sd 1, t_{0.975, 2} = 4.30265 (t table): half width 4.30265 / sqrt(3)
    assert iv["sd"] == pytest.approx(1.0) and iv["half_width"] == pytest.approx(4.30265 / math.sqrt(3), rel=1e-5)
    assert iv["low"] == pytest.approx(2.0 - iv["half_width"])
    with pytest.raises(ValueError, match="at least one value"):
        seed_interval([])
    assert mean_of([{"x": 1.0}, {"x": None}, {}, {"x": 3.0}], "x") == 2.0
    assert mean_of([{"x": None}], "x") is None
    assert sample_sd([1.0, 3.0]) == pytest.approx(math.sqrt(2)) and sample_sd([5.0]) == 0.0
    assert format_pm(0.0123, 0.02) == "+0.012 +- 0.020"
    assert format_bounds([-0.01, 0.0314]) == "[-0.010, +0.031]"


def test_timed_and_median_after_warmup():
    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])
    seconds: list[float] = []
    step = timed(lambda x: x + 1, seconds, clock=lambda: next(ticks))
    assert [step(1), step(2), step(3)] == [2, 3, 4]
    assert seconds == [5.0, 1.0, 3.0]
    assert median_after_warmup(seconds) == 2.0  # the 5 s compile dropped
    assert median_after_warmup([4.0]) is None


def test_warm_start_point_and_block():
    rows = [{"rollout": 1}, {"rollout": 2, "acc": 0.5}, {"rollout": 4, "acc": 0.75}]
    assert curve_from_rows(rows, "acc", start=0.25) == [(0, 0.25), (2, 0.5), (4, 0.75)]
    assert warm_start_report("lm-abc", {"heldout_accuracy": 0.4}, heldout_accuracy=0.3) == {
        "cache": "lm-abc", "pretrain_heldout_accuracy": 0.4, "heldout_accuracy": 0.3}
    assert warm_start_report("lm", {})["pretrain_heldout_accuracy"] is None


def test_write_results(tmp_path):
    text = write_results(_run(tmp_path), [{"a": 1}], ["| t1 |", "| t2 |"])
    assert text == "| t1 |\n\n| t2 |\n" and (tmp_path / "results.md").read_text() == text
    assert json.loads((tmp_path / "results.json").read_text()) == [{"a": 1}]
