"""bench_sync_codec: SparseRL-Sync codecs (dense, coo, gap, entropy, auto) vs PULSE-style
baseline and a memory copy, on synthetic optimizer-made bf16 trees.

    python -m jaxflow.run --exp=bench_sync_codec --variant=quick     # ~5M elements, ~1 min
    python -m jaxflow.run --exp=bench_sync_codec --variant=default   # ~109M elements
    python -m jaxflow.run --exp=bench_sync_codec --variant=full      # ~505M elements, ~8 GB RAM
"""

import dataclasses

DESCRIPTION = "Sparse bf16 weight-sync codecs: bytes vs entropy bound and encode/apply GB/s"
ENTRY = "jaxflow.main.bench_sync_codec:main"
VARIANTS = ("quick", "default", "full")


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    d_model: int = 1024
    n_layers: int = 6
    vocab: int = 32768
    densities: tuple = (0.001, 0.006, 0.03, 0.2)
    codecs: tuple = ("dense", "coo", "gap", "entropy", "auto")
    timing_rounds: int = 10  # at 0.6%: every codec alternated this many times
    timing_rounds_other: int = 3
    bucket_elems: int = 1 << 26
    zstd_level: int = 3


def get_config(variant: str) -> Config:
    if variant == "quick":
        return Config(d_model=256, n_layers=4, vocab=8192)
    if variant == "default":
        return Config()  # 6 x 12.6M + 33.6M = 109M bf16 elements
    if variant == "full":
        return Config(d_model=2048, n_layers=8, vocab=50304, timing_rounds_other=2)
    raise ValueError(f"unknown variant {variant!r}; valid: {VARIANTS}")
