"""Costs of the simulated agents from a measured run (see the package doc, "Costs").

The measurement (:class:`MeasuredRun`) is data with provenance: a calibration file written by a
``flexmarl`` run from its lockstep baseline::

    python -m jaxflow.run --exp=flexmarl --variant=quick \
        --set calibration_out=jaxflow/marl/simulate/data/flexmarl_quick.json

(``data/flexmarl_quick.json`` is the built-in one; :func:`load_measurement` also reads a
flexmarl run directory / summary.json). The file's ``provenance`` holds the git commit, the
command, the device count, the date and the machine's load; :func:`calibration_summary` is what
the simulator's summary reports under ``calibration`` and warns when the measured code changed
since that commit. The accelerator (:class:`Hardware`) is an assumption that fixes the absolute
time scale only.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Mapping, Sequence

from jaxflow import provenance
from jaxflow.config_domains import POSITIVE, Real, domains
from jaxflow.marl.simulate.workload import AgentCosts, AgentLoad

DATA = pathlib.Path(__file__).parent / "data"
#: The calibration the simulator reads unless told otherwise.
DEFAULT_CALIBRATION = DATA / "flexmarl_quick.json"
#: The code a calibration measures (git pathspecs, relative to the repository root).
MEASURED_PATHS = ("jaxflow/marl", ":(exclude)jaxflow/marl/simulate", "jaxflow/rl", "jaxflow/train",
                  "jaxflow/models", "jaxflow/data", "jaxflow/main/flexmarl.py",
                  "configs/flexmarl.py")
#: The per-parameter costs a measurement gives (:func:`per_param_costs`); the sensitivity
#: scales each of them.
COST_KEYS = ("train_token", "seq", "weight", "publish")


CalibrationWarning = provenance.CalibrationWarning


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """Measured costs of a ``flexmarl`` run's sync baseline, and that run's workload counts:
    throughput (samples/s, median over rounds), busy fractions per role (medians), steps x
    inputs x G, agents, decode steps per input (all agents; each engine call's prefill counts as
    one step, decode row-steps / G the rest: exact without compaction, an upper bound on
    occupancy otherwise), tokens per trained solver sample (the padded training row: prompt
    width + max new tokens) and the solver's parameter count."""

    samples_per_s: float
    busy_rollout: float
    busy_train_solver: float
    busy_train_verifier: float
    steps: int
    inputs: int
    group_size: int
    agents: int
    decode_steps_per_input: float
    solver_sample_tokens: int
    solver_params: float

    @classmethod
    def from_values(cls, values: Mapping, where: str = "values") -> "MeasuredRun":
        """A MeasuredRun from a mapping with every field; ValueError names the missing ones and ``where``."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"{where}: lacks {missing} (need {names})")
        return cls(**{n: values[n] for n in names})


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A :class:`MeasuredRun`, where it comes from (``provenance``: git_commit, command,
    devices, date, machine, measured_paths), its path, and what else the run measured."""

    measured: MeasuredRun
    provenance: dict
    path: str
    context: dict = dataclasses.field(default_factory=dict)


@domains(peak_flops=POSITIVE, mfu_train=Real(0.0, 1.0, low_open=True), host_gbytes_per_s=POSITIVE,
         swap_bytes_per_param=POSITIVE)
@dataclasses.dataclass(frozen=True)
class Hardware:
    """Assumptions (not measured here): the accelerator's bf16 peak and the training MFU fix the
    absolute time scale only; ``host_gbytes_per_s`` and ``swap_bytes_per_param`` (bf16 params +
    f32 master + Adam m, v = 14, rounded to 16) give the state-swap time."""

    peak_flops: float = 989e12  # H200 bf16 dense
    mfu_train: float = 0.4
    host_gbytes_per_s: float = 50.0
    swap_bytes_per_param: float = 16.0


def sync_counts(sync_runs: Sequence, runtimes: Mapping, order: Sequence[str]) -> dict:
    """Workload counts of a ``flexmarl`` run's lockstep baseline: ``sync_runs`` (its
    RunResults: engine row-steps and calls, samples) and ``runtimes`` (AgentRuntime per agent:
    group size, prompt width, max new tokens, parameter count)."""
    import jax
    import numpy as np

    first = sync_runs[0]
    solver = runtimes[order[0]]
    g = solver.spec.group_size
    calls, row_steps = float(first.engine["calls"]), float(first.engine["row_steps"])
    params = {n: float(sum(int(np.prod(x.shape)) for x in
                           jax.tree.leaves(runtimes[n].fns.abstract_params()))) for n in order}
    return {"agents": len(order), "group_size": g, "engine_calls": calls,
            "decode_row_steps": row_steps,
            "useful_decode_row_steps": float(first.engine["useful_row_steps"]),
            "padded_decode_row_steps": float(first.engine.get("padded_row_steps", 0)),
            "decode_steps": calls + row_steps / g,
            "solver_sample_tokens": int(solver.sampler.prompt_width + solver.spec.max_new_tokens),
            "max_new_tokens": {n: int(runtimes[n].spec.max_new_tokens) for n in order},
            "params": params, "solver_params": params[order[0]],
            "samples_per_round": int(first.samples)}


def measured_from_summary(summary: Mapping) -> MeasuredRun:
    """A :class:`MeasuredRun` from a ``flexmarl`` summary: its blocked lockstep (``sync``, each
    agent's step waited for, so busy seconds are device seconds): medians of samples/s and busy
    fractions (``sync_samples_per_s`` / ``sync_utilisation``; summaries written before the
    speedup baseline became the fastest lockstep hold them as ``baseline_*``), and
    ``calibration_counts`` from :func:`sync_counts`."""
    prefix = "sync" if "sync_utilisation" in summary else "baseline"
    if "calibration_counts" not in summary or f"{prefix}_utilisation" not in summary:
        raise ValueError("the summary has no calibration_counts / sync_utilisation (is it a "
                         "flexmarl run of the current code?)")
    cfg, c = summary["config"], summary["calibration_counts"]
    util = summary[f"{prefix}_utilisation"]
    order = list(c["params"])
    steps, inputs = int(cfg["steps"]), int(cfg["n_inputs"])
    return MeasuredRun(samples_per_s=float(summary[f"{prefix}_samples_per_s"]),
                       busy_rollout=float(util["rollout"]),
                       busy_train_solver=float(util[f"train/{order[0]}"]),
                       busy_train_verifier=float(sum(util[f"train/{n}"] for n in order[1:])),
                       steps=steps, inputs=inputs, group_size=int(c["group_size"]),
                       agents=int(c["agents"]),
                       decode_steps_per_input=float(c["decode_steps"]) / (steps * inputs),
                       solver_sample_tokens=int(c["solver_sample_tokens"]),
                       solver_params=float(c["solver_params"]))


def write_calibration(path: str | pathlib.Path, summary: Mapping, prov: Mapping) -> str:
    """Writes the calibration file of a ``flexmarl`` summary with provenance ``prov``
    (:func:`jaxflow.provenance.run_provenance`); returns the path written."""
    m = measured_from_summary(summary)
    context = {"counts": dict(summary["calibration_counts"]),
               "strict_samples_per_s": summary.get("samples_per_s"),
               # strict vs the run's fastest lockstep form (``lockstep_baseline``); the
               # simulator reads neither: only the blocked lockstep's values above
               "strict_speedup_vs_lockstep": summary.get("speedup_vs_lockstep",
                                                         summary.get("speedup_vs_sync")),
               "lockstep_baseline": summary.get("baseline_mode", "sync"),
               "strict_speedup_vs_sync_blocked": (summary.get("strict_vs_sync_blocked")
                                                  or {}).get("median"),
               "ideal_speedup_bound": summary.get("ideal_speedup_bound"),
               "reps": summary.get("reps")}
    return provenance.write_record(
        path, what="blocked lockstep (sync: each agent's step waited for) of a flexmarl run: "
                   "samples/s and busy fractions per role (medians over rounds) and that run's "
                   "workload counts",
        provenance=prov, values=dataclasses.asdict(m), context=context)


#: The ``flexmarl`` driver's ``calibration_out``, ``(path, summary, *, experiment, variant,
#: devices) -> path written``: :func:`jaxflow.provenance.write_calibration_from_run` with
#: :func:`write_calibration` and :data:`MEASURED_PATHS` (the provenance of this process now).
write_calibration_from_run = functools.partial(provenance.write_calibration_from_run,
                                               write_calibration, measured_paths=MEASURED_PATHS)


def load_measurement(calibration: str | pathlib.Path = "") -> Calibration:
    """"" = :data:`DEFAULT_CALIBRATION`; a file written by :func:`write_calibration`; or a
    flexmarl run directory / summary.json (its provenance: the summary's git_commit, argv,
    device_count)."""
    path, record = provenance.read_record(calibration, DEFAULT_CALIBRATION, "flexmarl")
    if provenance.is_record(record):
        return Calibration(MeasuredRun.from_values(record["values"], str(path)),
                           dict(record["provenance"]), provenance.display_path(path),
                           dict(record.get("context", {})))
    try:
        m = measured_from_summary(record)
    except (KeyError, ValueError) as e:
        raise ValueError(f"calibration={str(path)!r}: {e}") from None
    return Calibration(m, provenance.summary_provenance(record, MEASURED_PATHS),
                       provenance.display_path(path))


def calibration_summary(cal: Calibration, root: pathlib.Path = provenance.REPO_ROOT) -> dict:
    """What the simulator's summary reports under ``calibration``
    (:func:`jaxflow.provenance.calibration_report` and the measured values); warns
    (CalibrationWarning) when the measured code changed since the recorded commit or that
    cannot be checked."""
    return (provenance.calibration_report(cal.provenance, cal.path, MEASURED_PATHS, root)
            | {"measured": dataclasses.asdict(cal.measured)})


def per_param_costs(m: MeasuredRun) -> dict[str, float]:
    """Measured dev-CPU seconds per parameter (FLOPs and bytes both scale with the parameter
    count): ``train_token`` (one trained token), ``seq`` (one sequence in one decode step =
    train_token / 4: a forward is 2P FLOPs, the timed training step 8P: forward + backward +
    old-log-prob forward), ``weight`` (the rest of a decode step, measured at occupancy G),
    ``publish`` (the lockstep wall time outside rollout and training, per agent and step)."""
    wall = m.steps * m.inputs * m.group_size * m.agents / m.samples_per_s
    train_token = (m.busy_train_solver * wall
                   / (m.steps * m.inputs * m.group_size * m.solver_sample_tokens))
    seq = train_token / 4
    step = m.busy_rollout * wall / (m.steps * m.inputs * m.decode_steps_per_input)
    weight = step - m.group_size * seq
    rest = 1.0 - m.busy_rollout - m.busy_train_solver - m.busy_train_verifier
    if weight <= 0 or rest < 0:
        raise ValueError(f"measured costs inconsistent: decode step {step:.3g} s, "
                         f"idle fraction {rest:.3g}")
    publish = rest * wall / (m.steps * m.agents)
    return {k: val / m.solver_params for k, val in
            (("train_token", train_token), ("seq", seq), ("weight", weight),
             ("publish", publish))}


def calibrate(agents: Sequence[AgentLoad], measured: MeasuredRun, hw: Hardware,
              scale: Mapping[str, float] | None = None) -> tuple[dict[str, AgentCosts], dict]:
    """Per-agent costs at the agents' sizes: measured per-parameter costs x params / speed,
    where ``speed`` = dev CPU's train seconds per parameter-token / the accelerator's
    (8 / (peak * mfu)). Only the absolute time scale rests on ``speed``; every ratio (decode vs
    train vs publish, and the decode occupancy knee weight / seq) is the measured one.
    ``scale``: multiplies named per-parameter costs (:data:`COST_KEYS`) before that (the
    sensitivity; ``train_token`` x f is the same as every other cost x 1/f)."""
    pp = per_param_costs(measured)
    bad = sorted(set(scale or {}) - set(COST_KEYS))
    if bad:
        raise ValueError(f"scale keys {bad}; valid: {', '.join(COST_KEYS)}")
    pp = {k: v * float((scale or {}).get(k, 1.0)) for k, v in pp.items()}
    speed = pp["train_token"] / (8.0 / (hw.peak_flops * hw.mfu_train))
    costs = {a.name: AgentCosts(
        weight_s=pp["weight"] * a.params / speed, seq_s=pp["seq"] * a.params / speed,
        train_token_s=pp["train_token"] * a.params / speed,
        publish_s=pp["publish"] * a.params / speed,
        swap_s=hw.swap_bytes_per_param * a.params / (hw.host_gbytes_per_s * 1e9))
        for a in agents}
    info = {"per_param_dev_cpu_s": pp, "accelerator_vs_dev_cpu": speed,
            "decode_knee_occupancy": pp["weight"] / pp["seq"]}
    return costs, info
