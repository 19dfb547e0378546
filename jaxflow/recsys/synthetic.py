"""Synthetic Criteo-like click data: 13 dense + 26 categorical features, Zipf ids, a planted signal.

Batch ``step`` is a pure function of ``(seed, step)``:
  * dense: log1p of heavy-tailed counts (Criteo's usual preprocessing), f32[B, 13];
  * categorical: per table, Zipf(a)-distributed ranks mapped to ids by a fixed random
    permutation, so consecutive batches share the hot keys; every ``drift_period`` steps the
    rank -> id map shifts by one rank, so the hot set drifts slowly (consecutive windows share
    all but one of their top-k keys). ``multi_hot`` ids per bag (-1 padded to a fixed length);
  * label: Bernoulli(sigmoid(planted logit)) with the logit a linear function of the dense
    features plus hidden per-id effects of the first ``informative`` tables.
Evaluation batches use steps offset by ``EVAL_OFFSET`` (disjoint random streams).
"""

from __future__ import annotations

import dataclasses

import numpy as np

EVAL_OFFSET = 1 << 30

#: 26 Criteo-like vocabulary sizes (a wide spread, scaled down from the 1TB dataset's).
CRITEO_LIKE_VOCABS = (1460, 583, 100000, 50000, 305, 24, 12517, 633, 3, 93145, 5683, 80000,
                      3194, 27, 14992, 60000, 10, 5652, 2173, 4, 70000, 18, 15, 28600, 105, 14200)


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """The synthetic Criteo-like clicks: vocabularies, dense features, bag size, Zipf exponent, drift period and
    click-signal parameters."""
    vocab_sizes: tuple[int, ...] = CRITEO_LIKE_VOCABS
    num_dense: int = 13
    multi_hot: int = 1  # ids per bag (max); bags are padded with -1
    zipf_a: float = 1.05
    drift_period: int = 50
    informative: int = 8  # tables whose ids carry click signal
    signal_scale: float = 1.0
    base_logit: float = -1.2  # ~25% clicks


class SyntheticCriteo:
    """A deterministic stream of Criteo-like batches (``batch(index, batch_size)``): Zipf ids, a drifting click
    model, labels drawn from it."""
    def __init__(self, config: SyntheticConfig, seed: int = 0):
        self.config, self.seed = config, seed
        rng = np.random.default_rng([seed, 7])
        self._cdf, self._perm, self._effect = [], [], []
        for v in config.vocab_sizes:
            w = 1.0 / np.arange(1, v + 1, dtype=np.float64) ** config.zipf_a
            self._cdf.append(np.cumsum(w) / w.sum())
            self._perm.append(rng.permutation(v).astype(np.int64))
            self._effect.append(rng.standard_normal(v).astype(np.float32))
        self._dense_w = rng.standard_normal(config.num_dense).astype(np.float32) / np.sqrt(config.num_dense)

    @property
    def table_names(self) -> tuple[str, ...]:
        """The sparse tables' names, ``c0``, ``c1``, ..."""
        return tuple(f"c{i}" for i in range(len(self.config.vocab_sizes)))

    def batch(self, step: int, batch_size: int) -> dict:
        """``{"dense": f32[B, F], "label": f32[B], "sparse": {name: int32[B, multi_hot]},
        "true_logit": f32[B]}`` (the planted logit, for the oracle AUC)."""
        c = self.config
        rng = np.random.default_rng([self.seed, int(step)])
        counts = np.floor(np.exp(rng.normal(0.0, 1.5, (batch_size, c.num_dense))))
        dense = np.log1p(counts).astype(np.float32)
        logit = c.base_logit + (dense - 1.0) @ self._dense_w * 0.5
        sparse = {}
        shift = int(step) // max(c.drift_period, 1)
        for t, (v, name) in enumerate(zip(c.vocab_sizes, self.table_names)):
            ranks = np.searchsorted(self._cdf[t], rng.random((batch_size, c.multi_hot)))
            ids = self._perm[t][(np.minimum(ranks, v - 1) + shift) % v]
            if c.multi_hot > 1:  # variable bag lengths: keep the first 1..multi_hot ids
                keep = rng.integers(1, c.multi_hot + 1, size=(batch_size, 1))
                ids = np.where(np.arange(c.multi_hot)[None, :] < keep, ids, -1)
            if t < c.informative:
                eff = np.where(ids >= 0, self._effect[t][np.maximum(ids, 0)], 0.0)
                logit = logit + c.signal_scale * eff.sum(1) / np.sqrt(c.informative)
            sparse[name] = ids.astype(np.int32)
        label = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return {"dense": dense, "label": label, "sparse": sparse, "true_logit": logit.astype(np.float32)}

    def eval_batch(self, index: int, batch_size: int) -> dict:
        """Held-out batch ``index`` (drawn from an index range training never uses)."""
        return self.batch(EVAL_OFFSET + index, batch_size)
