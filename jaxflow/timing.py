"""Fair side-by-side timing: seeded random order within rounds, paired ratios, and a measured
choice between modes.

Comparing modes A and B on a shared, noisy machine needs both measured under the same load:
every round runs each mode once, in an order drawn afresh per round from a seeded generator
(so no mode always runs first, right after a warm cache or a quiet moment), and a mode's
figure is the median over rounds of the *paired* ratio baseline time / mode time of the same
round. ``choose_mode`` runs a short probe of that kind and picks the mode with the smallest
median time (the best predicted step time).

A mode is a callable with no arguments that runs one timed unit (e.g. a few training steps
from fresh copies) and either returns its own measured seconds (a ``float``, when it must
exclude set-up such as copying tables) or anything else, in which case the wall time of the
call is taken; a callable must block on its outputs before returning.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["measure", "paired_rounds", "choose_mode", "median_of_runs", "auto_summary",
           "repeat_name"]


def measure(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call: ``fn``'s own figure when it returns a float, else its wall time."""
    t0 = clock()
    out = fn()
    dt = clock() - t0
    return float(out) if isinstance(out, (float, np.floating)) else dt


def paired_rounds(modes: Mapping[str, Callable[[], Any]], *, rounds: int, baseline: str,
                  seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Runs every mode once per round, in a seeded random order per round.

    Returns ``{"order": [[mode, ...] per round], "seconds": {mode: [s per round]},
    "ratios": {mode: [baseline s / mode s per round]} (the pairs, > 1 = faster than the
    baseline), "speedup": {mode: median ratio}, "spread": {mode: [min, max]}}``; the baseline's
    own ratios are all 1.
    """
    if baseline not in modes:
        raise ValueError(f"baseline={baseline!r} is not one of the modes {list(modes)}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}; need >= 1")
    rng = np.random.default_rng([seed, 0x7141])
    names = list(modes)
    seconds: dict[str, list[float]] = {m: [] for m in names}
    orders = []
    for _ in range(rounds):
        order = [names[i] for i in rng.permutation(len(names))]
        orders.append(order)
        for m in order:
            seconds[m].append(measure(modes[m], clock))
    ratios = {m: [b / s for b, s in zip(seconds[baseline], seconds[m])] for m in names}
    return {"order": orders, "seconds": seconds, "ratios": ratios,
            "speedup": {m: statistics.median(r) for m, r in ratios.items()},
            "spread": {m: [min(r), max(r)] for m, r in ratios.items()}}


def choose_mode(modes: Mapping[str, Callable[[], Any]], *, rounds: int = 3, warmup: int = 1,
                baseline: str | None = None, seed: int = 0,
                clock: Callable[[], float] = time.perf_counter) -> dict:
    """A short measured probe: ``warmup`` untimed calls of each mode, then ``rounds`` rounds
    in seeded random order; the choice is the mode with the smallest median seconds.

    Returns ``{"mode": choice, "median_seconds": {mode: s}, "seconds": {mode: [...]},
    "order": [...], "probe_seconds": wall time of the whole probe}`` and, with a
    ``baseline``, ``"predicted_speedup"``: the paired median baseline / choice over the probe.
    """
    if not modes:
        raise ValueError("choose_mode needs at least one mode")
    t0 = clock()
    for _ in range(warmup):
        for fn in modes.values():
            fn()
    ref = baseline if baseline is not None else next(iter(modes))
    probe = paired_rounds(modes, rounds=rounds, baseline=ref, seed=seed, clock=clock)
    med = {m: statistics.median(s) for m, s in probe["seconds"].items()}
    choice = min(med, key=lambda m: (med[m], list(modes).index(m)))
    out = {"mode": choice, "median_seconds": med, "seconds": probe["seconds"],
           "order": probe["order"], "probe_seconds": clock() - t0}
    if baseline is not None:
        out["predicted_speedup"] = probe["speedup"][choice]
    return out


def repeated_runs(timed: Callable[..., Callable[[], float]], modes: Sequence[str], *, runs: int,
                  steps: int, rounds: int, baseline: str, seed: int, warm: Callable[[], Any],
                  candidates: Sequence[str] = (), probe_steps: int = 0, probe_rounds: int = 3,
                  log: Callable[[int, dict, dict | None], Any] | None = None
                  ) -> tuple[list[dict], list[dict]]:
    """``runs`` repetitions of a fair benchmark: per run, ``warm()``, then (with
    ``candidates``, a subset of ``modes``) an auto probe by :func:`choose_mode` of
    ``probe_steps`` (0: ``steps``) steps per call, then :func:`paired_rounds` over every mode
    of ``modes``; run r is seeded ``seed * 1000 + r``. ``"auto"`` is the probe's choice, and
    its figures are the chosen mode's in the same rounds: the probe ran before them, so no
    figure is picked after the fact, and timing the same mode a second time would only add
    its noise. With candidates the rounds also time the baseline a second time,
    :func:`repeat_name` (``"sync_repeat"``): its figures are the baseline's own run-to-run
    interval, which :func:`auto_summary` uses when the baseline is the best fixed mode.

    ``timed(mode, steps, keep=True)`` returns a zero-argument call that runs ``steps`` steps
    of ``mode`` and returns its seconds (``keep=False``: the driver discards the result).
    ``log(r, paired_rounds result, choice or None)`` after each run. Returns (one
    :func:`paired_rounds` result per run, one :func:`choose_mode` result per run or [])."""
    missing = [m for m in candidates if m not in modes]
    if missing:
        raise ValueError(f"auto candidates {missing} are not among the timed modes {list(modes)}")
    results, choices = [], []
    for r in range(runs):
        warm()
        run_seed = seed * 1000 + r
        choice = (choose_mode({m: timed(m, probe_steps or steps, keep=False) for m in candidates},
                              rounds=probe_rounds, warmup=0, baseline=baseline, seed=run_seed)
                  if candidates else None)
        calls = {m: timed(m, steps) for m in modes}
        if choice is not None:  # the baseline's own run-to-run noise (its interval for auto)
            calls[repeat_name(baseline)] = timed(baseline, steps, keep=False)
        results.append(paired_rounds(calls, rounds=rounds, baseline=baseline, seed=run_seed))
        if choice is not None:  # auto *is* the chosen mode: its figures in these rounds
            choices.append(choice)
            for key in ("seconds", "ratios", "spread"):
                results[-1][key]["auto"] = list(results[-1][key][choice["mode"]])
            results[-1]["speedup"]["auto"] = results[-1]["speedup"][choice["mode"]]
        if log is not None:
            log(r, results[-1], choice)
    return results, choices


def repeat_name(baseline: str) -> str:
    """The key of the baseline timed a second time in each round (see :func:`repeated_runs`)."""
    return f"{baseline}_repeat"


def median_of_runs(per_run: list[Mapping[str, float]]) -> dict[str, dict]:
    """Per mode: ``{"median": median over runs, "runs": [each run's figure]}`` from a list of
    per-run ``{mode: figure}`` maps (the headline of a repeated benchmark)."""
    modes = list(per_run[0]) if per_run else []
    return {m: {"median": statistics.median(r[m] for r in per_run),
                "runs": [r[m] for r in per_run]} for m in modes}


def auto_summary(per_run: Mapping[str, Mapping], choices: list[Mapping],
                 candidates: Sequence[str], *, vs: str = "sync",
                 interval_of: Callable[[str], str] | None = None,
                 probe: Callable[[Mapping], dict] | None = None) -> dict:
    """Summary keys of a measured ``auto`` mode beside the fixed ones.

    ``per_run``: ``median_of_runs`` output holding ``"auto"`` and every candidate;
    ``choices``: each run's ``choose_mode`` result. The best fixed mode is the candidate with
    the best median over runs; ``auto_within_best_fixed_interval`` says whether auto's median
    is at least the lowest of that mode's per-run figures (inside its run-to-run interval or
    above it). The baseline's own figures are 1 by definition, so when it is the best its
    interval is that of its second timing (:func:`repeat_name`) when ``per_run`` has one, else
    [1, 1].

    ``vs``: the baseline's name in the ``auto_speedup_vs_<vs>`` key. ``interval_of(best)``: the
    ``per_run`` key whose runs are the best fixed mode's interval (default: as above).
    ``probe(choice)``: a choice's ``auto_probe`` entry (default: its ``median_seconds``,
    ``predicted_speedup`` and ``probe_seconds``, those it has).
    """
    best = max(candidates, key=lambda m: per_run[m]["median"])
    if interval_of is None:
        spread = per_run.get(repeat_name(best), per_run[best])["runs"]
    else:
        spread = per_run[interval_of(best)]["runs"]
    if probe is None:
        def probe(c):
            return {k: c[k] for k in ("median_seconds", "predicted_speedup", "probe_seconds")
                    if k in c}
    lo, hi = min(spread), max(spread)
    auto = per_run["auto"]
    within = auto["median"] >= lo
    picked = [c["mode"] for c in choices]
    return {"auto_mode": max(set(picked), key=lambda m: (picked.count(m), -picked.index(m))),
            "auto_mode_runs": picked,
            f"auto_speedup_vs_{vs}": per_run["auto"]["median"],
            "auto_speedup_runs": per_run["auto"]["runs"],
            "auto_candidates": list(candidates),
            "auto_best_fixed_mode": best,
            "auto_best_fixed_interval": [lo, hi],
            "auto_within_best_fixed_interval": bool(within),
            "auto_probe": [probe(c) for c in choices]}
