"""FIGA-shaped preference data from a model's own samples: (initial, minimally revised) pairs.

FIGA's SPA data pairs a model's initial response with a minimally revised one. Without a
stronger model, a task with a checker provides the revision: an oracle lists the correct
answers and :func:`minimal_revision` picks the one with the fewest token edits (Levenshtein
distance from the ``Levenshtein`` package) from the sample. Only wrong samples that ended
with an end-of-sequence token become pairs (a truncated sample has no complete response).

Rows for training interleave (revised, original, revised, original, ...), as the FIGA
reference code's collator does (:func:`interleave_rows`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import Levenshtein
import numpy as np

from jaxflow.align.marking import MarkedPairs, figa_mark_batch
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.rl.tasks import completion_text


def addition_answers(prompt: str) -> list[str]:
    """The oracle of the addition task: ``"a+b="`` -> ``[str(a + b)]`` (its only right answer)."""
    try:
        a, b = prompt.rstrip("=").split("+")
        return [str(int(a) + int(b))]
    except ValueError:
        raise ValueError(f"not an addition prompt 'a+b=': {prompt!r}") from None


def minimal_revision(original: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[int]:
    """The candidate with the fewest token edits from ``original`` (first on ties)."""
    if not candidates:
        raise ValueError("candidates is empty: the oracle gave no correct answer")
    orig = [int(t) for t in original]
    dists = [Levenshtein.distance(orig, [int(t) for t in c]) for c in candidates]
    return [int(t) for t in candidates[int(np.argmin(dists))]]


class PairData(NamedTuple):
    """P pairs: prompt tokens [P, Lp] (``[BOS] prompt``, padded), prompt_lengths [P], the
    prompt texts, and the marked responses (:class:`jaxflow.align.marking.MarkedPairs`)."""

    prompts: np.ndarray
    prompt_lengths: np.ndarray
    prompt_texts: list[str]
    pairs: MarkedPairs


def build_pairs(prompt_texts: Sequence[str], prompts: np.ndarray, prompt_lengths: np.ndarray,
                tokens: np.ndarray, rewards: np.ndarray, tokenizer: CharTokenizer,
                oracle: Callable[[str], Sequence[str]], *, length: int) -> PairData | None:
    """Pairs from sampled rows: every wrong (reward < 1) row that emitted EOS becomes
    (original = its tokens through EOS, revised = the oracle's minimal revision + EOS).

    Args:
      prompt_texts: [B] prompt strings; prompts [B, Lp] / prompt_lengths [B] their tokens.
      tokens: [B, N] sampled response tokens (padding after EOS); rewards [B].
      tokenizer: encodes the oracle's answers.
      oracle: prompt -> its correct completions (text, EOS excluded).
      length: response width of the returned arrays (>= every pair's longest response).

    Returns:
      :class:`PairData`, or None when no row qualifies.
    """
    n = len(prompt_texts)
    for name, x in (("prompts", prompts), ("prompt_lengths", prompt_lengths), ("tokens", tokens),
                    ("rewards", rewards)):
        if np.shape(x)[:1] != (n,):
            raise ValueError(f"{name} shape {np.shape(x)} must have {n} rows (one per prompt "
                             "text)")
    keep, originals, revisions = [], [], []
    for i in range(n):
        if rewards[i] >= 1.0 or completion_text(tokenizer, tokens[i]) is None:
            continue
        row = [int(t) for t in tokens[i]]
        original = row[: row.index(tokenizer.eos_id) + 1]
        candidates = [tokenizer.encode(a, eos=True) for a in oracle(prompt_texts[i])]
        keep.append(i)
        originals.append(original)
        revisions.append(minimal_revision(original, candidates))
    if not keep:
        return None
    marked = figa_mark_batch(originals, revisions, length, eos_id=tokenizer.eos_id,
                             vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    idx = np.asarray(keep)
    return PairData(np.asarray(prompts)[idx], np.asarray(prompt_lengths)[idx],
                    [prompt_texts[i] for i in keep], marked)


def concat_pairs(parts: Sequence[PairData]) -> PairData:
    """One :class:`PairData` from several (same widths)."""
    return PairData(
        np.concatenate([p.prompts for p in parts]),
        np.concatenate([p.prompt_lengths for p in parts]),
        [t for p in parts for t in p.prompt_texts],
        MarkedPairs(*(np.concatenate([getattr(p.pairs, f) for p in parts])
                      for f in MarkedPairs._fields)))


class Rows(NamedTuple):
    """Interleaved training rows [2P, ...]: even rows revised, odd rows original."""

    prompts: np.ndarray
    prompt_lengths: np.ndarray
    tokens: np.ndarray
    marks: np.ndarray
    mask: np.ndarray
    revised: np.ndarray  # [2P] bool


def interleave_rows(data: PairData, index: np.ndarray | None = None) -> Rows:
    """Rows (revised_i, original_i) for the pairs ``index`` (default: all), in that order."""
    idx = np.arange(len(data.prompt_texts)) if index is None else np.asarray(index)
    p = data.pairs

    def zip_rows(rev, orig):
        out = np.empty((2 * idx.size, *rev.shape[1:]), rev.dtype)
        out[0::2], out[1::2] = rev[idx], orig[idx]
        return out

    return Rows(zip_rows(data.prompts, data.prompts),
                zip_rows(data.prompt_lengths, data.prompt_lengths),
                zip_rows(p.revised_tokens, p.original_tokens),
                zip_rows(p.revised_marks, p.original_marks),
                zip_rows(p.revised_mask, p.original_mask),
                np.tile(np.array([True, False]), idx.size))
