"""bench_embedding: sharded lookup + sparse update vs two jnp.take baselines (same run, random
order within each round): dense gradient + dense optimizer on the full table, and sparse
(gradient of the gathered rows + segment_sum over the unique ids + row-wise Adagrad on those
rows only); and the Pallas embedding-bag kernel vs its reference.

    python -m jaxflow.run --exp=bench_embedding --variant=quick
    python -m jaxflow.run --exp=bench_embedding --variant=default
    python -m jaxflow.run --exp=bench_embedding --variant=full            # an accelerator host

The mesh is one "data" axis over every device there is (-1): on a CPU-only machine the runner
creates ``devices`` (8) fake CPU devices unless ``--devices`` says otherwise; on one GPU it runs
on 1 (no All2All traffic).
Summary keys: ``speedup_vs_dense_take`` (dense step time / sharded step time, median of the
rounds; ``speedup_spread`` = [min, max]), ``speedup_vs_sparse_take`` (the same against the
sparse baseline on the same mesh; ``speedup_vs_sparse_spread``), ``speedup_vs_best_sparse_take``
(against the faster of the sparse baseline's placements, ``best_sparse_take``), ``ratios`` (every
baseline: median, min, max) and ``rows_per_second`` (non-padding ids looked up and
updated per second by the sharded path).
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.mesh import MeshConfig

DESCRIPTION = "sharded embedding lookup + sparse update vs dense and sparse jnp.take baselines; Pallas bag kernel"
ENTRY = "jaxflow.main.bench_embedding:main"


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    num_tables: int = 8
    vocab_size: int = 200_000
    dim: int = 64
    batch_size: int = 4096
    bag: int = 4  # ids per bag (1..bag, Zipf)
    zipf_a: float = 1.05
    learning_rate: float = 0.05
    capacity: int = 0  # distinct keys per device per step; 0 = the bound local batch x bag x tables
    bucket_capacity: int = 0  # keys per owner per step; 0 = 2 x capacity / devices (overflow raises)
    num_batches: int = 4  # distinct batches cycled through
    warmup: int = 2  # per path, includes compilation
    pairs: int = 10
    sparse_one_device: bool = True  # also time the sparse baseline with the tables on one device
    kernel_vocab: int = 512
    kernel_bags: int = 64
    kernel_pairs: int = 10
    mesh: MeshConfig = MeshConfig(axes=("data",), shape=(-1,))
    devices: int = 8  # fake CPU devices the runner creates when --devices is not given


def _quick() -> Config:
    return Config(vocab_size=200_000, dim=32, batch_size=2048, capacity=4096, kernel_bags=32)


def _default() -> Config:
    return Config(capacity=8192, pairs=20)


def _full() -> Config:
    return Config(num_tables=26, vocab_size=2_000_000, dim=128, batch_size=65536, pairs=30,
                  capacity=131072,
                  kernel_vocab=100_000, kernel_bags=65536)


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
