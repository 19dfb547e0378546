"""flexmarl: synchronous barrier baseline vs the FlexMARL strict micro-batch pipeline.

Solver (bigger) / verifier (smaller) workflow on 1-digit addition; same samples in both runs.

    python -m jaxflow.run --exp=flexmarl --variant=quick      # ~1-2 min on 2 CPU cores
    python -m jaxflow.run --exp=flexmarl --variant=default
"""

from __future__ import annotations

import dataclasses

from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "FlexMARL strict micro-batch pipeline vs synchronous multi-agent GRPO"
ENTRY = "jaxflow.marl.experiment:main"
VARIANTS = ("quick", "default")


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
    n_inputs: int = 8
    steps: int = 20
    entropy_coef: float = 0.01
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=0)


def get_config(variant: str) -> Config:
    if variant == "quick":
        return Config(n_inputs=4, steps=4, group_size=4)
    if variant == "default":
        return Config()
    raise ValueError(f"unknown variant {variant!r}; valid: {VARIANTS}")
