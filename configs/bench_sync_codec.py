"""bench_sync_codec: SparseRL-Sync codecs (dense, coo, gap, entropy, auto) vs PULSE-style
baseline and a memory copy, on synthetic optimizer-made bf16 trees.

    python -m jaxflow.run --exp=bench_sync_codec --variant=quick     # ~5M elements, ~1 min
    python -m jaxflow.run --exp=bench_sync_codec --variant=default   # ~109M elements
    python -m jaxflow.run --exp=bench_sync_codec --variant=full      # ~505M elements, ~8 GB RAM
"""

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, SEED, Int, domains

DESCRIPTION = "Sparse bf16 weight-sync codecs: bytes vs entropy bound and encode/apply GB/s"
ENTRY = "jaxflow.main.bench_sync_codec:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_sync_codec"


@domains(seed=SEED, d_model=COUNT, n_layers=COUNT, vocab=COUNT, timing_rounds=COUNT, timing_rounds_other=COUNT,
         tight_rounds=COUNT, bucket_elems=COUNT, zstd_level=Int(1, 22))
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
    tight_rounds: int = 60  # host sender publish vs PULSE encode alone, back to back (0: off)
    bucket_elems: int = 1 << 26
    zstd_level: int = 3


def _quick() -> Config:
    return Config(d_model=256, n_layers=4, vocab=8192)


def _default() -> Config:
    return Config(tight_rounds=20)  # 6 x 12.6M + 33.6M = 109M bf16 elements


def _full() -> Config:
    return Config(d_model=2048, n_layers=8, vocab=50304, timing_rounds_other=2, tight_rounds=20)


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
