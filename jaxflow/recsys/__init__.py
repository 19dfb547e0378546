"""Recommendation models (DLRM, DCN-v2), data (synthetic Criteo-like, Criteo TSV, MovieLens),
metrics (AUC, logloss) and the ``dlrm_train`` / ``bench_embedding`` experiments (issue 7)."""
