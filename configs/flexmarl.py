"""flexmarl: synchronous barrier baseline vs the FlexMARL micro-batch pipeline (strict and
bounded staleness), on the solver / verifier workflow; same samples in sync and strict.

    python -m jaxflow.run --exp=flexmarl --variant=quick      # ~1-2 min on 2 CPU cores
    python -m jaxflow.run --exp=flexmarl --variant=default    # ~3 min
    python -m jaxflow.run --exp=flexmarl --variant=quick --set runs=3   # README figures
    python -m jaxflow.run --exp=flexmarl --variant=quick \
        --set calibration_out=jaxflow/marl/simulate/data/flexmarl_quick.json

``--devices=N`` (fake CPU devices): 2 gives the trainer and rollout roles disjoint halves; >= 3
also gives each agent its own trainer devices in proportion to its size (agent-centric
allocation, see jaxflow.marl.meshes.agent_centric_meshes); 1 colocates everything.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "FlexMARL micro-batch pipeline (strict / bounded) vs synchronous multi-agent GRPO"
ENTRY = "jaxflow.main.flexmarl:main"


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    solver: TransformerConfig = TransformerConfig(vocab_size=23, d_model=64, n_layers=2,
                                                  n_heads=4, n_kv_heads=4, d_ff=128,
                                                  max_seq_len=32)
    verifier: TransformerConfig = TransformerConfig(vocab_size=23, d_model=32, n_layers=1,
                                                    n_heads=2, n_kv_heads=2, d_ff=64,
                                                    max_seq_len=32)
    group_size: int = 8
    max_digits: int = 1
    solver_tokens: int = 6       # max response tokens: skewed lengths across agents
    verifier_tokens: int = 2
    n_inputs: int = 8
    steps: int = 20
    reps: int = 10               # timed rounds per run (every mode once, random order)
    runs: int = 1                # timing runs, each with its own warm-up and auto probe
    auto: bool = True            # probe lockstep vs strict, time the faster as "auto"
    probe_rounds: int = 5
    probe_steps: int = 4         # steps per probe call (a pipeline needs steps to overlap)
    micro_inputs: int = 2        # inputs per trainer micro-batch
    rollout_batch: int = 1       # inputs per rollout engine call (sync and pipeline alike)
    rollout_workers: int = 1     # 1, or >= 2: per-agent worker pools (agent-level balancing)
    engine_chunk: int = 2        # decode steps between compactions of finished rows
    etas: tuple[int, ...] = (1, 2)  # bounded-staleness runs
    bench_tokens: int = 24       # engine benchmark: compacted vs padded decode of the solver
    bench_rows: int = 64
    bench_chunk: int = 4
    entropy_coef: float = 0.01
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=0)
    # write the simulator's calibration file here (flexmarl_scale reads it; see its config)
    calibration_out: str = ""

    def __post_init__(self):
        if self.runs < 1 or self.reps < 1 or self.probe_rounds < 1 or self.probe_steps < 1:
            raise ValueError(f"runs={self.runs}, reps={self.reps}, probe_rounds="
                             f"{self.probe_rounds}, probe_steps={self.probe_steps}; each >= 1")


def _quick() -> Config:
    return Config(n_inputs=4, steps=4, group_size=4, reps=10, micro_inputs=2)


get_config = Variants(quick=_quick, default=Config)
VARIANTS = get_config.variants
