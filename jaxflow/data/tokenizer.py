"""A character tokenizer with reserved PAD/BOS/EOS ids."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = 3

#: Characters of the built-in verifiable tasks (addition, countdown-style arithmetic).
ARITHMETIC_ALPHABET = "0123456789+-*/()=,: "


def pad_token_lists(seqs: Sequence[Sequence[int]], pad_id: int,
                    length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists with ``pad_id``: (tokens [B, L] int32, lengths [B] int32), L the
    longest list unless ``length`` is given (a longer list is a ValueError). Every tokenizer's
    ``pad_batch``."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    length = int(lengths.max(initial=0)) if length is None else length
    if lengths.size and lengths.max() > length:
        raise ValueError(f"a sequence of length {lengths.max()} does not fit length {length}")
    out = np.full((len(seqs), length), pad_id, dtype=np.int32)
    for row, s in enumerate(seqs):
        out[row, : len(s)] = s
    return out, lengths


class CharTokenizer:
    """Maps each character of ``alphabet`` to an id; 0/1/2 are PAD/BOS/EOS.

    >>> tok = CharTokenizer(); tok.decode(tok.encode("12+3="))
    '12+3='
    """

    def __init__(self, alphabet: str = ARITHMETIC_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {c: i + _SPECIALS for i, c in enumerate(alphabet)}
        self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID

    @property
    def vocab_size(self) -> int:
        """Token ids in use: the alphabet's characters plus the special tokens."""
        return len(self.alphabet) + _SPECIALS

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``; an unknown character raises ValueError naming it."""
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}"
            ) from None
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; specials are dropped, decoding stops at the first EOS."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i >= _SPECIALS:
                out.append(self.alphabet[i - _SPECIALS])
        return "".join(out)

    def pad_batch(self, seqs: Sequence[Sequence[int]], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads token lists: returns (tokens [B, L] int32, lengths [B] int32)."""
        return pad_token_lists(seqs, self.pad_id, length)
