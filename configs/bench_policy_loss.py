"""bench_policy_loss: the full loss step from hidden states, SIS vs none; fused vs naive bytes.

    python -m jaxflow.run --exp=bench_policy_loss --variant=quick
    python -m jaxflow.run --exp=bench_policy_loss --variant=default
    python -m jaxflow.run --exp=bench_policy_loss --variant=default --set backend=pallas  # GPU

One step = LM head + fused log-probs (+ log-probs at pi_old's top-K for SIS) + policy loss,
forward and backward to the hidden states and the head. `none` is what a competent user runs
without SIS: the same fused path without the top-K gather. Memory: XLA's compiled memory
analysis (temp and output bytes) of the SIS step with the fused path vs the naive path that
materialises [B*T, V] logits. ``grpo_iteration``: a GRPO iteration's CPU and wall seconds
with the separate pi_old forward and with the update's own forward (``GRPOConfig.reuse_forward``).
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, POSITIVE, SEED, domains

DESCRIPTION = "policy-loss step from hidden states: SIS overhead vs none, fused vs naive log-prob bytes"
ENTRY = "jaxflow.main.bench_policy_loss:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_policy_loss"


@domains(seed=SEED, batch=COUNT, seq_len=COUNT, d_model=COUNT, vocab=COUNT, topk=COUNT, temperature=POSITIVE,
         vocab_tile=COUNT, perturbation=NON_NEGATIVE, warmup=COUNT0, pairs=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    batch: int = 16  # sequences; batch * seq_len = 8192 tokens
    seq_len: int = 512
    d_model: int = 512
    vocab: int = 32768
    topk: int = 16  # K of pi_old's stored top-K (SIS envelope)
    temperature: float = 1.0
    algo: str = "grpo"
    backend: str = "xla"  # fused log-prob backend: xla | pallas (GPU/TPU) | reference
    vocab_tile: int = 2048  # XLA path
    perturbation: float = 0.05  # head noise between pi_old and the current policy (relative)
    warmup: int = 1  # untimed steps per arm after the compiling one
    pairs: int = 10  # interleaved (none, sis) timing pairs
    measure_memory: bool = True
    grpo_iteration: bool = True  # also time a GRPO iteration with / without the pi_old forward

    def __post_init__(self):
        if self.pairs < 1 or self.warmup < 0:
            raise ValueError(f"pairs={self.pairs} must be >= 1 and warmup={self.warmup} >= 0")
        if self.backend not in ("xla", "pallas", "reference"):
            raise ValueError(f"backend={self.backend!r}; valid: xla, pallas, reference")
        if not 0 < self.topk <= self.vocab:
            raise ValueError(f"topk={self.topk} must be in [1, vocab={self.vocab}]")


def _quick() -> Config:
    return Config(batch=4, seq_len=128, d_model=128, vocab=4096, vocab_tile=1024)


def _full() -> Config:
    return Config(vocab=131072, pairs=20)


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
