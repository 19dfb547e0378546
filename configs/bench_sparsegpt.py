"""bench_sparsegpt: per-layer SparseGPT time and held-out reconstruction error, jaxflow vs
llmcompressor 0.14's ``sparsify_weight`` (PyTorch), on the same weights and activations.

Needs the optional extra (torch==2.13.0, llmcompressor==0.14.*): pip install -e '.[bench]'

    python -m jaxflow.run --exp=bench_sparsegpt --variant=quick
    python -m jaxflow.run --exp=bench_sparsegpt --variant=default
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, SEED, domains
from jaxflow.prune.masks import parse_sparsity

DESCRIPTION = "SparseGPT per-layer time and reconstruction error vs llmcompressor (torch)"
ENTRY = "jaxflow.main.bench_sparsegpt:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_sparsegpt"


@domains(seed=SEED, tokens=COUNT, block_size=COUNT, damp=NON_NEGATIVE, warmup=COUNT0, pairs=COUNT, torch_threads=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    layers: tuple[str, ...] = ("512x512", "1536x512", "512x1536")  # rows x cols (out x in)
    sparsities: tuple[str, ...] = ("0.5", "2:4")
    tokens: int = 4096  # calibration tokens (and as many held-out)
    block_size: int = 128
    damp: float = 0.01
    warmup: int = 2
    pairs: int = 10
    torch_threads: int = 2

    def __post_init__(self):
        for s in self.sparsities:
            parse_sparsity(s)
        for shape in self.layers:
            parts = shape.split("x")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise ValueError(f"layers: {shape!r} is not 'ROWSxCOLS'")


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(base, layers=("256x256", "768x256"), tokens=2048, pairs=10)


def _full() -> Config:
    base = Config()
    return dataclasses.replace(base, layers=base.layers + ("2048x2048", "5632x2048", "2048x5632"),
                               tokens=8192)


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
