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

DESCRIPTION = "packing algorithms: waste, imbalance, speed on long-tailed multi-image lengths"
ENTRY = "jaxflow.main.bench_packing:main"
VARIANTS = ("quick", "default", "full")


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


def get_config(variant: str) -> Config:
    if variant == "quick":
        return Config(batch_sizes=(64, 256), batches=5)
    if variant == "default":
        return Config()
    if variant == "full":
        return Config(batch_sizes=(64, 256, 1024), batches=50)
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
