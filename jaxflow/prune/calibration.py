"""Calibration sources for post-training pruning, all under the same token budget.

``calibration_set(source, ...)`` returns packed batches (tokens/targets/loss_mask/segment_ids/
positions, [rows, seq_len]) ready for ``jaxflow.prune.prune``. Sources:

- ``math`` / ``code`` / ``general`` / ``commonsense``: one capability of the training corpus.
- ``text``: grammar-generated plain text only (the analogue of C4 / web text).
- ``random``: uniformly random non-special tokens.
- ``selfcal`` (Self-Cal): the model writes documents from BOS alone; the temperature falls
  linearly from ``t_init`` to ``t_final`` over the first ``schedule_tokens`` tokens.
- ``sgs`` (self-generating then sampling): 2-token prefixes of general text, sampled at
  T 0.6 / top-p 0.95 / top-k 50 / repetition penalty 1.2; documents above the 80th percentile
  of perplexity are dropped.
- ``mix``: the uniform multi-source mix: equal token shares of the four capability sources.
- ``igsp``: information-guided self-calibration (our design, below).

IGSP design (the paper publishes only a description). Inputs: the dense model and the
evaluation taxonomy (the four capability names, each with the format cue that names it in the
taxonomy: a digit for math, ``"x="``/``"close "`` for code, ``"the "`` for general,
``"q: which is "`` for commonsense); no corpus text.
  1. Capability-stratified pools: for each capability, the model continues its cues at
     T 1.0 / top-p 0.95 until EOS, ``pool_factor`` times more documents than that capability's
     share of the budget.
  2. Capability-specific perplexity bands: each document's perplexity under the model; keep the
     documents between the ``band[0]`` and ``band[1]`` quantiles OF THAT CAPABILITY'S POOL
     (default 10%-70%): the bottom drops degenerate repetitive text, the top drops incoherent
     samples, and per-capability bands keep low-perplexity skills (math, code) from being
     crowded out by a single global threshold tuned to prose.
  3. Low-redundancy selection: greedily add the kept document whose token 4-grams are least
     present in the already selected set (redundancy = sum over its 4-grams of their count in
     the selection / its number of 4-grams; ties broken at random), until the capability's
     equal share of the token budget is filled.
  4. The four shares are shuffled together and packed.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from jaxflow.config_domains import COUNT, POSITIVE, UNIT, domains
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.prune.capabilities import CAPABILITIES, World, document
from jaxflow.prune.selfgen import document_perplexity, generate

SOURCES = ("math", "code", "general", "commonsense", "text", "random", "selfcal", "sgs", "mix",
           "igsp")
#: Sources that need the model (and a PRNG key) to build.
MODEL_SOURCES = ("selfcal", "sgs", "igsp")
IGSP_CUES = {
    "math": [str(d) for d in range(1, 10)],
    "code": ["a=", "x=", "b=", "close "],
    "general": ["the ", "the capital of "],
    "commonsense": ["q: which is "],
}


@domains(rows=COUNT, seq_len=COUNT, doc_tokens=COUNT, selfcal_t_init=POSITIVE, selfcal_t_final=POSITIVE,
         selfcal_schedule_tokens=COUNT, sgs_drop_quantile=UNIT, igsp_pool_factor=COUNT, igsp_band=UNIT)
@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    rows: int = 32  # calibration sequences
    seq_len: int = 128
    doc_tokens: int = 48  # max generated tokens per self-generated document
    selfcal_t_init: float = 2.0
    selfcal_t_final: float = 0.6
    selfcal_schedule_tokens: int = 12
    sgs_drop_quantile: float = 0.8
    igsp_pool_factor: int = 3
    igsp_band: tuple[float, float] = (0.1, 0.7)


def _corpus_docs(rng, world, source, n_tokens):
    docs, total = [], 0
    while total < n_tokens:
        docs.append(document(rng, world, source))
        total += len(docs[-1]) + 2
    return docs


def _pack_token_docs(docs: list[list[int]], cfg: CalibrationConfig) -> dict[str, np.ndarray]:
    """Packs token lists (already BOS/EOS-framed) into full rows: a document that does not fit
    the rest of a row is cut there (like fixed-length windows of a text corpus)."""
    length = cfg.seq_len + 1
    stream = np.zeros((cfg.rows, length), np.int32)
    seg = np.zeros_like(stream)
    pos = np.zeros_like(stream)
    row, col, sid = 0, 0, 1
    for ids in docs:
        if row == cfg.rows:
            break
        ids = ids[:length - col]
        stream[row, col:col + len(ids)] = ids
        seg[row, col:col + len(ids)] = sid
        pos[row, col:col + len(ids)] = np.arange(len(ids))
        col, sid = col + len(ids), sid + 1
        if col >= length - 1:  # a one-token tail would only be a lone BOS
            row, col, sid = row + 1, 0, 1
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return {"tokens": stream[:, :-1], "targets": stream[:, 1:], "loss_mask": same.astype(np.float32),
            "segment_ids": seg[:, :-1], "positions": pos[:, :-1]}


def _encode(docs: list[str], tokenizer: CharTokenizer) -> list[list[int]]:
    return [tokenizer.encode(d, bos=True, eos=True) for d in docs]


def _frame(ids: list[int], eos_id: int) -> list[int]:
    return ids if ids and ids[-1] == eos_id else ids + [eos_id]


def _generated_budget(cfg) -> int:
    return cfg.rows * cfg.seq_len


def _selfcal(fns, params, tok, cfg, key):
    n_docs = _generated_budget(cfg) // 8 + 16
    t = np.arange(cfg.doc_tokens, dtype=np.float32)
    frac = np.minimum(t / max(cfg.selfcal_schedule_tokens, 1), 1.0)
    temps = cfg.selfcal_t_init + (cfg.selfcal_t_final - cfg.selfcal_t_init) * frac
    # From BOS alone; a tokenizer without BOS (Qwen3) starts documents after its EOS token.
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id
    docs = generate(fns, params, [[start]] * n_docs, key=key, max_new=cfg.doc_tokens,
                    temperatures=temps, eos_id=tok.eos_id)
    return [_frame(d, tok.eos_id) for d in docs]


def _sgs(fns, params, tok, cfg, key, rng, world, documents=None):
    n_docs = int(_generated_budget(cfg) / 8 / cfg.sgs_drop_quantile) + 16
    if documents is None:
        prefixes = [document(rng, world, "text")[:2] for _ in range(n_docs)]
    else:  # user corpora: prefixes of their documents, pooled
        pool = [d for docs in documents.values() for d in docs]
        prefixes = [pool[int(i)][:2] for i in rng.integers(len(pool), size=n_docs)]
    prompts = [tok.encode(p, bos=True) for p in prefixes]
    docs = generate(fns, params, prompts, key=key, max_new=cfg.doc_tokens, temperatures=0.6,
                    top_k=50, top_p=0.95, repetition_penalty=1.2, eos_id=tok.eos_id)
    docs = [_frame(d, tok.eos_id) for d in docs]
    ppl = document_perplexity(fns, params, docs, pad_to=cfg.doc_tokens + 4)
    keep = ppl <= np.quantile(ppl, cfg.sgs_drop_quantile)
    return [d for d, k in zip(docs, keep) if k]


def _ngrams(ids: list[int], n: int = 4) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + n]) for i in range(max(len(ids) - n + 1, 0))]


def select_low_redundancy(docs: list[list[int]], budget_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Greedy IGSP step 3: repeatedly take the document whose 4-grams are least present in the
    selection so far, until ``budget_tokens`` are selected."""
    counts: collections.Counter = collections.Counter()
    grams = [_ngrams(d) for d in docs]
    left = list(range(len(docs)))
    chosen, total = [], 0
    while left and total < budget_tokens:
        scores = np.array([sum(counts[g] for g in grams[i]) / max(len(grams[i]), 1) for i in left])
        scores = scores + rng.random(len(left)) * 1e-6
        pick = left.pop(int(np.argmin(scores)))
        chosen.append(docs[pick])
        counts.update(grams[pick])
        total += len(docs[pick])
    return chosen


def _igsp(fns, params, tok, cfg, key, rng):
    share = _generated_budget(cfg) // len(CAPABILITIES) + cfg.seq_len
    out = []
    for cap, k in zip(CAPABILITIES, jax.random.split(key, len(CAPABILITIES))):
        cues = IGSP_CUES[cap]
        n_pool = cfg.igsp_pool_factor * (share // 8 + 4)
        prompts = [tok.encode(cues[int(i)], bos=True) for i in rng.integers(len(cues), size=n_pool)]
        pool = [_frame(d, tok.eos_id) for d in generate(
            fns, params, prompts, key=k, max_new=cfg.doc_tokens, temperatures=1.0, top_p=0.95,
            eos_id=tok.eos_id)]
        ppl = document_perplexity(fns, params, pool, pad_to=cfg.doc_tokens + 20)
        lo, hi = np.quantile(ppl, cfg.igsp_band)
        banded = [d for d, p in zip(pool, ppl) if lo <= p <= hi]
        out.extend(select_low_redundancy(banded, share, rng))
    return out


#: Sources that exist beside user-given calibration files (see ``calibration_set``).
FILE_MODE_SOURCES = ("random", "selfcal", "sgs", "mix")


def valid_sources(documents: dict[str, list[str]] | None = None) -> tuple[str, ...]:
    """The calibration sources available: SOURCES, or with user-given ``documents`` their
    names plus FILE_MODE_SOURCES (IGSP's cues belong to the synthetic taxonomy)."""
    if documents is None:
        return SOURCES
    return (*documents, *(s for s in FILE_MODE_SOURCES if s not in documents))


def _file_docs(rng, docs: list[str], tokenizer, n_tokens: int) -> list[str]:
    """Documents of a user file in a random order (cycling through the file if it is short)
    until about ``n_tokens`` tokens."""
    out, total = [], 0
    while total < n_tokens:
        for i in rng.permutation(len(docs)):
            out.append(docs[i])
            total += len(tokenizer.encode(docs[i])) + 2
            if total >= n_tokens:
                break
    return out


def _source_index(source: str, names: tuple[str, ...]) -> int:
    return SOURCES.index(source) if source in SOURCES else len(SOURCES) + names.index(source)


def calibration_set(source: str, *, world: World | None, tokenizer: CharTokenizer,
                    cfg: CalibrationConfig, draw: int, fns=None, params=None,
                    documents: dict[str, list[str]] | None = None) -> dict[str, np.ndarray]:
    """The packed calibration batch of ``source`` for independent draw ``draw``.

    ``fns``/``params`` (the dense model) are needed for the MODEL_SOURCES. ``documents``
    ({source name: [document]}, e.g. ``jaxflow.prune.task_files.load_calibration_files``)
    replaces the synthetic world's corpora: its names become sources, ``mix`` takes equal
    token shares of them, SGS takes its 2-character prefixes from them, and ``world`` may be
    None.
    """
    names = valid_sources(documents)
    if source not in names:
        raise ValueError(f"calibration source {source!r}; valid: {', '.join(names)}")
    rng = np.random.default_rng([draw, _source_index(source, names), 0xCA1])
    key = jax.random.fold_in(jax.random.key(draw), _source_index(source, names))
    budget = cfg.rows * (cfg.seq_len + 1)
    if documents is not None and source in documents:
        return _pack_token_docs(_encode(_file_docs(rng, documents[source], tokenizer, budget * 2),
                                        tokenizer), cfg)
    if documents is not None and source == "mix":
        share = budget * 2 / len(documents)
        docs = [d for name in documents for d in _file_docs(rng, documents[name], tokenizer, share)]
        docs = [docs[i] for i in rng.permutation(len(docs))]
        return _pack_token_docs(_encode(docs, tokenizer), cfg)
    if source == "random":
        tokens = rng.integers(3, tokenizer.vocab_size, size=(cfg.rows, cfg.seq_len + 1)).astype(np.int32)
        ones = np.ones((cfg.rows, cfg.seq_len), np.int32)
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": ones.astype(np.float32),
                "segment_ids": ones, "positions": np.broadcast_to(np.arange(cfg.seq_len, dtype=np.int32),
                                                                  ones.shape).copy()}
    if source in MODEL_SOURCES and (fns is None or params is None):
        raise ValueError(f"calibration source {source!r} generates text: pass fns and params")
    if source in CAPABILITIES or source == "text":
        return _pack_token_docs(_encode(_corpus_docs(rng, world, source, budget * 2), tokenizer), cfg)
    if source == "mix":
        # Equal token shares in expectation: twice the budget, shuffled, the surplus dropped.
        docs = [d for cap in CAPABILITIES for d in _corpus_docs(rng, world, cap, budget * 0.5)]
        docs = [docs[i] for i in rng.permutation(len(docs))]
        return _pack_token_docs(_encode(docs, tokenizer), cfg)
    if source == "selfcal":
        docs = _selfcal(fns, params, tokenizer, cfg, key)
    elif source == "sgs":
        docs = _sgs(fns, params, tokenizer, cfg, key, rng, world, documents)
    else:
        docs = _igsp(fns, params, tokenizer, cfg, key, rng)
        docs = [docs[i] for i in rng.permutation(len(docs))]
    batch = _pack_token_docs(docs, cfg)
    if batch["segment_ids"][-1].max() == 0:
        raise RuntimeError(f"calibration source {source!r} produced too little text for "
                           f"{cfg.rows} rows of {cfg.seq_len} tokens; raise doc_tokens or pool sizes")
    return batch
