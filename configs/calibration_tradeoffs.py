"""calibration_tradeoffs: capability-decomposed retention of SparseGPT under 10 calibration sources.

    python -m jaxflow.run --exp=calibration_tradeoffs --variant=quick
    python -m jaxflow.run --exp=calibration_tradeoffs --variant=default
    python -m jaxflow.run --exp=calibration_tradeoffs --variant=quick --set draws=2

The dense capability model is trained on the fly and cached under ``cache_root``
(runs/_cache/calibration_dense-<hash>); later runs with the same recipe reuse it.
quick: small model, 6 sources, sparsity 0.6 only, ONE calibration draw (no spread), 1-digit math.
default: all 10 sources x {0.5, 0.6, 0.7, 2:4} x 3 draws.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import require_positive
from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.prune.calibration import SOURCES, CalibrationConfig
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.sequential import METHODS
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "SparseGPT calibration sources x sparsity: per-capability retention and perplexity correlation"
ENTRY = "jaxflow.main.calibration_tradeoffs:main"
VARIANTS = ("quick", "default", "full")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 32
    seq_len: int = 128
    log_every: int = 50

    def __post_init__(self):
        require_positive(self, "steps", "batch_size", "seq_len", "log_every")


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    world_seed: int = 0
    math_digits: int = 2
    model: TransformerConfig = TransformerConfig(
        vocab_size=60, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=384, max_seq_len=128)
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=100)
    mesh: MeshConfig = MeshConfig()
    calibration: CalibrationConfig = CalibrationConfig(rows=32, seq_len=128)
    sources: tuple[str, ...] = SOURCES
    sparsities: tuple[str, ...] = ("0.5", "0.6", "0.7", "2:4")
    draws: int = 3
    method: str = "sparsegpt"
    block_size: int = 128
    calib_batch_rows: int = 16
    eval_examples: int = 128
    cache_root: str = "runs/_cache"

    def __post_init__(self):
        for s in self.sources:
            if s not in SOURCES:
                raise ValueError(f"sources: {s!r} is not a calibration source; valid: {', '.join(SOURCES)}")
        for s in self.sparsities:
            parse_sparsity(s)
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; valid: {', '.join(METHODS)}")
        if self.draws < 1:
            raise ValueError(f"draws={self.draws}: must be >= 1")


def get_config(variant: str) -> Config:
    base = Config()
    if variant == "quick":
        return dataclasses.replace(
            base,
            model=TransformerConfig(vocab_size=60, d_model=96, n_layers=2, n_heads=4, n_kv_heads=4,
                                    d_ff=256, max_seq_len=128),
            train=TrainConfig(steps=500, batch_size=32, seq_len=96, log_every=50),
            calibration=CalibrationConfig(rows=16, seq_len=96, igsp_pool_factor=2),
            sources=("math", "code", "text", "random", "mix", "igsp"),
            sparsities=("0.6",), draws=1, eval_examples=64, math_digits=1)
    if variant == "default":
        return base
    if variant == "full":
        return dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, d_model=192, n_layers=6, d_ff=512),
            train=dataclasses.replace(base.train, steps=4000),
            calibration=CalibrationConfig(rows=64, seq_len=128), draws=5, eval_examples=256)
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
