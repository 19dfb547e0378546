"""The FlexMARL pipeline's speedup over the fastest bit-identical lockstep: the run modes, their
fair timing and the summary the ``flexmarl`` experiment reports.

Modes (:func:`run_modes`, each ``steps -> RunResult`` from fresh copies of a
:class:`~jaxflow.marl.system.FlexMARLState`'s initial params): the lockstep in two bit-identical
forms, ``sync`` (waits for each agent's step; its stage times calibrate the simulator) and
``sync_unblocked`` (only dispatches them); ``strict`` (the micro-batch pipeline, inline driver),
``strict_threads`` (the same on blocking trainer threads, bit-identical) and
``bounded_etaE`` (rollouts up to E versions ahead).

Timing (CONVENTIONS, :mod:`jaxflow.timing`; :func:`time_modes`): per run an untimed warm-up
of each mode, then ``reps`` rounds each running every mode once (and both lockstep forms a
second time, ``sync_repeat`` / ``sync_unblocked_repeat``) in a seeded random order; ``runs``
such runs. **Baseline of every speedup** (:func:`fastest_lockstep`): per run, whichever of
``sync`` and ``sync_unblocked`` has the smaller median seconds over that run's rounds; a mode's
figure is the median over runs of each run's median paired ratio baseline wall / mode wall of
the same round, min / max over all pairs. ``auto``: a probe of the staleness-free modes picks
the fastest (:func:`auto_vs_lockstep`). :func:`speedup_summary` assembles the figures (see the
``flexmarl`` driver's docstring for every key).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxflow.marl.pipeline import PipelineConfig, RunResult, relative_param_diff, run_pipeline, run_sync
from jaxflow.marl.processes import agree
from jaxflow.marl.system import FlexMARLState, FlexMARLSystem
from jaxflow.timing import auto_summary, median_of_runs, repeat_name, repeated_runs

__all__ = ["LOCKSTEP", "fastest_lockstep", "auto_vs_lockstep", "run_modes", "ModeTimings",
           "time_modes", "speedup_summary", "bit_equal", "median_utilisation"]

LOCKSTEP = ("sync", "sync_unblocked")  # the bit-identical lockstep forms (baseline candidates)


def fastest_lockstep(seconds: Mapping[str, Sequence[float]],
                     lockstep: Sequence[str] = LOCKSTEP) -> dict:
    """The speedup baseline of one timing run and every mode's paired ratios against it.

    ``seconds``: ``{mode: [seconds per round]}`` of one :func:`~jaxflow.timing.paired_rounds`
    run (all lists of length R, round r of every mode measured in the same round). The baseline
    is the ``lockstep`` mode with the smallest median seconds (ties: the first listed).
    Returns ``{"mode": baseline, "median_seconds": {lockstep mode: s}, "ratios": {mode: [R]
    baseline s / mode s per round], "speedup": {mode: median ratio}, "round_min_ratios" /
    "round_min_speedup": the same against min over ``lockstep`` of each round's seconds}``;
    with the baseline's second timing (``repeat_name(baseline)``) in ``seconds`` also
    ``ratios["lockstep_repeat"]`` / ``speedup["lockstep_repeat"]`` (the noise floor)."""
    missing = [m for m in lockstep if m not in seconds]
    if missing:
        raise ValueError(f"lockstep modes {missing} were not timed (timed: {list(seconds)})")
    med = {m: statistics.median(seconds[m]) for m in lockstep}
    base = min(lockstep, key=lambda m: (med[m], list(lockstep).index(m)))
    floor = [min(r) for r in zip(*(seconds[m] for m in lockstep))]

    def against(ref):
        return {m: [b / x for b, x in zip(ref, s)] for m, s in seconds.items()}

    ratios, round_min = against(seconds[base]), against(floor)
    if repeat_name(base) in seconds:
        ratios["lockstep_repeat"] = ratios[repeat_name(base)]
    return {"mode": base, "median_seconds": med, "ratios": ratios,
            "speedup": {m: statistics.median(r) for m, r in ratios.items()},
            "round_min_ratios": round_min,
            "round_min_speedup": {m: statistics.median(r) for m, r in round_min.items()}}


def auto_vs_lockstep(per_run: Mapping[str, Mapping], choices: list[Mapping],
                     candidates: Sequence[str]) -> dict:
    """Summary keys of ``auto`` against the fastest lockstep: :func:`~jaxflow.timing.auto_summary`
    with ``auto_speedup_vs_lockstep`` (``per_run``: ``median_of_runs`` of every run's
    :func:`fastest_lockstep` speedups, holding ``auto``, ``lockstep_repeat`` and the
    candidates; ``choices``: each run's :func:`~jaxflow.timing.choose_mode` probe). When the
    best fixed mode is a lockstep form its interval is ``lockstep_repeat``'s runs (each run's
    baseline timed again), else its own; a probe's ``predicted_speedup_vs_lockstep`` is the
    faster lockstep form's probe median / the choice's."""
    return auto_summary(per_run, choices, candidates, vs="lockstep",
                        interval_of=lambda m: "lockstep_repeat" if m in LOCKSTEP else m,
                        probe=_lockstep_probe)


def _lockstep_probe(choice: Mapping) -> dict:
    med = choice["median_seconds"]
    fastest = min(med[m] for m in LOCKSTEP if m in med)
    return {"median_seconds": med, "probe_seconds": choice["probe_seconds"],
            "predicted_speedup_vs_lockstep": fastest / med[choice["mode"]]}


def median_utilisation(runs: Sequence[RunResult]) -> dict[str, float]:
    """Per role, the median over ``runs`` of busy seconds / wall seconds."""
    return {k: statistics.median(r.busy_s[k] / r.wall_s for r in runs) for k in runs[0].busy_s}


def bit_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees' leaves are equal element for element."""
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run_modes(system: FlexMARLSystem, state: FlexMARLState
              ) -> tuple[dict[str, Callable[[int], RunResult]], Callable[..., RunResult]]:
    """The timed modes ``{name: steps -> RunResult}`` (module doc; ``bounded_etaE`` per ``E``
    of the config's ``etas``), and ``pipeline(steps, **settings)``: any other pipeline run
    (``PipelineConfig`` settings). Every call starts from :meth:`FlexMARLSystem.restart`."""
    parts = state.parts
    cfg, wf, runtimes = parts.config, parts.workflow, parts.runtimes
    kw = dict(n_inputs=cfg.n_inputs, seed=cfg.seed, rollout_batch=cfg.rollout_batch)
    pipe = dict(kw, micro_inputs=cfg.micro_inputs, rollout_workers=cfg.rollout_workers)

    def policies():
        return dict(system.restart(state).policies)

    def pipeline(steps, **settings):
        return run_pipeline(PipelineConfig(wf, runtimes, steps=steps, **pipe, **settings),
                            policies())
    modes = {"sync": lambda steps: run_sync(wf, runtimes, policies(), steps=steps, **kw),
             # lockstep without the per-agent waits that time its stages: the faster barrier
             "sync_unblocked": lambda steps: run_sync(wf, runtimes, policies(), steps=steps,
                                                      block_stages=False, **kw),
             "strict": lambda steps: pipeline(steps, mode="strict"),
             # the same strict pipeline on blocking trainer threads (bit-identical results)
             "strict_threads": lambda steps: pipeline(steps, mode="strict", driver="threads")}
    for eta in cfg.etas:
        modes[f"bounded_eta{eta}"] = (lambda steps, eta=eta: pipeline(steps, mode="bounded",
                                                                      eta=eta))
    return modes, pipeline


@dataclasses.dataclass(frozen=True)
class ModeTimings:
    """What :func:`time_modes` measured: ``timings`` / ``autos`` (one
    :func:`~jaxflow.timing.paired_rounds` result and one auto probe per run), ``results`` (every
    kept run of each mode), ``bases`` (each run's :func:`fastest_lockstep`) and the auto
    ``candidates``."""

    timings: list[dict]
    autos: list[dict]
    results: dict[str, list[RunResult]]
    bases: list[dict]
    candidates: tuple[str, ...]


def time_modes(modes: Mapping[str, Callable[[int], RunResult]], config: Any,
               log: Callable[[str], Any]) -> ModeTimings:
    """Times ``modes`` (module doc) with :func:`~jaxflow.timing.repeated_runs`: ``config``'s
    ``runs``, ``steps``, ``reps``, ``seed``, ``auto``, ``probe_steps`` and ``probe_rounds``;
    ``log`` gets one line per run. Across processes every figure is process 0's
    (:func:`jaxflow.marl.processes.agree`)."""
    results: dict[str, list[RunResult]] = {m: [] for m in modes}
    repeats = {repeat_name(m): m for m in LOCKSTEP}

    def timed(m, steps, keep=True):
        keep, m = keep and m not in repeats, repeats.get(m, m)

        def call():
            r = modes[m](steps)
            if keep:
                results[m].append(r)
            # across processes process 0's seconds everywhere: the auto probe's choice and
            # every timing figure are decided once (jaxflow.marl.processes)
            return agree("flexmarl_wall_s", r.wall_s)
        return call

    candidates = (*LOCKSTEP, "strict")  # the staleness-free modes

    def warm():
        for fn in modes.values():
            fn(2)

    def log_run(rep, result, auto):
        base = fastest_lockstep(result["seconds"])
        log(f"timing run {rep} (baseline {base['mode']}): " + ", ".join(
            f"{m} {x:.2f}x" for m, x in base["speedup"].items())
            + (f" (auto -> {auto['mode']})" if auto else ""))

    timings, autos = repeated_runs(timed, [*modes, *repeats], runs=config.runs,
                                   steps=config.steps, rounds=config.reps, baseline="sync",
                                   seed=config.seed, warm=warm,
                                   candidates=list(candidates) if config.auto else (),
                                   probe_steps=config.probe_steps,
                                   probe_rounds=config.probe_rounds, log=log_run)
    return ModeTimings(timings, autos, results, [fastest_lockstep(t["seconds"]) for t in timings],
                       candidates)


def speedup_summary(mt: ModeTimings, names: Sequence[str], steps: int) -> dict:
    """The experiment's timing and equivalence figures from ``mt`` (agents ``names`` in turn
    order, ``steps`` versions per run): speedups against the fastest lockstep, samples/s,
    utilisation, ideal bounds, strict vs sync parameter differences, bit-exactness of the
    equivalent forms, reward curves and the bounded runs' figures (keys: the ``flexmarl``
    driver's docstring)."""
    timings, results, bases = mt.timings, mt.results, mt.bases
    per_run = median_of_runs([b["speedup"] for b in bases])
    won = [b["mode"] for b in bases]
    baseline = max(LOCKSTEP, key=lambda m: (won.count(m), -LOCKSTEP.index(m)))
    sync, strict = results["sync"][0], results["strict"][0]
    per_step = [max(relative_param_diff(strict.params[v][n], sync.params[v][n]) for n in names)
                for v in range(steps)]

    def ratio(m, key="ratios"):  # median over runs of each run's paired median; min / max
        pairs = [x for b in bases for x in b[key][m]]  # over all pairs
        runs = [statistics.median(b[key][m]) for b in bases]
        return {"median": statistics.median(runs), "min": min(pairs), "max": max(pairs),
                "runs": runs}

    def rate(m):
        return statistics.median(r.samples / r.wall_s for r in results[m])

    bounded = {m[len("bounded_"):]: {
        "speedup_vs_lockstep": ratio(m)["median"], "speedup_spread": ratio(m),
        "samples_per_s": rate(m), "utilisation": median_utilisation(results[m]),
        "staleness_max": max(r.staleness["max"] for r in results[m]),
        "staleness_mean": statistics.median(r.staleness["mean"] for r in results[m]),
        "max_param_diff_vs_sync": max(relative_param_diff(results[m][0].params[-1][n],
                                                          sync.params[-1][n]) for n in names),
        "reward_curve": results[m][0].rewards} for m in results if m.startswith("bounded")}

    def paired(num, den):  # median over runs of each run's median of num s / den s per round
        per = [statistics.median(a / b for a, b in zip(t["seconds"][num], t["seconds"][den]))
               for t in timings]
        return {"median": statistics.median(per), "runs": per}

    def same_as(mode, ref):
        return all(bit_equal(results[mode][0].params[v], ref.params[v]) for v in range(steps))

    return {
        "baseline": "fastest bit-identical lockstep: per run, whichever of sync and "
                    "sync_unblocked has the smaller median wall over the run's rounds",
        "baseline_mode": baseline,  # the form that won most runs
        "baseline_mode_runs": won,
        "baseline_median_seconds_runs": [b["median_seconds"] for b in bases],
        "speedup_vs_lockstep": ratio("strict")["median"],
        "speedup_spread": ratio("strict"),
        "speedup_runs": per_run["strict"]["runs"],
        "speedups": {m: ratio(m) for m in per_run},  # every mode, lockstep_repeat included
        "speedup_pairs": {m: [b["ratios"][m] for b in bases] for m in per_run},
        "strict_vs_lockstep_round_min": ratio("strict", "round_min_ratios"),
        "strict_vs_sync_blocked": paired("sync", "strict"),
        "strict_vs_sync_unblocked": paired("sync_unblocked", "strict"),
        "sync_unblocked_vs_sync": paired("sync", "sync_unblocked"),
        "strict_threads_speedup_vs_lockstep": ratio("strict_threads")["median"],
        "strict_threads_bit_exact": same_as("strict_threads", strict),
        "sync_unblocked_bit_exact": same_as("sync_unblocked", sync),
        "timing_order": [t["order"] for t in timings],
        "runs": len(timings),
        **(auto_vs_lockstep(per_run, mt.autos, mt.candidates) if mt.autos else {}),
        "samples_per_s": rate("strict"),
        "baseline_samples_per_s": rate(baseline),
        "utilisation": median_utilisation(results["strict"]),
        "baseline_utilisation": median_utilisation(results[baseline]),
        # the blocked lockstep's figures (device seconds per stage): the calibration's source
        "sync_samples_per_s": rate("sync"),
        "sync_utilisation": median_utilisation(results["sync"]),
        # what perfect overlap on separate hardware could give: the blocked sync run's stage
        # times, sum / slowest stage (CONVENTIONS "ideal bound"), and the fastest lockstep's
        # median wall / the slowest stage's median seconds
        "ideal_speedup_bound": statistics.median(sum(r.busy_s.values()) / max(r.busy_s.values())
                                                 for r in results["sync"]),
        "ideal_speedup_bound_vs_lockstep": (
            statistics.median(r.wall_s for r in results[baseline])
            / statistics.median(max(r.busy_s.values()) for r in results["sync"])),
        "strict_max_param_diff": max(per_step),
        "strict_param_diff_per_step": per_step,  # AdamW amplifies summation-order ulps
        "reward_curve": strict.rewards,
        "baseline_reward_curve": sync.rewards,
        "bounded": bounded,
        "mode": "strict (no staleness); bounded rows report their observed staleness",
        "engine_decode": strict.engine,  # row-steps executed vs a padded batch decode
        "rollout_workers": strict.workers,
    }
