"""The ``decoratelm`` experiment's corpus: a pool of real passages (pydoc_data.topics + stdlib
docstrings), templated multi-topic documents with a skewed topic mix, degraded copies of known
noise level and keyword-salad noise; real passages of held-out topics for perplexity (never
selectable) and a clean probe set uniform over categories.

  build_corpus   (pool, held-out real, probe, fingerprint of the real text)
  composition    the share of each source in a set of documents
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxflow.decorate import corpus as C
from jaxflow.decorate.corpus import Document
from jaxflow.decorate.tagging import TagHierarchy

#: The document sources of the pool, in the order reports list them.
SOURCES = ("pydoc_topics", "docstring", "template", "degraded", "noise")


def build_corpus(cfg, hierarchy: TagHierarchy, seed: int
                 ) -> tuple[list[Document], list[Document], list[Document], dict]:
    """(pool docs, held-out real docs, probe docs, fingerprint of the real text) of the corpus
    config ``cfg`` (``configs.decoratelm.CorpusConfig``), drawn from ``seed``.

    Raises:
      ValueError: ``n_real + n_heldout_real`` exceeds this Python's real passages.
    """
    real = C.pydoc_passages(cfg.max_chars) + C.docstring_passages(cfg.max_chars)
    fingerprint = C.corpus_fingerprint(real)
    rng = np.random.default_rng(seed)
    need = cfg.n_real + cfg.n_heldout_real
    if need > len(real):
        raise ValueError(f"corpus.n_real + n_heldout_real = {need} exceeds the {len(real)} real "
                         f"passages of this Python at max_chars={cfg.max_chars}")
    # Held-out passages come from whole topics/objects not in the pool, so no near-duplicate
    # chunk of the same topic leaks into training.
    groups = sorted({d.id.split("#")[0] for d in real})
    order = rng.permutation(len(groups))
    by_group = collections.defaultdict(list)
    for d in real:
        by_group[d.id.split("#")[0]].append(d)
    heldout: list[Document] = []
    pool_real: list[Document] = []
    for g in order:
        (heldout if len(heldout) < cfg.n_heldout_real else pool_real).extend(by_group[groups[g]])
    heldout = heldout[: cfg.n_heldout_real]
    pool_real = [pool_real[i] for i in rng.permutation(len(pool_real))[: cfg.n_real]]
    gen = C.TemplateGenerator(hierarchy, max_chars=cfg.max_chars)
    templates = gen.generate(cfg.n_template, seed=seed + 1, level1_skew=cfg.level1_skew)
    sources = pool_real + templates
    degraded = []
    for i in range(cfg.n_degraded):
        src = sources[rng.integers(len(sources))]
        level = cfg.noise_levels[i % len(cfg.noise_levels)]
        text = C.chunk_text(C.degrade(src.text, level, rng), cfg.max_chars)[0]
        degraded.append(dataclasses.replace(src, id=f"deg:{i}:{src.id}", text=text,
                                            source="degraded", noise=level))
    noise = [C.noise_document(rng, hierarchy, f"noise:{i}",
                              int(rng.integers(cfg.max_chars // 2, cfg.max_chars)))
             for i in range(cfg.n_noise)]
    pool = pool_real + templates + degraded + noise
    pool = [pool[i] for i in rng.permutation(len(pool))]
    probe = gen.generate(cfg.n_probe, seed=seed + 2, level1_skew=0.0, prefix="probe",
                         latent_low=0.5)
    return pool, heldout, probe, fingerprint


def composition(docs: Sequence[Document]) -> dict[str, float]:
    """``{source: share}`` over :data:`SOURCES` (0 for an empty set)."""
    counts = collections.Counter(d.source for d in docs)
    n = max(len(docs), 1)
    return {k: counts.get(k, 0) / n for k in SOURCES}
