"""bench_packing: padding waste, cost imbalance and speed of the packing algorithms.

Distributions: the flowtrain digits samples (1-4 images at 8-32 px plus text), and a synthetic
long-tailed multi-image one (Pareto image counts and resolutions, up to 16 images of 256
tokens). Algorithms: first_fit (grain-style, the comparison), lpt, karmarkar_karp; plus
"padded" (one sample per row at the batch's own maximum) for reference.

    python -m jaxflow.run --exp=bench_packing --variant=quick
    python -m jaxflow.run --exp=bench_packing --variant=default
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, SEED, domains

DESCRIPTION = "packing algorithms: waste, imbalance, speed on long-tailed multi-image lengths"
ENTRY = "jaxflow.main.bench_packing:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_packing"


@domains(seed=SEED, batch_sizes=COUNT, batches=COUNT, data_parallel=COUNT, d_model=COUNT, digits_budget=COUNT,
         synthetic_budget=COUNT, row_granularity=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    batch_sizes: tuple[int, ...] = (64, 256)
    batches: int = 20  # batches per (distribution, batch size)
    data_parallel: int = 8  # bins are a multiple of this
    d_model: int = 1024  # cost model width: a = 6 * d_model
    digits_budget: int = 384
    synthetic_budget: int = 4096
    row_granularity: int = 32


def _quick() -> Config:
    return Config(batch_sizes=(64, 256), batches=5)


def _full() -> Config:
    return Config(batch_sizes=(64, 256, 1024), batches=50)


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
