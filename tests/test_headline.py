"""jaxflow.study.headline: the strongest-baseline rule, arm comparisons, spreads, targets, stale
calibrations and the summary's ``headlines`` list (the contract jaxflow/results reads)."""

import json
import math

import pytest

from jaxflow.study import (
    Headline,
    headline_from_arms,
    mark_stale,
    met,
    paired_by_seed,
    range_spread,
    seed_spread,
    strongest_baseline,
    with_headlines,
)

CONTRACT_KEYS = {"name", "metric", "algorithm", "baseline", "baseline_rule", "baselines", "value", "unit",
                 "higher_is_better", "spread", "target", "target_text", "met"}


def test_strongest_baseline_picks_the_best_measured_arm_and_names_all_in_the_rule():
    best, rule = strongest_baseline({"sync": 100.0, "sparse_dist": 122.0, "gone": None}, higher_is_better=True)
    assert best == "sparse_dist"
    assert "sync, sparse_dist" in rule and "gone" not in rule
    best, _ = strongest_baseline({"padded": 2.0, "packed": 1.5}, higher_is_better=False)
    assert best == "packed"
    with pytest.raises(ValueError, match="no finite baseline"):
        strongest_baseline({"a": float("nan")}, higher_is_better=True)


def test_ratio_is_against_the_strongest_and_oriented_for_times():
    # samples/s: fwp 0.8x the strongest (sparse_dist), though 1.2x sync
    h = headline_from_arms("tput", "samples/s ratio", "dbp+fwp", {"sync": 100.0, "sparse_dist": 150.0,
                           "dbp+fwp": 120.0}, baselines=("sync", "sparse_dist"), target=1.5)
    assert (h.baseline, h.unit, h.met) == ("sparse_dist", "x", False)
    assert h.value == pytest.approx(0.8)
    # seconds per step (lower is better): ratio baseline / arm, > 1 is faster
    t = headline_from_arms("step", "step time ratio", "decoupled", {"padded": 3.0, "packed": 2.0,
                           "decoupled": 1.6}, baselines=("padded", "packed"), higher_is_better=False,
                           target=1.5)
    assert t.baseline == "packed" and t.higher_is_better
    assert t.value == pytest.approx(1.25) and t.met is False
    assert t.baselines == {"padded": 3.0, "packed": 2.0}


def test_difference_with_a_paired_seed_interval():
    arm = {0: 0.80, 1: 0.85, 2: 0.90}
    base = {0: 0.50, 1: 0.52, 2: 0.49}
    h = headline_from_arms("gain", "accuracy gain", "flagship", {"flagship": 0.85, "dense": 0.503},
                           baselines=("dense",), compare="difference", unit="accuracy",
                           per_seed={"flagship": arm, "dense": base}, target=0.0)
    assert h.value == pytest.approx(0.85 - 0.503) and h.met
    pi = paired_by_seed(arm, base)
    assert h.spread.kind == "seeds" and h.spread.n == 3
    assert (h.spread.low, h.spread.high) == pytest.approx((pi.mean - pi.half_width, pi.mean + pi.half_width))
    assert seed_spread({0: 1.0}, {0: 2.0}) is None  # one shared seed: no interval


def test_ratio_seed_spread_and_round_ranges():
    s = seed_spread({0: 2.0, 1: 4.0}, {0: 1.0, 1: 2.0}, compare="ratio")
    assert (s.low, s.high) == pytest.approx((2.0, 2.0))  # both seeds give 2x: zero width
    r = range_spread([1.1, float("nan"), 0.9, 1.3], kind="pairs")
    assert (r.n, r.low, r.high, r.interval) == (3, 0.9, 1.3, "range of alternated pairs")
    assert range_spread([]) is None
    h = headline_from_arms("s", "speedup", "fwp", {"sync": 1.0, "fwp": 1.2}, baselines=("sync",),
                           compare="value", rounds={"fwp": [1.1, 1.3]})
    assert h.baseline is None and h.value == 1.2 and h.spread.kind == "rounds"
    # per-round speedups vs sync: the headline's rounds are arm / strongest baseline round by round
    h = headline_from_arms("s", "speedup", "fwp", {"sync": 1.0, "sparse_dist": 1.2, "fwp": 0.96},
                           baselines=("sync", "sparse_dist"),
                           rounds={"sync": [1.0, 1.0], "sparse_dist": [1.2, 1.0], "fwp": [0.96, 0.9]})
    assert h.baseline == "sparse_dist" and h.value == pytest.approx(0.8)
    assert (h.spread.n, h.spread.low, h.spread.high) == (2, pytest.approx(0.8), pytest.approx(0.9))


def test_met_and_errors():
    assert met(1.5, 1.5) is True and met(1.49, 1.5) is False
    assert met(0.2, 0.25, higher_is_better=False) is True
    assert met(math.nan, 1.0) is None and met(2.0, None) is None
    with pytest.raises(ValueError, match="compare='ratios'"):
        headline_from_arms("x", "m", "a", {"a": 1.0}, baselines=(), compare="ratios")
    with pytest.raises(ValueError, match="arm 'a' has no finite figure"):
        headline_from_arms("x", "m", "a", {"b": 1.0}, baselines=("b",))


def test_stale_is_in_the_line_and_the_json():
    h = headline_from_arms("sim", "simulated speedup", "fwp", {"fwp": 3.0}, baselines=())
    s = mark_stale(h, "319de7791970d742ab")
    assert s.stale is True and h.stale is None
    assert s.line().endswith("(stale calibration: measured code changed since 319de7791970)")
    assert s.to_json()["stale"] is True


def test_with_headlines_writes_the_contract_and_keeps_a_failing_builder_one_line():
    def builder(summary):
        return [headline_from_arms("tput", "samples/s ratio", "fwp", summary["sps"], baselines=("sync",),
                                   target=1.5, target_text=">= 1.5x the strongest baseline")]

    lines = []
    out = with_headlines({"sps": {"sync": 2.0, "fwp": 3.0}}, builder, log=lines.append)
    (h,) = json.loads(json.dumps(out["headlines"]))
    assert CONTRACT_KEYS <= set(h)
    assert (h["value"], h["baseline"], h["met"], h["unit"]) == (1.5, "sync", True, "x")
    assert lines == ["headline " + Headline(**{**_fields(h), "spread": None}).line()]
    out = with_headlines({}, builder)
    assert out["headlines"] == [] and out["headlines_error"] == "KeyError: 'sps'"
    out = with_headlines({"x": 1}, lambda s: [next(iter(()))])  # any error: the figures are still written
    assert out["x"] == 1 and out["headlines_error"].startswith("StopIteration")
    assert with_headlines({"a": 1}, "") == {"a": 1}
    with pytest.raises(ValueError, match="HEADLINES='jaxflow.study:nothing_here': not a function"):
        with_headlines({}, "jaxflow.study:nothing_here")


def _fields(h):
    return {k: h[k] for k in ("name", "metric", "algorithm", "baseline", "baseline_rule", "baselines", "value",
                              "unit", "higher_is_better", "target", "target_text", "met")}
