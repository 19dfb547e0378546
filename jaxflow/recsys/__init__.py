"""Recommendation models (DLRM, DCN-v2), data (synthetic Criteo-like, Criteo TSV, MovieLens),
metrics (AUC, logloss). The ``dlrm_train`` / ``bench_embedding`` experiments live in ``jaxflow/main/``."""
