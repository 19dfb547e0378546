"""Recommendation models (DLRM, DCN-v2), data (synthetic Criteo-like, Criteo TSV, MovieLens),
metrics (AUC, logloss). The ``dlrm_train`` / ``bench_embedding`` experiments live in ``jaxflow/main/``."""

from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import DLRM, MLP, CrossLayer, DCNv2, build_model, functional
from jaxflow.recsys.readers import file_batch, movielens_to_clicks, read_atomic_file, read_criteo_tsv, read_movielens
from jaxflow.recsys.synthetic import CRITEO_LIKE_VOCABS, SyntheticConfig, SyntheticCriteo

__all__ = [
    "DLRM", "DCNv2", "MLP", "CrossLayer", "build_model", "functional",
    "CRITEO_LIKE_VOCABS", "SyntheticConfig", "SyntheticCriteo",
    "read_criteo_tsv", "read_movielens", "read_atomic_file", "movielens_to_clicks", "file_batch",
    "roc_auc", "log_loss",
]
