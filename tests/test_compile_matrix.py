"""The compile-record matrix (:mod:`jaxflow.compile_only.matrix`): synthetic reports written to
a temporary directory (a current one, old ones) and the real layout rule's exit-2 line, rendered
as the README's rows; nothing compiled."""

from __future__ import annotations

import json

from jaxflow.compile_only import matrix

GIB = 2 ** 30
TARGETS = ("tpu-v5p:4x4x4", "tpu-v6e:16x16")


def _program(name, kind, total_gib, *, pallas=0, status="ok", mfu=None):
    return {"name": name, "kind": kind, "status": status,
            "memory": {"total_bytes": int(total_gib * GIB), "capacity_bytes": 95 * GIB},
            "kernels": {"pallas": {}, "pallas_count": pallas, "cudnn": {}, "cudnn_count": 0},
            "roofline_mfu_bound": None if mfu is None else mfu[0],
            "mfu_estimate": None if mfu is None else mfu[1]}


def _current_report(layout):
    """A fitting current-format report: the largest program is not the step, the first train
    program with the efficiency figures is not named *step, one program does not fit."""
    return {
        "experiment": "flowtrain", "git_commit": "a" * 40, "wall_seconds": 250.4, "layout": layout,
        "chip": {"name": "v5p", "hbm_bytes": 95 * GIB},
        "compile_seconds": {"init": {"lower": 1.0, "compile": 2.0},
                            "encoder/update": {"lower": 3.0, "compile": 40.0},
                            "train/step": {"lower": 10.0, "compile": 90.5},
                            "eval": {"lower": 4.0, "compile": 5.0}},
        "kernel_fallbacks": [{"kernel": "splash", "programs": ["eval"]}],
        "programs": [_program("init", "forward", 2.0),
                     _program("encoder/update", "train", 20.0, mfu=(0.9, 0.8)),
                     _program("train/step", "train", 60.0, pallas=128, mfu=(1.0, 0.583)),
                     _program("eval", "forward", 70.25, pallas=32),
                     _program("big", "forward", 1.0, status="does_not_fit")],
    }


def _old_report(commit):
    """A report from before compile seconds: per-program ``mfu``, no ``compile_seconds``."""
    return {"experiment": "bench_rollout", "git_commit": commit, "wall_seconds": 71.0,
            "programs": [{"name": "rollout/engine/prefill", "kind": "sample", "status": "ok",
                          "mfu": 0.1, "memory": {"total_bytes": GIB}}]}


def test_matrix_rows_current_old_exit2_and_missing(tmp_path):
    exit2, layout = matrix.rule("flowtrain", "tpu-v5p:4x4x4")
    assert exit2 is None and layout.startswith("layout for 64 v5p: monolithic mesh 16x4 (data x "
                                               "model), decoupled splits 4 + 30x2, 8 + 28x2")
    reports = {"flowtrain-full-tpu-v5p-4x4x4.json": _current_report(layout),
               "flowtrain-full-tpu-v6e-16x16.json": _old_report("c" * 40),
               "bench_rollout-full-tpu-v5p-4x4x4.json": _old_report("b" * 40)}
    for name, report in reports.items():
        (tmp_path / name).write_text(json.dumps(report))
    rows = matrix.collect(["flowtrain", "bench_rollout"], TARGETS, reports=tmp_path)
    assert [(r.name, r.target, r.status) for r in rows] == [
        ("flowtrain", "tpu-v5p:4x4x4", "current"), ("flowtrain", "tpu-v6e:16x16", "exit 2"),
        ("bench_rollout", "tpu-v5p:4x4x4", "old"), ("bench_rollout", "tpu-v6e:16x16", "missing")]

    f = rows[0].figures
    assert f["hbm_program"] == "eval" and f["hbm_gib"] == 70.25 and f["capacity_gib"] == 95.0
    assert f["slowest"] == ("train/step", 100.5) and f["total_seconds"] == 155.5
    assert f["pallas_calls"] == 160 and f["fallbacks"] == 1
    assert (f["step"], f["mfu_bound"], f["mfu_estimate"]) == ("train/step", 1.0, 0.583)
    assert f["not_ok"] == ["big (does_not_fit)"]

    # The rule's line, as the runner prints it before compiling (the old file is noted).
    exit2 = rows[1].text
    assert exit2.startswith("python -m jaxflow.run: error: flowtrain [full] on --target "
                            "tpu-v6e:16x16 (256 x v6e): 256 samples"), exit2
    assert exit2.endswith("the smallest target this estimate fits: tpu-v5p:4x4x4 "
                          "(a report of commit cccccccc predates the rule)"), exit2

    table = matrix.render(rows, {"a" * 40: "2026-12-07", "b" * 40: "2026-12-05"}).splitlines()
    assert "Cells: 1 current, 0 stale, 0 failed, 1 exit 2, 1 old, 1 missing." in table
    body = table[table.index("|---|---|---|---|---|---|---|---|---|---|") + 1:]
    assert body[0] == ("| flowtrain | tpu-v5p:4x4x4 | current | 70.2 / 95.0 (eval); not ok: "
                       "big (does_not_fit) | 100.5 (train/step) / 155.5 | 250 | 160 | 1 | "
                       "100.0% / 58.3% (train/step) | aaaaaaaa (2026-12-07) |")
    assert body[1].startswith("| flowtrain | tpu-v6e:16x16 | exit 2 | python -m jaxflow.run: "
                              "error: flowtrain [full]") and body[1].endswith("| | | | | |  |")
    assert body[2] == ("| bench_rollout | tpu-v5p:4x4x4 | old | old report (commit bbbbbbbb, no "
                       "compile seconds) | | | | | | bbbbbbbb (2026-12-05) |")
    assert body[3] == "| bench_rollout | tpu-v6e:16x16 | missing |  | | | | | |  |"
    assert len(body) == 4

    # A current report laid out otherwise than the rule does today is stale, its figures shown.
    stale = matrix.matrix_row("flowtrain", "tpu-v5p:4x4x4", report=_current_report("mesh 64x1"),
                              rule=(None, layout))
    assert stale.status == "stale" and stale.figures == rows[0].figures
    assert stale.text == f"the rule lays it out otherwise now: {layout}; the report: mesh 64x1"
    # Only the estimate's figures differ: the same programs, current.
    other_figures = layout.split(" (estimates: ")[0] + " (estimates: params 1.0 = 1.0 GiB)"
    assert other_figures != layout
    same = matrix.matrix_row("flowtrain", "tpu-v5p:4x4x4", report=_current_report(other_figures),
                             rule=(None, layout))
    assert same.status == "current", same.text
    broken = _current_report(layout)
    broken["programs"].append({"name": "sample", "kind": "sample", "status": "failed",
                               "error": "JaxRuntimeError: INTERNAL:\n  RET_CHECK failure",
                               "memory": {"total_bytes": None}})
    failed = matrix.matrix_row("flowtrain", "tpu-v5p:4x4x4", report=broken, rule=(None, layout))
    assert failed.status == "failed" and failed.figures["hbm_program"] == "eval"
    assert failed.text == ("1 program(s) failed to compile; sample: JaxRuntimeError: INTERNAL: "
                           "RET_CHECK failure")
    assert failed.figures["not_ok"] == ["big (does_not_fit)", "sample (failed)"]
    # The host's load, where the report records it, stands beside the wall seconds.
    loaded = _current_report(layout) | {"host": {"cpus": 2, "load_1min": [0.43, 2.61]}}
    row = matrix.matrix_row("flowtrain", "tpu-v5p:4x4x4", report=loaded, rule=(None, layout))
    assert row.figures["load"] == [0.43, 2.61] and rows[0].figures["load"] is None
    assert "| 100.5 (train/step) / 155.5 | 250 (load 0.4 -> 2.6) | 160 |" in matrix.render([row])
    line = matrix.render([stale]).splitlines()[-1]
    assert line.startswith("| flowtrain | tpu-v5p:4x4x4 | stale | 70.2 / 95.0 (eval); not ok: big "
                           "(does_not_fit); the rule lays it out otherwise now: layout "
                           "for 64 v5p"), line
