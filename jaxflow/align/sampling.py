"""A seed's pool of FIGA pairs drawn from a model's own samples, and its sizes.

:func:`sample_pairs` asks a :class:`jaxflow.rl.rollout.RolloutWorker` for ``group_size``
samples of fresh task prompts per round until ``pairs`` wrong, complete samples have oracle
revisions (:func:`jaxflow.align.pairs.build_pairs`); :func:`pair_stats` sizes the pool.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxflow.align.pairs import PairData, addition_answers, build_pairs, concat_pairs
from jaxflow.data.tokenizer import CharTokenizer


def sample_pairs(worker, params: Any, task, tokenizer: CharTokenizer, data_cfg, *, seed: int,
                 width: int) -> PairData:
    """The seed's pair pool: wrong, complete samples of ``params`` with oracle revisions.

    ``worker``: a ``RolloutWorker`` (``generate(params, texts, key)``, ``spec.group_size``);
    ``task``: an addition task (``prompts(rng, n)``); ``data_cfg``: ``max_rounds``,
    ``prompts_per_round``, ``pairs``; ``width``: the response length every pair is padded to.
    At most ``data_cfg.pairs`` pairs; raises RuntimeError when no sample was wrong."""
    rng = np.random.default_rng([seed, 0xF16A])
    key = jax.random.key(seed)
    g = worker.spec.group_size
    parts, total = [], 0
    for r in range(data_cfg.max_rounds):
        texts = task.prompts(rng, data_cfg.prompts_per_round)
        batch = worker.generate(params, texts, jax.random.fold_in(key, r))
        rows = [t for t in texts for _ in range(g)]
        part = build_pairs(rows, batch.prompts, batch.prompt_lengths, batch.tokens,
                           batch.rewards, tokenizer, addition_answers, length=width)
        if part is not None:
            parts.append(part)
            total += len(part.prompt_texts)
        if total >= data_cfg.pairs:
            break
    if not parts:
        raise RuntimeError("the warm start answered every sampled prompt correctly: no pairs")
    data = concat_pairs(parts)
    n = min(total, data_cfg.pairs)
    p = data.pairs
    return PairData(data.prompts[:n], data.prompt_lengths[:n], data.prompt_texts[:n],
                    type(p)(*(getattr(p, f)[:n] for f in p._fields)))


def pair_stats(data: PairData) -> dict:
    """Sizes of the pool: pairs, mean edited tokens per side, mean response lengths."""
    p = data.pairs
    return {
        "pairs": int(len(data.prompt_texts)),
        "positive_per_pair": float(np.mean(np.sum(p.revised_marks == 1, 1))),
        "negative_per_pair": float(np.mean(np.sum(p.original_marks == -1, 1))),
        "original_len": float(np.mean(np.sum(p.original_mask, 1))),
        "revised_len": float(np.mean(np.sum(p.revised_mask, 1))),
    }
