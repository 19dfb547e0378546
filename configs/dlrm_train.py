"""dlrm_train: DLRM (or DCN-v2) over sharded embedding tables on synthetic Criteo-like data
(or a user's Criteo TSV / MovieLens ratings file); held-out AUC and log loss.

    python -m jaxflow.run --exp=dlrm_train --variant=quick --devices=8
    python -m jaxflow.run --exp=dlrm_train --variant=default --devices=8
    python -m jaxflow.run --exp=dlrm_train --variant=quick --devices=8 --set model.arch=dcn_v2
    python -m jaxflow.run --exp=dlrm_train --variant=quick --devices=8 \
        --set data.source=criteo --set data.path=/data/criteo/day_0_head.tsv
    python -m jaxflow.run --exp=dlrm_train --variant=quick --devices=8 \
        --set data.source=movielens --set data.path=/data/ml-1m/ratings.dat

The mesh is one "data" axis over every device (-1): batch-parallel dense model, tables placed
on the same axis. On a CPU-only machine ``--devices=8`` gives 8 fake devices.

``full`` is the production size (MLPerf DLRM on Criteo 1TB): 26 tables of 10M..100M rows
(:data:`PRODUCTION_VOCABS`, 1.03B rows, 528 GB of f32 at dim 128), one-hot ids, bottom MLP
512-256-128, top MLP 1024-1024-512-256-1, global batch 65,536. Sharding: every table row-wise
over the one "data" axis (one packed group, ``ceil(V / P)`` rows of each table per device: on
a v5p:4x4x4 pod 64 shards of 8.3 GB), the ids / dense features / labels split over "data", the
dense model replicated with its gradients psum-ed. It does not run on a CPU host (the tables are
initialised in host memory); check it with
``python -m jaxflow.run --exp=dlrm_train --variant=full --compile-only --target=tpu-v5p:4x4x4``.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants, require_finite, require_positive
from jaxflow.config_domains import COUNT, COUNT0, OPEN_UNIT, POSITIVE, SEED, domains
from jaxflow.embeddings.pooling import PoolingBackend
from jaxflow.mesh import MeshConfig
from jaxflow.recsys.synthetic import CRITEO_LIKE_VOCABS

DESCRIPTION = "DLRM / DCN-v2 on sharded embeddings; synthetic Criteo-like data; AUC + logloss"
ENTRY = "jaxflow.main.dlrm_train:main"
HEADLINES = "jaxflow.study.headlines_systems:dlrm_train"
#: the production tables (``full``; also bench_embedding's and nestpipe's): 26 row counts spread
#: geometrically over 10M..100M (round(10M x 10^(i/25))), table i getting the size of the same
#: rank as ``CRITEO_LIKE_VOCABS[i]`` among the Criteo-like ones; 1,032M rows in all, each a
#: multiple of 1M (so of 8 and 64 shards)
PRODUCTION_VOCABS = (28_000_000, 23_000_000, 100_000_000, 63_000_000, 21_000_000, 16_000_000,
                     44_000_000, 25_000_000, 10_000_000, 91_000_000, 40_000_000, 83_000_000,
                     33_000_000, 17_000_000, 52_000_000, 69_000_000, 12_000_000, 36_000_000,
                     30_000_000, 11_000_000, 76_000_000, 14_000_000, 13_000_000, 58_000_000,
                     19_000_000, 48_000_000)
POOLING_BACKENDS = tuple(b.value for b in PoolingBackend)


@domains(vocab_sizes=COUNT, multi_hot=COUNT, zipf_a=POSITIVE, drift_period=COUNT, max_rows=COUNT0,
         eval_fraction=OPEN_UNIT)
@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | criteo | movielens
    path: str = ""
    vocab_sizes: tuple[int, ...] = CRITEO_LIKE_VOCABS  # synthetic and criteo (hash-modulo buckets)
    multi_hot: int = 1
    zipf_a: float = 1.05
    drift_period: int = 50
    max_rows: int = 0  # files: 0 = all
    eval_fraction: float = 0.1  # files: the tail is held out

    def __post_init__(self):
        if self.source not in ("synthetic", "criteo", "movielens"):
            raise ValueError(f"data.source={self.source!r}; valid: synthetic, criteo, movielens")
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path=<file> (a "
                             f"{'Criteo TSV' if self.source == 'criteo' else 'MovieLens ratings'} file)")


@domains(embed_dim=COUNT, bottom=COUNT, top=COUNT, cross_layers=COUNT0, deep=COUNT)
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = "dlrm"  # dlrm | dcn_v2
    embed_dim: int = 16
    bottom: tuple[int, ...] = (64, 32)
    top: tuple[int, ...] = (64, 32)
    cross_layers: int = 2
    deep: tuple[int, ...] = (64, 32)
    # bag pooling: "auto" = the Pallas embedding-bag kernel on GPU / TPU where it builds, XLA
    # on a CPU (the same values as "xla" there)
    pooling_backend: str = "auto"

    def __post_init__(self):
        if self.arch not in ("dlrm", "dcn_v2"):
            raise ValueError(f"model.arch={self.arch!r}; valid: dlrm, dcn_v2")
        if self.pooling_backend not in POOLING_BACKENDS:
            raise ValueError(f"model.pooling_backend={self.pooling_backend!r}; valid: "
                             f"{', '.join(POOLING_BACKENDS)}")


@domains(replicate_below=COUNT0, table_wise_below=COUNT0)
@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    replicate_below: int = 1000  # vocab <= this: replicated
    table_wise_below: int = 20000  # vocab <= this: table-wise; larger: row-wise


@domains(steps=COUNT, batch_size=COUNT, dense_lr=POSITIVE, sparse_lr=POSITIVE, capacity=COUNT0, log_every=COUNT,
         checkpoint_every=COUNT, eval_batches=COUNT)
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 1024
    dense_lr: float = 1e-3
    sparse_optimizer: str = "rowwise_adagrad"  # rowwise_adagrad | sgd | adam
    sparse_lr: float = 0.05
    capacity: int = 0  # distinct keys per device per group; 0 = the no-overflow bound
    log_every: int = 50
    checkpoint_every: int = 500
    eval_batches: int = 16

    def __post_init__(self):
        require_positive(self, "steps", "batch_size", "log_every", "checkpoint_every", "eval_batches")
        require_positive(self, "capacity", allow_zero=True)
        require_finite(self, "dense_lr", "sparse_lr", positive=True)


@domains(seed=SEED)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    placement: PlacementConfig = PlacementConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig(axes=("data",), shape=(-1,))


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(base, train=dataclasses.replace(
        base.train, steps=300, batch_size=512, log_every=25, checkpoint_every=150, eval_batches=8))


def _full() -> Config:
    """Production size (see the module docstring): 26 x 10M..100M rows x 128, batch 65,536."""
    base = Config()
    return dataclasses.replace(
        base, data=dataclasses.replace(base.data, vocab_sizes=PRODUCTION_VOCABS, multi_hot=1),
        model=dataclasses.replace(base.model, embed_dim=128, bottom=(512, 256),
                                  top=(1024, 1024, 512, 256)),
        train=dataclasses.replace(base.train, steps=20000, batch_size=65536, checkpoint_every=2000,
                                  eval_batches=32))


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
