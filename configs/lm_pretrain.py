"""lm_pretrain: the decoder LM on multi-digit addition (character tokens), held-out exact match.

    python -m jaxflow.run --exp=lm_pretrain --variant=quick
    python -m jaxflow.run --exp=lm_pretrain --variant=default --set train.steps=3000
    python -m jaxflow.run --exp=lm_pretrain --variant=quick --devices=8 --set mesh.shape=4,2

The RL experiments warm-start from this run's checkpoint.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import require_positive
from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "decoder LM pretraining on multi-digit addition; loss + held-out exact-match accuracy"
ENTRY = "jaxflow.main.lm_pretrain:main"
VARIANTS = ("quick", "default", "full")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    max_digits: int = 3
    heldout_mod: int = 20
    loss_on: str = "answer"  # "answer": score answer digits + EOS; "all": every token

    def __post_init__(self):
        if self.loss_on not in ("answer", "all"):
            raise ValueError(f"data.loss_on={self.loss_on!r}; valid: answer, all")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 64
    seq_len: int = 96
    log_every: int = 20
    eval_every: int = 500
    eval_examples: int = 512
    checkpoint_every: int = 500
    keep_checkpoints: int = 3

    def __post_init__(self):
        require_positive(self, "steps", "batch_size", "seq_len", "log_every", "eval_every",
                         "eval_examples", "checkpoint_every", "keep_checkpoints")


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    model: TransformerConfig = TransformerConfig(
        vocab_size=23, d_model=128, n_layers=3, n_heads=4, n_kv_heads=4, d_ff=384, max_seq_len=128
    )
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}; valid: train.seq_len <= model.max_seq_len")


def get_config(variant: str) -> Config:
    base = Config()
    if variant == "quick":
        return dataclasses.replace(
            base,
            train=dataclasses.replace(base.train, steps=400, batch_size=32, eval_every=200,
                                      eval_examples=256, checkpoint_every=200),
        )
    if variant == "default":
        return base
    if variant == "full":
        return dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, d_model=256, n_layers=4, n_heads=8, d_ff=768),
            data=dataclasses.replace(base.data, max_digits=5),
            train=dataclasses.replace(base.train, steps=20000, batch_size=128, eval_every=2000,
                                      checkpoint_every=2000),
        )
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
