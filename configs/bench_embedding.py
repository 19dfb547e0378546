"""bench_embedding: sharded lookup + sparse update vs two jnp.take baselines (same run, random
order within each round): dense gradient + dense optimizer on the full table, and sparse
(gradient of the gathered rows + segment_sum over the unique ids + row-wise Adagrad on those
rows only); and the Pallas embedding-bag kernel vs its reference.

    python -m jaxflow.run --exp=bench_embedding --variant=quick
    python -m jaxflow.run --exp=bench_embedding --variant=default
    python -m jaxflow.run --exp=bench_embedding --variant=device          # one accelerator
    python -m jaxflow.run --exp=bench_embedding --variant=full --compile-only --target=tpu-v5p:4x4x4

The mesh is one "data" axis over every device there is (-1): on a CPU-only machine the runner
creates ``devices`` (8) fake CPU devices unless ``--devices`` says otherwise; on one GPU it runs
on 1 (no All2All traffic).
Summary keys: ``speedup_vs_dense_take`` (dense step time / sharded step time, median of the
rounds; ``speedup_spread`` = [min, max]), ``speedup_vs_sparse_take`` (the same against the
sparse baseline on the same mesh; ``speedup_vs_sparse_spread``), ``speedup_vs_best_sparse_take``
(against the faster of the sparse baseline's placements, ``best_sparse_take``), ``ratios`` (every
baseline: median, min, max) and ``rows_per_second`` (non-padding ids looked up and
updated per second by the sharded path).

``device`` is the size one accelerator runs (26 tables x 2M rows x 128, batch 65,536: 27 GB of
tables). ``full`` is the production size of ``dlrm_train --variant=full``: 26 tables of
10M..100M rows (``configs.dlrm_train.PRODUCTION_VOCABS``, 1.03B rows, 528 GB at dim 128),
batch 65,536, bags of 1..4 ids. Sharding: the jaxflow tables row-wise over the one "data" axis
(one packed group; 8.3 GB per device on a v5p:4x4x4 pod of 64), the baselines' tables
row-sharded by ``NamedSharding(P("data"))`` (every row count divides 64), ids and targets split
over "data"; the one-device sparse baseline is off (528 GB on one device). It does not run on
a CPU host (the tables start in host memory); check it with ``--compile-only``: it fits
v5p:4x4x4 and 8 x H100 / H200; on v6e:16x16 it exits 2 (256 devices do not divide every table's
rows, so the baselines' tables would be replicated: ``jaxflow.compile_only.resolve.table_layout``).
"""

from __future__ import annotations

import dataclasses

from configs.dlrm_train import POOLING_BACKENDS, PRODUCTION_VOCABS
from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, POSITIVE, SEED, domains
from jaxflow.mesh import MeshConfig

DESCRIPTION = "sharded embedding lookup + sparse update vs dense and sparse jnp.take baselines; Pallas bag kernel"
ENTRY = "jaxflow.main.bench_embedding:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_embedding"


@domains(seed=SEED, num_tables=COUNT, vocab_size=COUNT, vocab_sizes=COUNT, dim=COUNT, batch_size=COUNT, bag=COUNT,
         zipf_a=POSITIVE, learning_rate=POSITIVE, capacity=COUNT0, bucket_capacity=COUNT0, num_batches=COUNT,
         warmup=COUNT0, pairs=COUNT, kernel_vocab=COUNT, kernel_bags=COUNT, kernel_pairs=COUNT, devices=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    num_tables: int = 8
    vocab_size: int = 200_000  # rows of every table, unless vocab_sizes gives one per table
    vocab_sizes: tuple[int, ...] = ()  # rows of each table (num_tables of them); () = vocab_size
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
    # the jaxflow path's bag pooling: "auto" = the Pallas embedding-bag kernel on GPU / TPU
    # where it builds, XLA on a CPU (the same values as "xla" there)
    pooling_backend: str = "auto"

    def __post_init__(self):
        if self.vocab_sizes and len(self.vocab_sizes) != self.num_tables:
            raise ValueError(f"vocab_sizes has {len(self.vocab_sizes)} entries but num_tables="
                             f"{self.num_tables}; valid: one row count per table, or () for "
                             f"{self.num_tables} tables of vocab_size={self.vocab_size}")
        if self.pooling_backend not in POOLING_BACKENDS:
            raise ValueError(f"pooling_backend={self.pooling_backend!r}; valid: "
                             f"{', '.join(POOLING_BACKENDS)}")

    def table_rows(self) -> tuple[int, ...]:
        """Rows of each of the ``num_tables`` tables."""
        return tuple(self.vocab_sizes) or (self.vocab_size,) * self.num_tables


def _quick() -> Config:
    return Config(vocab_size=200_000, dim=32, batch_size=2048, capacity=4096, kernel_bags=32)


def _default() -> Config:
    return Config(capacity=8192, pairs=20)


def _device() -> Config:
    return Config(num_tables=26, vocab_size=2_000_000, dim=128, batch_size=65536, pairs=30,
                  capacity=131072,
                  kernel_vocab=100_000, kernel_bags=65536)


def _full() -> Config:
    """Production size (see the module docstring): 26 x 10M..100M rows x 128, batch 65,536."""
    return Config(num_tables=26, vocab_sizes=PRODUCTION_VOCABS, vocab_size=max(PRODUCTION_VOCABS),
                  dim=128, batch_size=65536, pairs=30, sparse_one_device=False,
                  kernel_vocab=100_000, kernel_bags=65536)


get_config = Variants(quick=_quick, default=_default, device=_device, full=_full)
VARIANTS = get_config.variants
