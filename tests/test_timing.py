"""Fair timing helpers: seeded random order per round, paired ratios, the measured mode choice."""

import time

import pytest

from jaxflow.timing import auto_summary, choose_mode, median_of_runs, paired_rounds, repeated_runs


class FakeClock:
    """A clock that only moves when a fake mode 'runs' (known costs, no noise)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def mode(self, cost):
        def run():
            self.now += cost
        return run


def test_paired_rounds_orders_vary_are_seeded_and_ratios_pair_each_round():
    clock = FakeClock()
    modes = {"sync": clock.mode(0.04), "dbp": clock.mode(0.02), "fwp": clock.mode(0.05)}
    out = paired_rounds(modes, rounds=12, baseline="sync", seed=3, clock=clock)
    assert len(out["order"]) == 12 and all(sorted(o) == sorted(modes) for o in out["order"])
    firsts = {o[0] for o in out["order"]}
    assert len(firsts) > 1, "the same mode ran first in every round"
    assert out["order"] == paired_rounds(modes, rounds=12, baseline="sync", seed=3,
                                         clock=clock)["order"]
    assert out["order"] != paired_rounds(modes, rounds=12, baseline="sync", seed=4,
                                         clock=clock)["order"]
    assert out["speedup"]["dbp"] == pytest.approx(2.0)
    assert out["speedup"]["fwp"] == pytest.approx(0.8)
    assert out["ratios"]["sync"] == [1.0] * 12 and len(out["ratios"]["fwp"]) == 12


def test_a_mode_returning_its_own_seconds_is_taken_at_its_word():
    out = paired_rounds({"a": lambda: 2.0, "b": lambda: 0.5}, rounds=2, baseline="a")
    assert out["seconds"] == {"a": [2.0, 2.0], "b": [0.5, 0.5]} and out["speedup"]["b"] == 4.0


def test_choose_mode_picks_the_fastest_of_sleeps_with_distinct_lengths():
    calls = {"slow": 0, "mid": 0, "fast": 0}

    def sleeper(name, seconds):
        def run():
            calls[name] += 1
            time.sleep(seconds)
        return run

    modes = {"slow": sleeper("slow", 0.024), "mid": sleeper("mid", 0.012),
             "fast": sleeper("fast", 0.003)}
    out = choose_mode(modes, rounds=5, warmup=1, baseline="slow", seed=0)
    assert out["mode"] == "fast"
    assert calls == {"slow": 6, "mid": 6, "fast": 6}  # 1 warm-up + 5 probe rounds each
    assert out["median_seconds"]["fast"] < out["median_seconds"]["mid"] < \
        out["median_seconds"]["slow"]
    assert out["predicted_speedup"] > 2.0
    assert out["probe_seconds"] >= 5 * (0.024 + 0.012 + 0.003)


def test_choose_mode_with_known_costs_and_bad_input():
    clock = FakeClock()
    out = choose_mode({"sync": clock.mode(3.0), "strict": clock.mode(2.5)}, rounds=3,
                      baseline="sync", clock=clock)
    assert out["mode"] == "strict" and out["predicted_speedup"] == pytest.approx(1.2)
    with pytest.raises(ValueError, match="baseline='lockstep'"):
        paired_rounds({"sync": clock.mode(1.0)}, rounds=2, baseline="lockstep")
    with pytest.raises(ValueError, match="rounds=0"):
        paired_rounds({"sync": clock.mode(1.0)}, rounds=0, baseline="sync")
    with pytest.raises(ValueError, match="at least one mode"):
        choose_mode({})


def test_median_of_runs_keeps_every_run():
    out = median_of_runs([{"dbp": 1.1, "fwp": 0.9}, {"dbp": 0.9, "fwp": 1.0},
                          {"dbp": 1.0, "fwp": 1.2}])
    assert out == {"dbp": {"median": 1.0, "runs": [1.1, 0.9, 1.0]},
                   "fwp": {"median": 1.0, "runs": [0.9, 1.0, 1.2]}}


def test_auto_summary_compares_auto_with_the_best_fixed_modes_interval():
    per_run = median_of_runs([{"sync": 1.0, "dbp": 1.10, "fwp": 0.9, "auto": 1.05},
                              {"sync": 1.0, "dbp": 1.00, "fwp": 0.8, "auto": 1.02},
                              {"sync": 1.0, "dbp": 1.20, "fwp": 1.0, "auto": 1.15}])
    choices = [{"mode": "dbp", "median_seconds": {}, "predicted_speedup": 1.1,
                "probe_seconds": 0.3}, {"mode": "fwp"}, {"mode": "dbp"}]
    out = auto_summary(per_run, choices, ["sync", "dbp", "fwp"])
    assert out["auto_mode"] == "dbp" and out["auto_mode_runs"] == ["dbp", "fwp", "dbp"]
    assert out["auto_best_fixed_mode"] == "dbp" and out["auto_best_fixed_interval"] == [1.0, 1.2]
    assert out["auto_speedup_vs_sync"] == 1.05 and out["auto_within_best_fixed_interval"]
    per_run["auto"] = {"median": 0.97, "runs": [0.97]}
    assert not auto_summary(per_run, choices, ["sync", "dbp", "fwp"])[
        "auto_within_best_fixed_interval"]
    # the baseline is the best fixed mode: its interval is that of its second timing
    # (sync_repeat, the baseline's own run-to-run noise), not the degenerate [1, 1]
    base = median_of_runs([{"sync": 1.0, "sync_repeat": r, "strict": 0.8, "auto": a}
                           for a, r in ((0.99, 1.01), (1.0, 0.98), (0.98, 1.02))])
    out = auto_summary(base, choices, ["sync", "strict"])
    assert out["auto_best_fixed_mode"] == "sync" and out["auto_best_fixed_interval"] == [0.98, 1.02]
    assert out["auto_within_best_fixed_interval"]
    base["auto"] = {"median": 0.9, "runs": [0.9, 0.92, 0.85]}
    assert not auto_summary(base, choices, ["sync", "strict"])["auto_within_best_fixed_interval"]
    del base["sync_repeat"]  # no second timing: [1, 1], so auto must reach 1
    base["auto"] = {"median": 0.99, "runs": [0.99, 1.01, 0.98]}
    assert not auto_summary(base, choices, ["sync", "strict"])["auto_within_best_fixed_interval"]


def test_repeated_runs_reports_the_chosen_modes_figures_as_auto_and_times_the_baseline_twice():
    costs, calls = {"sync": 0.04, "strict": 0.02, "slow": 0.08}, []

    def timed(mode, steps, keep=True):
        def run():  # returns its own seconds (known costs, no noise)
            calls.append((mode, keep))
            return costs[mode] * steps / 4
        return run
    results, choices = repeated_runs(timed, ["sync", "strict", "slow"], runs=2, steps=4,
                                     rounds=3, baseline="sync", seed=0, warm=lambda: None,
                                     candidates=["sync", "strict"], probe_rounds=2)
    assert [c["mode"] for c in choices] == ["strict", "strict"]
    for r in results:
        assert r["ratios"]["auto"] == r["ratios"]["strict"] == [2.0] * 3
        assert r["ratios"]["sync_repeat"] == [1.0] * 3 and r["speedup"]["slow"] == 0.5
    kept = {m for m, keep in calls if keep}
    assert kept == {"sync", "strict", "slow"}  # the probe and the repeat are not kept
    assert sum(1 for m, keep in calls if m == "sync" and not keep) == 2 * (2 + 3)
    with pytest.raises(ValueError, match="not among the timed modes"):
        repeated_runs(timed, ["sync"], runs=1, steps=4, rounds=1, baseline="sync", seed=0,
                      warm=lambda: None, candidates=["dbp"])
