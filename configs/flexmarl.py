"""flexmarl: the fastest bit-identical lockstep (per run, the faster of ``sync`` and
``sync_unblocked``) vs the FlexMARL micro-batch pipeline (strict and bounded staleness), on the
solver / verifier workflow; same samples in lockstep and strict.

    python -m jaxflow.run --exp=flexmarl --variant=quick      # ~1-2 min on 2 CPU cores
    python -m jaxflow.run --exp=flexmarl --variant=default    # ~3 min
    python -m jaxflow.run --exp=flexmarl --variant=full       # bigger agents, 2-digit sums
    python -m jaxflow.run --exp=flexmarl --variant=quick --set runs=3   # README figures
    python -m jaxflow.run --exp=flexmarl --variant=quick \
        --set calibration_out=jaxflow/marl/simulate/data/flexmarl_quick.json

``--devices=N`` (fake CPU devices): 2 gives the trainer and rollout roles disjoint halves; >= 3
also gives each agent its own trainer devices in proportion to its size (agent-centric
allocation, see jaxflow.marl.meshes.agent_centric_meshes); 1 colocates everything. On a GPU /
TPU the same split runs over the accelerators present.
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
    auto: bool = True            # probe both lockstep forms and strict, time the fastest
    # as "auto"
    probe_rounds: int = 5
    probe_steps: int = 0  # steps per probe call; 0 = steps (short probes favour sync: a
    # pipeline's fill / drain is a larger share of a short run)
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
        if self.runs < 1 or self.reps < 1 or self.probe_rounds < 1 or self.probe_steps < 0:
            raise ValueError(f"runs={self.runs}, reps={self.reps}, probe_rounds="
                             f"{self.probe_rounds}, probe_steps={self.probe_steps}; need >= 1 "
                             "(probe_steps >= 0)")


def _quick() -> Config:
    return Config(n_inputs=4, steps=4, group_size=4, reps=10, micro_inputs=2)


def _full() -> Config:
    base = Config()
    wide = dict(vocab_size=base.solver.vocab_size, max_seq_len=64)
    return Config(solver=TransformerConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                                           d_ff=768, **wide),
                  verifier=TransformerConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                             d_ff=384, **wide),
                  max_digits=2, solver_tokens=8, verifier_tokens=2, n_inputs=16, steps=200,
                  reps=10, micro_inputs=4, etas=(1, 2, 4), bench_tokens=48, bench_rows=128)


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
