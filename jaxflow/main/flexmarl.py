"""The ``flexmarl`` experiment: the fastest bit-identical lockstep vs the FlexMARL pipeline.

All runs: the built-in solver / verifier workflow, the same sampling (the paged rollout engine
through :class:`jaxflow.marl.sampling.AgentSampler`: per-row keys, finished rows leave the decode
batch), batch sizes, GRPO kernels and initial params. Lockstep is the
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
**Baseline of every speedup** (:func:`jaxflow.marl.speedup.fastest_lockstep`): per run, whichever of ``sync`` and
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
strict vs sync), the observed staleness of bounded runs, decode row-steps saved by bucketing
the running rows vs a padded batch decode (the engine benchmark), and a strict run with agent
state swapping (bit-exact).

The system is :class:`jaxflow.marl.system.FlexMARLSystem`, the modes and their timing
:mod:`jaxflow.marl.speedup`, the engine benchmark :mod:`jaxflow.marl.engine_bench`.

Across processes (``--coordinator`` ...; :mod:`jaxflow.marl.processes`) every mesh spans every
process alike, every run is inline on one thread (``strict_threads`` too; bounded rollouts use
exactly version v - eta, see :attr:`~jaxflow.marl.pipeline.plan.PipelineConfig.inline`), the
swaps stay in host memory, and every timing figure and the auto probe's choice are process 0's.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Mapping

import jax

from jaxflow.compile_only.program import Program
from jaxflow.experiment import to_jsonable
from jaxflow.marl.engine_bench import engine_benchmark
from jaxflow.marl.processes import multi_process
from jaxflow.marl.simulate import sync_counts, write_calibration_from_run
from jaxflow.marl.speedup import bit_equal, run_modes, speedup_summary, time_modes
from jaxflow.marl.swap import AgentStateSwapper
from jaxflow.marl.system import FlexMARLSystem, agent_keys, resolve_meshes, workflow_of

SYSTEM = FlexMARLSystem()


def main(config, run) -> dict:
    n_dev = len(jax.devices())
    state = SYSTEM.init(config, resolve_meshes(config), agent_keys(len(workflow_of(config).agents)))
    parts = state.parts
    wf, runtimes, names = parts.workflow, parts.runtimes, parts.workflow.order()
    run.info(f"warm-up (compilation) on {n_dev} device(s) ...")
    for n, rt in runtimes.items():  # the engine's full-batch shapes; the warm-up runs compile the rest
        rt.sampler.warm_up(rt.publish(state.policies[n]), config.rollout_batch * rt.spec.group_size)
    # every run starts from SYSTEM.restart (fresh buffers): keep only the initial params
    state = dataclasses.replace(state, policies={})
    modes, pipeline = run_modes(SYSTEM, state)
    timings = time_modes(modes, config, run.info)
    results = timings.results
    for v in range(config.steps):
        run.log(v, {f"reward/{m}/{n}": r[0].rewards[v][n] for m, r in results.items() for n in names})
    summary = speedup_summary(timings, names, config.steps)
    # durable swaps (orbax) write one directory per process; across processes host memory only
    swapper = AgentStateSwapper(None if multi_process() else tempfile.mkdtemp(prefix="flexmarl_swap_"))
    swapped = pipeline(config.steps, mode="strict", swapper=swapper)
    swapper.close()
    strict = results["strict"][0]
    summary |= {
        "swap": swapped.swap | {"bit_exact_vs_strict": all(
            bit_equal(swapped.params[v], strict.params[v]) for v in range(config.steps))},
        "engine_benchmark": engine_benchmark(
            config, wf, parts.meshes[names[0]], runtimes["solver"].publish(SYSTEM.restart(state).policies["solver"]),
            run.info),
        "devices": n_dev,
        "trainer_devices": {n: rt.mesh.devices.size for n, rt in runtimes.items()},
        "reps": config.reps,
    }
    bounded = summary["bounded"]
    run.info(f"strict {summary['speedup_vs_lockstep']:.2f}x vs lockstep ({summary['baseline_mode']}) "
             f"[{summary['speedup_spread']['min']:.2f}, {summary['speedup_spread']['max']:.2f}], "
             f"strict max param diff {summary['strict_max_param_diff']:.2e}; bounded: "
             + ", ".join(f"{k} {b['speedup_vs_lockstep']:.2f}x lag<={b['staleness_max']:.0f}"
                         for k, b in bounded.items()))
    summary["calibration_counts"] = sync_counts(results["sync"], runtimes, names)
    if config.calibration_out and run.is_primary:
        summary["calibration_written"] = write_calibration_from_run(
            config.calibration_out, summary | {"config": to_jsonable(config)},
            experiment=run.name, variant=run.variant, devices=n_dev)
        run.info(f"wrote calibration {summary['calibration_written']}")
    return summary


def compile_programs(config, meshes: Mapping) -> list[Program]:
    """``--compile-only``: :meth:`FlexMARLSystem.programs` on ``meshes`` (:func:`resolve_meshes`')."""
    return SYSTEM.programs(config, meshes)

