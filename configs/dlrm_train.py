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
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import require_finite, require_positive
from jaxflow.mesh import MeshConfig
from jaxflow.recsys.synthetic import CRITEO_LIKE_VOCABS

DESCRIPTION = "DLRM / DCN-v2 on sharded embeddings; synthetic Criteo-like data; AUC + logloss"
ENTRY = "jaxflow.main.dlrm_train:main"
VARIANTS = ("quick", "default", "full")


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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = "dlrm"  # dlrm | dcn_v2
    embed_dim: int = 16
    bottom: tuple[int, ...] = (64, 32)
    top: tuple[int, ...] = (64, 32)
    cross_layers: int = 2
    deep: tuple[int, ...] = (64, 32)

    def __post_init__(self):
        if self.arch not in ("dlrm", "dcn_v2"):
            raise ValueError(f"model.arch={self.arch!r}; valid: dlrm, dcn_v2")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    replicate_below: int = 1000  # vocab <= this: replicated
    table_wise_below: int = 20000  # vocab <= this: table-wise; larger: row-wise


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


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    placement: PlacementConfig = PlacementConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig(axes=("data",), shape=(-1,))


def get_config(variant: str) -> Config:
    base = Config()
    if variant == "quick":
        return dataclasses.replace(base, train=dataclasses.replace(
            base.train, steps=300, batch_size=512, log_every=25, checkpoint_every=150, eval_batches=8))
    if variant == "default":
        return base
    if variant == "full":
        return dataclasses.replace(
            base, data=dataclasses.replace(base.data, vocab_sizes=tuple(v * 10 for v in CRITEO_LIKE_VOCABS)),
            model=dataclasses.replace(base.model, embed_dim=64, bottom=(512, 256), top=(512, 256)),
            train=dataclasses.replace(base.train, steps=20000, batch_size=8192, checkpoint_every=2000,
                                      eval_batches=32))
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
