"""What every generative arm of one seed shares: the data, the semantic IDs, the item trie and
the data-parallel mesh (:class:`GenRecSetup`, built once per seed by :func:`build_setup`).

``config`` is the ``oxygenrec`` experiment's (``configs/oxygenrec.py``: ``data``, ``model``,
``sft``, ``rl``, ``k``, ``beam_size``); ``seed`` seeds the synthetic data (or the MovieLens
split) and the k-means.
"""

from __future__ import annotations

import jax

from jaxflow.config import ConfigError
from jaxflow.genrec.data import movielens, synthetic
from jaxflow.genrec.data.requests import RecData
from jaxflow.genrec.semantic_ids import SemanticIds, rq_kmeans
from jaxflow.genrec.trie import Trie, build_trie


def load_data(config, seed: int) -> RecData:
    """The synthetic catalogue (``data.path`` empty) or the MovieLens file's requests; a file
    that cannot be read is one :class:`ConfigError` line naming it."""
    d = config.data
    if not d.path:
        return synthetic.generate(d.synthetic, seed=seed)
    try:
        return movielens.load_movielens(
            d.path, items_path=d.items_path or None, max_history=d.max_history,
            max_train_per_user=d.max_train_per_user, new_fraction=d.new_fraction,
            embeddings_path=d.embeddings_path or None, seed=seed)
    except (ValueError, OSError) as e:  # a user-given file: one-line CLI error
        raise ConfigError(f"data.path={d.path!r}: {e}") from None


def load_source(config) -> str:
    """``synthetic`` or ``movielens:<ratings>`` plus ``items:<file>`` (given or found beside
    the ratings) or ``items:none`` (co-occurrence embeddings)."""
    d = config.data
    if not d.path:
        return "synthetic"
    items = d.items_path or movielens.find_items_file(d.path)
    return f"movielens:{d.path} items:{items or 'none'}"


class GenRecSetup:
    """One seed's shared pieces (compared by identity: a static field of the system's state).

    Attributes:
      seed: the seed.
      data: the :class:`RecData`.
      sid: the :class:`SemanticIds` (codes int32[N, L + E]).
      trie: the :class:`Trie` over the codes.
      mesh: the 1-D "data" mesh training batches are split over.
    """

    def __init__(self, seed: int, data: RecData, sid: SemanticIds, trie: Trie, mesh):
        self.seed, self.data, self.sid, self.trie, self.mesh = seed, data, sid, trie, mesh


def build_setup(config, seed: int, mesh) -> GenRecSetup:
    """Data (:func:`load_data`), RQ-KMeans semantic IDs (``model.levels`` levels of
    ``model.width`` codes, ``model.dedup``; the items sharded over ``mesh`` when it has several
    devices) and their trie. Semantic IDs the catalogue cannot get are one ConfigError line."""
    data = load_data(config, seed)
    m = config.model
    try:  # items sharded over the data axis when there are several devices
        sid = rq_kmeans(data.item_features, levels=m.levels, width=m.width,
                        key=jax.random.key(seed), iters=m.kmeans_iters, dedup=m.dedup,
                        mesh=mesh if mesh.size > 1 else None)
    except ValueError as e:
        raise ConfigError(f"semantic IDs (model.levels={m.levels}, model.width={m.width}, "
                          f"model.dedup={m.dedup}): {e}") from None
    return GenRecSetup(seed, data, sid, build_trie(sid.codes, m.width), mesh)


def semantic_id_report(setup: GenRecSetup) -> dict:
    """The semantic IDs in numbers: reconstruction error and utilisation per level, collision
    rate, k-means / dedup levels, the largest prefix group and the trie's nodes."""
    sid = setup.sid
    return {"reconstruction_error": list(sid.reconstruction_error),
            "utilisation": list(sid.utilisation), "collision_rate": sid.collision_rate,
            "kmeans_levels": sid.kmeans_levels, "dedup_levels": sid.dedup_levels,
            "largest_prefix_group": sid.largest_prefix_group,
            "trie_nodes": int(setup.trie.children.shape[0])}
