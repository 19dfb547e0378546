"""The ``flexmarl`` experiment: the fastest bit-identical lockstep vs the FlexMARL pipeline.

All runs: the built-in solver / verifier workflow, the same rollout engine (per-row keys,
finished rows compacted away), batch sizes, GRPO kernels and initial params. Lockstep is the
MARTI-style barrier (roll out every agent on every input, then one full-batch step per agent)
in two bit-identical forms: ``sync`` waits for each agent's step (its stage times calibrate the
simulator), ``sync_unblocked`` only dispatches them (one wait per version). ``strict`` is the
micro-batch pipeline (same samples, same update up to summation order) on the inline driver
(the trainers dispatch their programs between the rollout's engine calls, one host thread),
``strict_threads`` the same on blocking trainer threads (bit-identical); ``bounded(eta)`` lets
rollouts run up to eta versions ahead (threads).

Timing (CONVENTIONS, ``jaxflow.timing``): per run an untimed warm-up run of each mode, then
``reps`` rounds each running every mode once (and both lockstep forms a second time,
``sync_repeat`` / ``sync_unblocked_repeat``) in a seeded random order; ``runs`` such runs.
**Baseline of every speedup** (:func:`fastest_lockstep`): per run, whichever of ``sync`` and
``sync_unblocked`` has the smaller median seconds over that run's rounds (``baseline_mode_runs``;
``baseline_mode`` the majority); a mode's figure is the median over runs of each run's median
paired ratio baseline wall / mode wall of the same round (``speedup_runs``, ``speedup_pairs``),
min / max over all pairs; ``lockstep_repeat``: the winning form timed again (the noise floor).
``strict_vs_lockstep_round_min``: strict against the faster of the two forms in each round (an
oracle no user can run; conservative); ``strict_vs_sync_blocked``: against ``sync`` alone (the
headline before this baseline). ``auto``: a probe of ``probe_rounds`` rounds of
``probe_steps`` steps of ``sync``, ``sync_unblocked`` and ``strict`` (the staleness-free modes)
picks the fastest, and auto's figures are that mode's in the same rounds (the probe ran before
them). Also: samples/s medians, busy fraction per role (busy seconds / wall; roles: the
rollout engine and one trainer per agent; ``sync_utilisation`` is the blocked lockstep's,
device seconds, which the calibration reads), per-step reward means of the first round,
``strict_max_param_diff`` (max over steps and agents of the per-leaf relative difference
strict vs sync), the observed staleness of bounded runs, decode row-steps saved by compaction
vs a padded batch decode, and a strict run with agent state swapping (bit-exact).

Across processes (``--coordinator`` ...; :mod:`jaxflow.marl.processes`) every mesh spans every
process alike, every run is inline on one thread (``strict_threads`` too; bounded rollouts use
exactly version v - eta, see :attr:`~jaxflow.marl.pipeline.plan.PipelineConfig.inline`), the
swaps stay in host memory, and every timing figure and the auto probe's choice are process 0's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Mapping, Sequence

import jax
import numpy as np

from jaxflow.compile_only.program import Program
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import to_jsonable
from jaxflow.marl.engine import RolloutEngine, row_keys
from jaxflow.marl.meshes import agent_centric_meshes
from jaxflow.marl.pipeline import AgentRuntime, PipelineConfig, RunResult, relative_param_diff, run_pipeline, run_sync
from jaxflow.marl.processes import agree, host_tree, multi_process
from jaxflow.marl.programs import agent_programs, engine_programs, padded_decode_program
from jaxflow.marl.simulate import sync_counts, write_calibration_from_run
from jaxflow.marl.swap import AgentStateSwapper
from jaxflow.marl.workflow import solver_verifier_workflow
from jaxflow.rl.tasks import encode_prompts
from jaxflow.timing import auto_summary, median_of_runs, repeat_name, repeated_runs
from jaxflow.train.lm_state import init_params

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


def _utilisation(r: RunResult) -> dict[str, float]:
    return {role: s / r.wall_s for role, s in r.busy_s.items()}


def _median_util(runs: list[RunResult]) -> dict[str, float]:
    return {k: statistics.median(_utilisation(r)[k] for r in runs) for k in runs[0].busy_s}


def _bit_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def bench_engine(config, wf, mesh) -> RolloutEngine:
    """The engine benchmark's solver engine on the rollout ``mesh``."""
    return RolloutEngine(config.solver, mesh, max_new_tokens=config.bench_tokens,
                         temperature=1.0, task=wf.task("solver"), tokenizer=CharTokenizer(),
                         chunk=config.bench_chunk)


def engine_benchmark(config, wf, meshes, params, run) -> dict:
    """Compacted vs padded batch decode of the solver on the same rows and keys (alternating,
    medians): row-steps saved, time ratio, and whether the outputs are bit-identical."""
    rt_task = wf.task("solver")
    tok = CharTokenizer()
    eng = bench_engine(config, wf, meshes["rollout"])
    texts = rt_task.prompts(np.random.default_rng([config.seed, 0xE6]), config.bench_rows)
    prompts, lengths = encode_prompts(tok, texts, eng.prompt_width)
    keys = row_keys(jax.random.key(config.seed), len(texts))
    padded_kw = dict(compact=False, chunk=config.bench_tokens)
    a, sa = eng.sample(params, prompts, lengths, keys)
    b, sb = eng.sample(params, prompts, lengths, keys, **padded_kw)
    ratios, tc, tp = [], [], []
    for _ in range(config.reps):
        t0 = time.perf_counter()
        eng.sample(params, prompts, lengths, keys, **padded_kw)
        t1 = time.perf_counter()
        eng.sample(params, prompts, lengths, keys)
        t2 = time.perf_counter()
        tp.append(t1 - t0)
        tc.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    out = {"rows": len(texts), "max_new_tokens": config.bench_tokens,
           "chunk": config.bench_chunk, "row_steps": sa.row_steps,
           "padded_row_steps": sb.row_steps, "useful_row_steps": sa.useful_row_steps,
           "saved_fraction": sa.saved_fraction,
           "mean_length": float(a.mask.sum(1).mean()),
           "speedup_vs_padded": statistics.median(ratios),
           "speedup_spread": [min(ratios), max(ratios)],
           "compacted_s": statistics.median(tc), "padded_s": statistics.median(tp),
           "bit_identical": _bit_equal(a, b),
           "tokens_identical": bool(np.array_equal(a.tokens, b.tokens)),
           "mask_identical": bool(np.array_equal(a.mask, b.mask)),
           # XLA CPU picks matmul kernels by batch size: a compacted batch's log-probs may
           # differ from the padded batch's in the last bits
           "logprob_max_abs_diff": float(np.max(np.abs(a.logprobs - b.logprobs))),
           "logprob_max_rel_diff": float(np.max(np.abs(a.logprobs - b.logprobs)
                                                / np.maximum(np.abs(b.logprobs), 1e-30)))}
    run.info(f"engine: {out['saved_fraction']:.2f} of padded decode row-steps saved, "
             f"{out['speedup_vs_padded']:.2f}x vs padded, tokens identical "
             f"{out['tokens_identical']}, log-prob max rel diff "
             f"{out['logprob_max_rel_diff']:.1e}")
    return out


def _workflow(config):
    return solver_verifier_workflow(config.solver, config.verifier, group_size=config.group_size,
                                    max_digits=config.max_digits,
                                    solver_tokens=config.solver_tokens,
                                    verifier_tokens=config.verifier_tokens)


def _agent_meshes(config, wf, devices=None) -> dict[str, dict]:
    devices = list(jax.devices() if devices is None else devices)
    return agent_centric_meshes(wf, len(devices), devices=devices,
                                trainer_model=config.trainer_model,
                                rollout_model=config.rollout_model)


def resolve_meshes(config, devices=None) -> dict:
    """``{"AGENT/ROLE": mesh}`` (roles ``trainer`` / ``rollout``) on ``devices`` (default
    ``jax.devices()``, so the accelerators present), split agent-centrically by
    :func:`~jaxflow.marl.meshes.agent_centric_meshes` with the config's model-axis caps."""
    meshes = _agent_meshes(config, _workflow(config), devices)
    return {f"{a}/{role}": m for a, by_role in meshes.items() for role, m in by_role.items()}


def build_runtimes(config, wf, meshes: Mapping[str, dict]) -> dict[str, AgentRuntime]:
    """Each agent's :class:`AgentRuntime` (compiled GRPO functions, optimizer, engine) on its
    ``{"trainer": mesh, "rollout": mesh}``: what the run trains with."""
    return {a.name: AgentRuntime(a, wf, meshes[a.name], config.optim,
                                 n_inputs=config.n_inputs, total_steps=config.steps + 1,
                                 entropy_coef=config.entropy_coef,
                                 engine_chunk=config.engine_chunk) for a in wf.agents}


def main(config, run) -> dict:
    wf = _workflow(config)
    n_dev = len(jax.devices())
    meshes = _agent_meshes(config, wf)
    runtimes = build_runtimes(config, wf, meshes)
    meshes = meshes[wf.order()[0]]
    init = {n: host_tree(init_params(rt.fns, rt.spec.model, jax.random.key(i)))
            for i, (n, rt) in enumerate(runtimes.items())}

    def policies():
        return {n: rt.init_policy(init[n]) for n, rt in runtimes.items()}

    kw = dict(n_inputs=config.n_inputs, seed=config.seed, rollout_batch=config.rollout_batch)
    pipe = dict(kw, micro_inputs=config.micro_inputs, rollout_workers=config.rollout_workers)

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
    for eta in config.etas:
        modes[f"bounded_eta{eta}"] = (lambda steps, eta=eta: pipeline(steps, mode="bounded",
                                                                      eta=eta))
    run.info(f"warm-up (compilation) on {n_dev} device(s) ...")
    warm = policies()
    for n, rt in runtimes.items():  # every compacted decode shape, so no timed run compiles
        rt.engine.precompile(rt.publish(warm[n]), config.rollout_batch * rt.spec.group_size)
    # timing (jaxflow.timing): each round runs every mode (and both lockstep forms again)
    # once, in a seeded random order; ``runs`` repetitions, each with its own warm-up and auto
    # probe; every ratio is against the run's faster lockstep form (fastest_lockstep)
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

    candidates = [*LOCKSTEP, "strict"]  # the staleness-free modes

    def warm():
        for fn in modes.values():
            fn(2)

    def log(rep, result, auto):
        base = fastest_lockstep(result["seconds"])
        run.info(f"timing run {rep} (baseline {base['mode']}): " + ", ".join(
            f"{m} {x:.2f}x" for m, x in base["speedup"].items())
            + (f" (auto -> {auto['mode']})" if auto else ""))

    timings, autos = repeated_runs(timed, [*modes, *repeats], runs=config.runs,
                                   steps=config.steps, rounds=config.reps, baseline="sync",
                                   seed=config.seed, warm=warm,
                                   candidates=candidates if config.auto else (),
                                   probe_steps=config.probe_steps,
                                   probe_rounds=config.probe_rounds, log=log)
    bases = [fastest_lockstep(t["seconds"]) for t in timings]
    per_run = median_of_runs([b["speedup"] for b in bases])
    won = [b["mode"] for b in bases]
    baseline = max(LOCKSTEP, key=lambda m: (won.count(m), -LOCKSTEP.index(m)))
    sync, strict = results["sync"][0], results["strict"][0]
    for v in range(config.steps):
        run.log(v, {f"reward/{m}/{n}": r[0].rewards[v][n] for m, r in results.items()
                    for n in wf.order()})
    per_step = [max(relative_param_diff(strict.params[v][n], sync.params[v][n])
                    for n in wf.order()) for v in range(config.steps)]

    def ratio(m, key="ratios"):  # median over runs of each run's paired median; min / max
        pairs = [x for b in bases for x in b[key][m]]  # over all pairs
        runs = [statistics.median(b[key][m]) for b in bases]
        return {"median": statistics.median(runs), "min": min(pairs), "max": max(pairs),
                "runs": runs}

    def rate(m):
        return statistics.median(r.samples / r.wall_s for r in results[m])

    # durable swaps (orbax) write one directory per process; across processes host memory only
    swapper = AgentStateSwapper(None if multi_process() else tempfile.mkdtemp(prefix="flexmarl_swap_"))
    swapped = pipeline(config.steps, mode="strict", swapper=swapper)
    swapper.close()
    bounded = {m[len("bounded_"):]: {
        "speedup_vs_lockstep": ratio(m)["median"], "speedup_spread": ratio(m),
        "samples_per_s": rate(m), "utilisation": _median_util(results[m]),
        "staleness_max": max(r.staleness["max"] for r in results[m]),
        "staleness_mean": statistics.median(r.staleness["mean"] for r in results[m]),
        "max_param_diff_vs_sync": max(relative_param_diff(results[m][0].params[-1][n],
                                                          sync.params[-1][n])
                                      for n in wf.order()),
        "reward_curve": results[m][0].rewards} for m in modes if m.startswith("bounded")}

    def paired(num, den):  # median over runs of each run's median of num s / den s per round
        per = [statistics.median(a / b for a, b in zip(t["seconds"][num], t["seconds"][den]))
               for t in timings]
        return {"median": statistics.median(per), "runs": per}

    summary = {
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
        "strict_threads_bit_exact": all(_bit_equal(results["strict_threads"][0].params[v],
                                                   strict.params[v])
                                        for v in range(config.steps)),
        "sync_unblocked_bit_exact": all(_bit_equal(results["sync_unblocked"][0].params[v],
                                                   sync.params[v])
                                        for v in range(config.steps)),
        "timing_order": [t["order"] for t in timings],
        "runs": config.runs,
        **(auto_vs_lockstep(per_run, autos, candidates) if autos else {}),
        "samples_per_s": rate("strict"),
        "baseline_samples_per_s": rate(baseline),
        "utilisation": _median_util(results["strict"]),
        "baseline_utilisation": _median_util(results[baseline]),
        # the blocked lockstep's figures (device seconds per stage): the calibration's source
        "sync_samples_per_s": rate("sync"),
        "sync_utilisation": _median_util(results["sync"]),
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
        "swap": swapped.swap | {"bit_exact_vs_strict": all(
            _bit_equal(swapped.params[v], strict.params[v]) for v in range(config.steps))},
        "engine_benchmark": engine_benchmark(
            config, wf, meshes, runtimes["solver"].publish(policies()["solver"]), run),
        "devices": n_dev,
        "trainer_devices": {n: rt.mesh.devices.size for n, rt in runtimes.items()},
        "reps": config.reps,
    }
    run.info(f"strict {summary['speedup_vs_lockstep']:.2f}x vs lockstep ({baseline}) "
             f"[{summary['speedup_spread']['min']:.2f}, {summary['speedup_spread']['max']:.2f}], "
             f"strict max param diff {max(per_step):.2e}; bounded: "
             + ", ".join(f"{k} {b['speedup_vs_lockstep']:.2f}x lag<={b['staleness_max']:.0f}"
                         for k, b in bounded.items()))
    summary["calibration_counts"] = sync_counts(results["sync"], runtimes, wf.order())
    if config.calibration_out and run.is_primary:
        summary["calibration_written"] = write_calibration_from_run(
            config.calibration_out, summary | {"config": to_jsonable(config)},
            experiment=run.name, variant=run.variant, devices=n_dev)
        run.info(f"wrote calibration {summary['calibration_written']}")
    return summary


# -- compile-only ------------------------------------------------------------------------


def compile_programs(config, meshes: Mapping) -> list[Program]:
    """``--compile-only``: a run's jitted programs on ``meshes`` (:func:`resolve_meshes`' on the
    target's devices), built by :func:`build_runtimes` / :func:`bench_engine`: per agent its
    trainer programs (:func:`jaxflow.marl.programs.agent_programs`) and its engine's prefill and
    decode chunk on one rollout call's rows; the engine benchmark's padded decode (and its prefill
    and chunk when its shapes differ from the solver's rollout)."""
    wf = _workflow(config)
    by_agent = {a: {"trainer": meshes[f"{a}/trainer"], "rollout": meshes[f"{a}/rollout"]}
                for a in wf.order()}
    runtimes = build_runtimes(config, wf, by_agent)
    programs, decode_args = [], {}
    for name, rt in runtimes.items():
        programs += agent_programs(rt, n_inputs=config.n_inputs, micro_inputs=config.micro_inputs)
        engine, decode_args[name] = engine_programs(f"{name}/rollout", rt.engine, rt.spec.model,
                                                    config.rollout_batch * rt.spec.group_size)
        programs += engine
    bench, solver = bench_engine(config, wf, by_agent["solver"]["rollout"]), runtimes["solver"]
    args = decode_args["solver"]
    if not (bench.config == solver.engine.config and bench.chunk == solver.engine.chunk
            and config.bench_rows == config.rollout_batch * solver.spec.group_size):
        engine, args = engine_programs("solver/bench", bench, config.solver, config.bench_rows)
        programs += engine
    return programs + [padded_decode_program("solver/bench", bench, config.solver,
                                             config.bench_rows, args)]
