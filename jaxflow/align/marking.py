"""FIGA token marking: which tokens of an (original, revised) response pair carry the signal.

FIGA ("Beyond Imitation: Leveraging Fine-grained Quality Signals for Alignment", ICLR 2024)
contrasts an initial response with a minimally revised one. The Levenshtein edit script from
the original's token ids to the revision's marks (``marks`` are int32, ready for batching):

  revision  +1 at the destination positions of ``replace`` and ``insert``, and at the
            revision's first end-of-sequence token (when ``eos_id`` is given); 0 elsewhere.
  original  -1 at the source positions of ``replace`` and ``delete``; 0 elsewhere.

The edit script comes from the ``Levenshtein`` package (PyPI ``Levenshtein``, checked with
0.27.5, C++ from rapidfuzz), the same library the FIGA reference code calls, on plain lists of
ints. Where several minimal scripts exist (e.g. ``[5, 5] -> [5]`` may delete either 5) the
library's own order decides; the tests use pairs whose minimal script is unique. Prompt tokens
are never passed here: only responses (in the reference code the prompt is a common prefix of
both sequences, which the library strips before aligning).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import Levenshtein
import numpy as np


def _as_ids(name: str, ids, vocab_size: int | None) -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape}); a response needs >= 1 token "
                         "(an empty answer is just its end-of-sequence token)")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if vocab_size is not None:
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        if bad.size:
            raise ValueError(f"{name} (shape {arr.shape}) has ids {sorted(set(bad.tolist()))} "
                             f"outside the vocabulary [0, {vocab_size})")
    return [int(x) for x in arr]


def figa_marks(original: Sequence[int], revised: Sequence[int], *, eos_id: int | None = None,
               vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Marks of one pair: (original_marks [len(original)] in {-1, 0}, revised_marks
    [len(revised)] in {0, 1}), int32.

    Args:
      original, revised: 1-D token ids of the two responses (no prompt), each >= 1 token.
      eos_id: when given, the revision's first occurrence of it is marked +1 (the reference
        code's rule: the model must learn to stop after the fix).
      vocab_size: when given, ids outside [0, vocab_size) are an error.

    Raises:
      ValueError: an empty or non-1-D response, non-integer ids, ids outside the vocabulary.
    """
    orig = _as_ids("original", original, vocab_size)
    rev = _as_ids("revised", revised, vocab_size)
    orig_marks = np.zeros(len(orig), np.int32)
    rev_marks = np.zeros(len(rev), np.int32)
    for op, src, dst in Levenshtein.editops(orig, rev):
        if op in ("replace", "insert"):
            rev_marks[dst] = 1
        if op in ("replace", "delete"):
            orig_marks[src] = -1
    if eos_id is not None and eos_id in rev:
        rev_marks[rev.index(eos_id)] = 1
    return orig_marks, rev_marks


class MarkedPairs(NamedTuple):
    """P pairs right-padded to a common length L (all int32 [P, L]; mask is 1 on real tokens).

    ``original_*`` is the initial response, ``revised_*`` its revision; marks as
    :func:`figa_marks` (0 on padding)."""

    original_tokens: np.ndarray
    original_marks: np.ndarray
    original_mask: np.ndarray
    revised_tokens: np.ndarray
    revised_marks: np.ndarray
    revised_mask: np.ndarray


def figa_mark_batch(originals: Sequence[Sequence[int]], revisions: Sequence[Sequence[int]],
                    length: int | None = None, *, eos_id: int | None = None,
                    vocab_size: int | None = None, pad_id: int = 0) -> MarkedPairs:
    """:func:`figa_marks` of every pair, padded to ``length`` (default: the longest response).

    Raises:
      ValueError: different numbers of originals and revisions, a response longer than
        ``length``, or any :func:`figa_marks` error (the message names the pair index).
    """
    if len(originals) != len(revisions):
        raise ValueError(f"originals ({len(originals)} responses) and revisions "
                         f"({len(revisions)}) must pair up one to one")
    if len(originals) == 0:
        raise ValueError("no pairs given (originals and revisions are empty)")
    longest = max(max(len(o), len(r)) for o, r in zip(originals, revisions))
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"a response of {longest} tokens does not fit length={length}")
    n = len(originals)
    out = {k: np.zeros((n, length), np.int32) for k in MarkedPairs._fields}
    out["original_tokens"][:] = pad_id
    out["revised_tokens"][:] = pad_id
    for i, (orig, rev) in enumerate(zip(originals, revisions)):
        try:
            om, rm = figa_marks(orig, rev, eos_id=eos_id, vocab_size=vocab_size)
        except ValueError as e:
            raise ValueError(f"pair {i}: {e}") from None
        for side, ids, marks in (("original", orig, om), ("revised", rev, rm)):
            out[f"{side}_tokens"][i, : len(ids)] = ids
            out[f"{side}_marks"][i, : len(ids)] = marks
            out[f"{side}_mask"][i, : len(ids)] = 1
    return MarkedPairs(**out)
