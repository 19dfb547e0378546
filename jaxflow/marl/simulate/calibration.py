"""Costs of the simulated agents from a measured run (see the package doc, "Costs").

The measurement (:class:`MeasuredRun`) is data: the built-in one is read from
``data/flexmarl_quick_sync.json``, which records the run, command and commit it came from; a
``flexmarl`` summary.json gives another (:func:`measured_from_summary`). The accelerator
(:class:`Hardware`) is an assumption that fixes the absolute time scale only.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

from jaxflow.marl.simulate.workload import AgentCosts, AgentLoad


DATA = pathlib.Path(__file__).parent / "data"
#: The built-in measurement (values and where they come from): a data file, not code.
BUILTIN_MEASUREMENT = DATA / "flexmarl_quick_sync.json"


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """Measured costs of a ``flexmarl`` run's sync baseline, and that run's workload constants:
    throughput, busy fractions per role, steps x inputs x G, agents, decode steps per input (sum
    of the agents' response lengths), tokens per trained solver sample and the solver's
    parameter count. :meth:`builtin` is the run recorded in experiments/README.md; its values
    and provenance are in ``data/flexmarl_quick_sync.json``."""

    samples_per_s: float
    busy_rollout: float
    busy_train_solver: float
    busy_train_verifier: float
    steps: int
    inputs: int
    group_size: int
    agents: int
    decode_steps_per_input: int
    solver_sample_tokens: int
    solver_params: float

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> "MeasuredRun":
        """A measurement file: ``{"provenance": {...}, "values": {field: value}}``."""
        path = pathlib.Path(path)
        values = json.loads(path.read_text())["values"]
        names = {f.name for f in dataclasses.fields(cls)}
        if set(values) != names:
            raise ValueError(f"{path}: values {sorted(values)} must be exactly {sorted(names)}")
        return cls(**values)

    @classmethod
    def builtin(cls) -> "MeasuredRun":
        """The recorded ``flexmarl`` quick run (see ``BUILTIN_MEASUREMENT``)."""
        return cls.from_file(BUILTIN_MEASUREMENT)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Assumptions (not measured here): the accelerator's bf16 peak and the training MFU fix the
    absolute time scale only; ``host_gbytes_per_s`` and ``swap_bytes_per_param`` (bf16 params +
    f32 master + Adam m, v = 14, rounded to 16) give the state-swap time."""

    peak_flops: float = 989e12  # H200 bf16 dense
    mfu_train: float = 0.4
    host_gbytes_per_s: float = 50.0
    swap_bytes_per_param: float = 16.0


def measured_from_summary(summary: dict) -> MeasuredRun:
    """A :class:`MeasuredRun` from a ``flexmarl`` summary.json (its sync baseline numbers)."""
    cfg, util = summary["config"], summary["baseline_utilisation"]
    s = cfg["solver"]
    d, f, v, layers = s["d_model"], s["d_ff"], s["vocab_size"], s["n_layers"]
    hd = d // s["n_heads"]
    attn = d * hd * (2 * s["n_heads"] + 2 * s["n_kv_heads"])
    params = v * d * (1 if s.get("tie_embeddings") else 2) + layers * (attn + 3 * d * f + 2 * d) + d
    # Agents, decode steps per input and the 4 response tokens are the built-in run's.
    return dataclasses.replace(
        MeasuredRun.builtin(), samples_per_s=summary["baseline_samples_per_s"],
        busy_rollout=util["rollout"], busy_train_solver=util["train/solver"],
        busy_train_verifier=util["train/verifier"], steps=cfg["steps"], inputs=cfg["n_inputs"],
        group_size=cfg["group_size"], solver_sample_tokens=2 * cfg["max_digits"] + 3 + 4,
        solver_params=params)


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


def calibrate(agents: Sequence[AgentLoad], measured: MeasuredRun, hw: Hardware
              ) -> tuple[dict[str, AgentCosts], dict]:
    """Per-agent costs at the agents' sizes: measured per-parameter costs x params / speed,
    where ``speed`` = dev CPU's train seconds per parameter-token / the accelerator's
    (8 / (peak * mfu)). Only the absolute time scale rests on ``speed``; every ratio (decode vs
    train vs publish, and the decode occupancy knee weight / seq) is the measured one."""
    pp = per_param_costs(measured)
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
