"""Recommendation models (DLRM, DCN-v2), data (synthetic Criteo-like, Criteo TSV, MovieLens),
metrics (AUC, logloss) and the DLRM system.

Modules (one idea each):
  models     DLRM / DCN-v2 in flax nnx, ``functional``, ``dense_model_flops``
  synthetic  the Criteo-like generator with a planted click model
  readers    Criteo TSV, MovieLens and RecBole atomic files
  source     ``DataSource`` (batches of the generator or a file), ``feature_layout``, ``place_batch``
  metrics    ``roc_auc``, ``log_loss``
  system     ``DLRMSystem`` / ``DLRMState``: sharded tables + dense model as a ``jaxflow.system.System``

The ``dlrm_train`` / ``bench_embedding`` experiments live in ``jaxflow/main/``."""

from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import DLRM, MLP, CrossLayer, DCNv2, build_model, dense_model_flops, functional
from jaxflow.recsys.readers import file_batch, movielens_to_clicks, read_atomic_file, read_criteo_tsv, read_movielens
from jaxflow.recsys.source import CRITEO_DENSE, DataSource, feature_layout, place_batch
from jaxflow.recsys.synthetic import CRITEO_LIKE_VOCABS, SyntheticConfig, SyntheticCriteo
from jaxflow.recsys.system import (
    DLRMState,
    DLRMSystem,
    make_embeddings,
    make_model,
    make_step_and_predict,
    placement_counts,
    placement_for,
    placement_words,
    train_row,
)

__all__ = [
    "DLRM", "DCNv2", "MLP", "CrossLayer", "build_model", "functional", "dense_model_flops",
    "CRITEO_LIKE_VOCABS", "SyntheticConfig", "SyntheticCriteo",
    "read_criteo_tsv", "read_movielens", "read_atomic_file", "movielens_to_clicks", "file_batch",
    "CRITEO_DENSE", "DataSource", "feature_layout", "place_batch",
    "roc_auc", "log_loss",
    "DLRMSystem", "DLRMState", "placement_for", "make_embeddings", "make_model",
    "make_step_and_predict", "placement_words", "placement_counts", "train_row",
]
