"""Where the ``dlrm_train`` batches come from: the synthetic Criteo-like generator, a Criteo TSV
or a MovieLens ratings file (host numpy), and how a host batch is placed on the mesh.

``DataSource(config, seed)`` reads ``config.data`` (``source``, ``path``, ``vocab_sizes``, ...;
``configs/dlrm_train.py``); ``train(step, B)`` / ``eval(index, B)`` give ``{"sparse": {table:
int[B, L]}, "dense": f32[B, F], "label": f32[B]}`` (plus ``true_logit`` f32[B] from the
generator). :func:`feature_layout` is the same layout without building the data.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.recsys.readers import file_batch, movielens_to_clicks, read_criteo_tsv, read_movielens
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo

#: dense features of a Criteo TSV row (``readers.read_criteo_tsv``'s ``num_dense``)
CRITEO_DENSE = 13


class DataSource:
    """Train / eval batches from the synthetic generator or a user file (host numpy).

    Attributes:
      kind: ``config.data.source``; vocab: ``{table: rows}``; num_dense: dense features F.
    """

    def __init__(self, config, seed: int):
        d = config.data
        self.kind = d.source
        if d.source == "synthetic":
            self.gen = SyntheticCriteo(SyntheticConfig(
                vocab_sizes=tuple(d.vocab_sizes), multi_hot=d.multi_hot, zipf_a=d.zipf_a,
                drift_period=d.drift_period), seed=seed)
            self.vocab = dict(zip(self.gen.table_names, d.vocab_sizes))
            self.num_dense = self.gen.config.num_dense
            return
        if not d.path:
            raise ValueError(f"data.source={d.source!r} needs data.path=<file>")
        if d.source == "criteo":
            self.data = read_criteo_tsv(d.path, tuple(d.vocab_sizes), max_rows=d.max_rows or None)
            self.vocab = {f"c{i}": v for i, v in enumerate(d.vocab_sizes)}
        elif d.source == "movielens":
            self.data = movielens_to_clicks(read_movielens(d.path, max_rows=d.max_rows or None))
            self.vocab = {k: int(v.max()) + 1 for k, v in self.data["sparse"].items()}
        else:
            raise ValueError(f"data.source={d.source!r}; valid: synthetic, criteo, movielens")
        n = len(self.data["label"])
        self.split = max(1, int(n * (1 - d.eval_fraction)))
        self.num_dense = self.data["dense"].shape[1]

    def train(self, step: int, batch_size: int) -> dict:
        """The training batch of ``step`` (``batch_size`` rows; a file's head, cycled)."""
        if self.kind == "synthetic":
            return self.gen.batch(step, batch_size)
        return file_batch(self.data, step, batch_size, stop=self.split)

    def eval(self, index: int, batch_size: int) -> dict:
        """Held-out batch ``index`` (a file's tail, ``data.eval_fraction`` of it)."""
        if self.kind == "synthetic":
            return self.gen.eval_batch(index, batch_size)
        return file_batch(self.data, index, batch_size, start=self.split)


def feature_layout(config) -> tuple[dict[str, int], int, int]:
    """({table: rows}, dense features F, ids per bag L) of the config's data: the synthetic
    generator's and a Criteo file's from the config alone (nothing of the generator is built),
    MovieLens from its file."""
    d = config.data
    if d.source == "synthetic":
        synthetic = SyntheticConfig(vocab_sizes=tuple(d.vocab_sizes), multi_hot=d.multi_hot)
        return ({f"c{i}": v for i, v in enumerate(d.vocab_sizes)}, synthetic.num_dense,
                d.multi_hot)
    if d.source == "criteo":
        return {f"c{i}": v for i, v in enumerate(d.vocab_sizes)}, CRITEO_DENSE, 1
    data = DataSource(config, config.seed)
    return data.vocab, data.num_dense, 1


def place_batch(mesh, batch: dict) -> tuple[dict, dict]:
    """(ids ``{table: int[B, L]}``, ``{"dense": f32[B, F], "label": f32[B]}``) of a host batch,
    every array split over ``mesh``'s "data" axis."""
    sharding = NamedSharding(mesh, P("data"))
    ids = jax.device_put(batch["sparse"], sharding)
    rest = jax.device_put({"dense": batch["dense"], "label": batch["label"]}, sharding)
    return ids, rest
