"""flexmarl: the fastest bit-identical lockstep (per run, the faster of ``sync`` and
``sync_unblocked``) vs the FlexMARL micro-batch pipeline (strict and bounded staleness), on the
solver / verifier workflow; same samples in lockstep and strict.

    python -m jaxflow.run --exp=flexmarl --variant=quick      # ~1-2 min on 2 CPU cores
    python -m jaxflow.run --exp=flexmarl --variant=default    # ~3 min
    python -m jaxflow.run --exp=flexmarl --variant=full --compile-only --target=tpu-v5p:4x4x4
    python -m jaxflow.run --exp=flexmarl --variant=quick --set runs=3   # README figures
    python -m jaxflow.run --exp=flexmarl --variant=quick \
        --set calibration_out=jaxflow/marl/simulate/data/flexmarl_quick.json

``--devices=N`` (fake CPU devices): 2 gives the trainer and rollout roles disjoint halves; >= 3
also gives each agent its own trainer devices in proportion to its size (agent-centric
allocation, see jaxflow.marl.meshes.agent_centric_meshes); 1 colocates everything. On a GPU /
TPU the same split runs over the accelerators present. Across processes (``--coordinator`` ...)
every mesh spans every process alike (trainer blocks of lcm(model degree, processes) devices),
every run is inline (bounded: a fixed lag of eta versions), timing decisions are process 0's
(jaxflow.marl.processes), and ``rollout_workers`` must be 1.

``full`` is the production size: a Qwen3-8B solver and a Qwen3-4B-shaped verifier (Qwen3-8B's
config.json with the 4B's width 2560, MLP 9728, head dim 128 and tied embeddings; both keep the
151,936-token vocabulary, the character tokenizer uses its first ids), bf16 compute on float32
master weights, every block rematerialised and the blocks run as one scan over the layers
(``scan_layers``: the same arithmetic, compiled once per layer body); 16 inputs x 8 samples per version and agent,
1,024-token responses, micro-batches of 4 inputs (32 rows), rollout calls of 4 inputs.
Sharding: meshes data x model with 8-way tensor parallelism (heads / mlp / vocab by the logical
rules); on a v5p:4x4x4 pod the rollout role has 32 chips (4 x 8, both agents' engines) and each
agent's trainer 16 (2 x 8). On fewer devices the model axis shrinks to what the blocks allow
(8 GPUs: rollout 1 x 4, each trainer 1 x 2). ``--compile-only --target=T`` sets the caps
``trainer_model`` / ``rollout_model`` for T instead (:mod:`jaxflow.compile_only.variants`: the
smallest power-of-2 degrees whose HBM estimate fits every agent; v5p:4x4x4: 4 / 1, 8 x H200:
2 / 1, v6e:16x16: 8 / 2); on 8 x H100 it exits 2, the solver's trainer not fitting (the smallest
target its HBM estimate fits: 8 x H200). On a pod slice each agent's trainer devices are whole
hosts in id order (blocks of 8 v5p / 32 v6e chips: 16 + 16 and 64 + 64), the sub-meshes libtpu
compiles for; records in ``experiments/compile_reports/``.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, SEED, domains
from jaxflow.models.architectures import shipped_config
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "FlexMARL micro-batch pipeline (strict / bounded) vs synchronous multi-agent GRPO"
ENTRY = "jaxflow.main.flexmarl:main"
HEADLINES = "jaxflow.study.headlines_systems:flexmarl"


@domains(seed=SEED, group_size=COUNT, max_digits=COUNT, solver_tokens=COUNT, verifier_tokens=COUNT, n_inputs=COUNT,
         steps=COUNT, reps=COUNT, runs=COUNT, probe_rounds=COUNT, probe_steps=COUNT0, micro_inputs=COUNT,
         rollout_batch=COUNT, rollout_workers=COUNT, engine_chunk=COUNT, etas=COUNT, bench_tokens=COUNT,
         bench_rows=COUNT, bench_chunk=COUNT, entropy_coef=NON_NEGATIVE, trainer_model=COUNT, rollout_model=COUNT)
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
    # the paged rollout engine (jaxflow.rollout, through jaxflow.marl.sampling.AgentSampler):
    # decode steps per decode call; a finished row leaves the decode batch after its call
    rollout_workers: int = 1     # 1, or >= 2: per-agent worker pools (agent-level balancing)
    engine_chunk: int = 2
    etas: tuple[int, ...] = (1, 2)  # bounded-staleness runs
    bench_tokens: int = 24       # engine benchmark: bucketed vs padded decode of the solver
    bench_rows: int = 64
    bench_chunk: int = 4         # ... its decode steps per decode call
    entropy_coef: float = 0.01
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=0)
    # write the simulator's calibration file here (flexmarl_scale reads it; see its config)
    calibration_out: str = ""
    # Tensor-parallel caps: the "model" axis of each trainer / the rollout mesh is the largest
    # divisor of these its devices allow (jaxflow.marl.meshes); 1 = data parallel only.
    trainer_model: int = 1
    rollout_model: int = 1

    def __post_init__(self):
        if self.runs < 1 or self.reps < 1 or self.probe_rounds < 1 or self.probe_steps < 0:
            raise ValueError(f"runs={self.runs}, reps={self.reps}, probe_rounds="
                             f"{self.probe_rounds}, probe_steps={self.probe_steps}; need >= 1 "
                             "(probe_steps >= 0)")
        for name in ("trainer_model", "rollout_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; valid: an integer >= 1")
        if isinstance(self.max_digits, bool) or not isinstance(self.max_digits, int) \
                or not 1 <= self.max_digits <= 9:
            raise ValueError(f"max_digits={self.max_digits!r}; valid: 1..9")


def _quick() -> Config:
    return Config(n_inputs=4, steps=4, group_size=4, reps=10, micro_inputs=2)


def _full() -> Config:
    """Qwen3-8B solver + Qwen3-4B-shaped verifier at production sizes (module docstring)."""
    qwen8 = shipped_config("qwen3-8b", dtype="float32", remat=True, scan_layers=True)
    qwen4 = dataclasses.replace(qwen8, d_model=2560, d_ff=9728, head_dim_override=128,
                                tie_embeddings=True)
    bf16 = dict(dtype="bfloat16")  # compute dtype; the parameters stay float32
    return Config(solver=dataclasses.replace(qwen8, **bf16),
                  verifier=dataclasses.replace(qwen4, **bf16), group_size=8, max_digits=2,
                  solver_tokens=1024, verifier_tokens=1024, n_inputs=16, steps=20, reps=3,
                  probe_rounds=2, micro_inputs=4, rollout_batch=4, engine_chunk=64,
                  etas=(1, 2), bench_tokens=1024, bench_rows=32, bench_chunk=64,
                  entropy_coef=0.0,  # the exact entropy materialises [rows, 1024, 151936]
                  optim=OptimConfig(lr=1e-6, warmup_steps=0), trainer_model=8, rollout_model=8)


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
