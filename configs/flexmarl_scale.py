"""flexmarl_scale: discrete-event simulation of FlexMARL vs a MARTI-style synchronous baseline at
8-64 nodes (8 accelerators each), skewed response lengths, costs calibrated from the measured
``flexmarl`` quick run. Pure Python/numpy, no JAX work.

    python -m jaxflow.run --exp=flexmarl_scale --variant=quick      # seconds
    python -m jaxflow.run --exp=flexmarl_scale --variant=default
    python -m jaxflow.run --exp=flexmarl_scale --variant=quick --set calibration=runs/flexmarl/<run>

Regenerate the built-in calibration (then rerun this):

    python -m jaxflow.run --exp=flexmarl --variant=quick \
        --set calibration_out=jaxflow/marl/simulate/data/flexmarl_quick.json

Summary keys besides the per-node maps: ``calibration`` (git_commit, command, devices, path,
stale, warning), ``paper_checks`` (the paper's 7.3x / 5.6x, which do not enter the fit: the
prediction, the relative error and the tolerance ``paper_checks_rel_tol``),
``sensitivity.calibration`` (each measured per-parameter cost x0.5 / x2 -> strict speedup and
utilisation ratio at the largest node count), and ONE headline (``headlines``: the simulated
"up to" speedup vs sync, stale when the calibration is).

Assumptions (not measured): the agents' sizes and length distributions below, slots per
accelerator, weak scaling (inputs per version grow with the node count), the accelerator
peak / MFU (absolute time scale only) and the host link for state swaps. See
jaxflow/marl/simulate/ for the model (driver: jaxflow/main/flexmarl_scale.py).
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, POSITIVE, SEED, domains
from jaxflow.marl.simulate import AgentLoad, Hardware

DESCRIPTION = "Simulated FlexMARL vs sync baseline at 8-64 nodes (calibrated from flexmarl)"
ENTRY = "jaxflow.main.flexmarl_scale:main"
HEADLINES = "jaxflow.study.headlines_systems:flexmarl_scale"

# Assumed paper-scale agents: a 7B solver with long-tailed reasoning lengths and a 3B verifier
# that reads the solver's trajectory 0 and answers briefly.
SOLVER = AgentLoad("solver", params=7e9, prompt_tokens=256, len_median=600.0, len_sigma=1.0,
                   len_max=8192)
VERIFIER = AgentLoad("verifier", params=3e9, prompt_tokens=128, len_median=150.0,
                     len_sigma=0.7, len_max=2048, upstream="solver")


@domains(seed=SEED, nodes=COUNT, devices_per_node=COUNT, slots=COUNT, inputs_per_node=COUNT, global_inputs=COUNT0,
         sigma_scale=NON_NEGATIVE, group_size=COUNT, versions=COUNT, micro_batch=COUNT, etas=COUNT,
         sensitivity_factors=POSITIVE, validation_rel_tol=POSITIVE)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    nodes: tuple[int, ...] = (8, 16, 32, 64)
    devices_per_node: int = 8
    slots: int = 64  # concurrent sequences per accelerator (KV memory)
    inputs_per_node: int = 16  # prompts per version per node (weak scaling)
    global_inputs: int = 0  # > 0: this many prompts per version at every scale (strong scaling)
    sigma_scale: float = 1.0  # multiplies every agent's len_sigma (0 = no length skew)
    group_size: int = 8
    versions: int = 6
    micro_batch: int = 8  # trainer micro-batch, samples (at least the agent's train devices)
    request_policy: str = "work_stealing"  # FlexMARL's request level
    etas: tuple[int, ...] = (1,)  # bounded-staleness rows besides strict
    agents: tuple = (SOLVER, VERIFIER)
    # calibration file written by `flexmarl --set calibration_out=...`, or a flexmarl run dir /
    # summary.json; "" = jaxflow/marl/simulate/data/flexmarl_quick.json
    calibration: str = ""
    hardware: Hardware = Hardware()
    sensitivity_factors: tuple[float, ...] = (0.5, 2.0)  # each measured per-param cost x these
    validation_rel_tol: float = 0.25  # paper_checks: |predicted / paper - 1| <= this passes

    def __post_init__(self):
        if any(not f > 0 for f in self.sensitivity_factors) or not self.validation_rel_tol > 0:
            raise ValueError(f"sensitivity_factors={self.sensitivity_factors} / validation_rel_tol="
                             f"{self.validation_rel_tol}; need > 0")


def _quick() -> Config:
    return Config(inputs_per_node=8, versions=3)


def _full() -> Config:
    return Config(nodes=(8, 16, 24, 32, 48, 64), inputs_per_node=32, versions=10,
                  etas=(1, 2))


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
