"""The flexmarl speedup baseline: per timing run the faster bit-identical lockstep form
(``sync`` or ``sync_unblocked``), paired per round; auto is judged against it too."""

from __future__ import annotations

import statistics

import pytest

from jaxflow.marl.speedup import LOCKSTEP, auto_vs_lockstep, fastest_lockstep
from jaxflow.timing import median_of_runs


def _seconds():
    # 5 rounds; sync_unblocked is faster in median, but sync wins round 2
    return {"sync": [1.00, 1.10, 0.80, 1.20, 1.00],
            "sync_unblocked": [0.90, 1.00, 0.95, 1.00, 0.92],
            "strict": [0.95, 1.00, 1.00, 1.10, 1.00],
            "sync_repeat": [1.05, 1.00, 1.00, 1.10, 1.00],
            "sync_unblocked_repeat": [0.92, 1.02, 0.95, 0.98, 0.92]}


def test_baseline_is_the_faster_lockstep_form_and_ratios_are_paired_per_round():
    s = _seconds()
    b = fastest_lockstep(s)
    assert b["mode"] == "sync_unblocked"
    assert b["median_seconds"] == {"sync": 1.00, "sync_unblocked": 0.95}
    # strict against the unblocked lockstep of the same round, not against sync
    want = [u / x for u, x in zip(s["sync_unblocked"], s["strict"])]
    assert b["ratios"]["strict"] == pytest.approx(want, rel=0, abs=0)
    assert b["speedup"]["strict"] == statistics.median(want) < 1.0
    assert b["speedup"]["sync_unblocked"] == 1.0
    assert b["speedup"]["sync"] < 1.0
    # the noise floor is the winner's own second timing
    assert b["ratios"]["lockstep_repeat"] == b["ratios"]["sync_unblocked_repeat"]
    # per-round min: round 2 (index 2) takes sync's 0.80, so strict's ratio there is 0.80
    floor = [min(x, y) for x, y in zip(s["sync"], s["sync_unblocked"])]
    assert b["round_min_ratios"]["strict"][2] == pytest.approx(0.80)
    assert b["round_min_ratios"]["strict"] == [f / x for f, x in zip(floor, s["strict"])]
    assert b["round_min_speedup"]["strict"] <= b["speedup"]["strict"]


def test_blocked_lockstep_wins_when_it_is_faster_and_ties_go_to_the_first_form():
    s = _seconds()
    s["sync"], s["sync_unblocked"] = s["sync_unblocked"], s["sync"]
    b = fastest_lockstep(s)
    assert b["mode"] == "sync"
    assert b["ratios"]["lockstep_repeat"] == b["ratios"]["sync_repeat"]
    tie = {"sync": [1.0, 2.0], "sync_unblocked": [2.0, 1.0], "strict": [1.0, 1.0]}
    assert fastest_lockstep(tie)["mode"] == LOCKSTEP[0]
    assert "lockstep_repeat" not in fastest_lockstep(tie)["ratios"]  # no repeat timed


def test_missing_lockstep_form_is_an_error():
    with pytest.raises(ValueError, match="sync_unblocked"):
        fastest_lockstep({"sync": [1.0], "strict": [1.0]})


def _auto(picks, speedups):
    bases = []
    for pick, (strict, repeat) in zip(picks, speedups):
        s = {"sync": [1.1], "sync_unblocked": [1.0], "strict": [1.0 / strict],
             "sync_unblocked_repeat": [1.0 / repeat], "sync_repeat": [1.1]}
        s["auto"] = list(s[pick])
        bases.append(fastest_lockstep(s))
    per_run = median_of_runs([b["speedup"] for b in bases])
    choices = [{"mode": p, "median_seconds": {"sync": 1.1, "sync_unblocked": 1.0,
                                              "strict": 0.9}, "probe_seconds": 1.0}
               for p in picks]
    return auto_vs_lockstep(per_run, choices, [*LOCKSTEP, "strict"])


def test_auto_against_the_fastest_lockstep():
    # lockstep (unblocked) is the best fixed mode: auto picked it, so its figure is 1, inside
    # the repeat's interval [0.97, 1.02]
    out = _auto(["sync_unblocked"] * 3, [(0.92, 0.97), (0.93, 1.02), (0.95, 1.0)])
    assert out["auto_best_fixed_mode"] == "sync_unblocked"
    assert out["auto_speedup_vs_lockstep"] == 1.0
    assert out["auto_best_fixed_interval"] == pytest.approx([0.97, 1.02])
    assert out["auto_within_best_fixed_interval"] is True
    assert out["auto_probe"][0]["predicted_speedup_vs_lockstep"] == pytest.approx(1.0)
    # auto picked strict, which lost to lockstep: outside the interval
    out = _auto(["strict"] * 3, [(0.92, 0.97), (0.93, 0.99), (0.95, 1.0)])
    assert out["auto_mode"] == "strict"
    assert out["auto_speedup_vs_lockstep"] == pytest.approx(0.93)
    assert out["auto_within_best_fixed_interval"] is False
    assert out["auto_probe"][0]["predicted_speedup_vs_lockstep"] == pytest.approx(1.0 / 0.9)


def test_calibration_reads_the_blocked_lockstep_not_the_speed_baseline():
    from jaxflow.marl.simulate.calibration import measured_from_summary

    counts = {"agents": 2, "group_size": 4, "decode_steps": 124.0, "solver_sample_tokens": 11,
              "solver_params": 85184.0, "params": {"solver": 85184.0, "verifier": 11808.0}}
    old = {"config": {"steps": 4, "n_inputs": 4}, "calibration_counts": counts,
           "baseline_samples_per_s": 900.0,
           "baseline_utilisation": {"rollout": 0.75, "train/solver": 0.14,
                                    "train/verifier": 0.09}}
    # a current summary: baseline_* is the faster (unblocked) lockstep, whose trainer busy
    # seconds are host seconds; the calibration must take the blocked sync_* figures
    new = old | {"baseline_samples_per_s": 1000.0,
                 "baseline_utilisation": {"rollout": 0.9, "train/solver": 0.01,
                                          "train/verifier": 0.01},
                 "sync_samples_per_s": 800.0,
                 "sync_utilisation": {"rollout": 0.7, "train/solver": 0.16,
                                      "train/verifier": 0.08}}
    m = measured_from_summary(new)
    assert (m.samples_per_s, m.busy_rollout, m.busy_train_solver, m.busy_train_verifier) == (
        800.0, 0.7, 0.16, 0.08)
    m = measured_from_summary(old)  # written before the baseline change: baseline_* was sync
    assert (m.samples_per_s, m.busy_rollout) == (900.0, 0.75)
