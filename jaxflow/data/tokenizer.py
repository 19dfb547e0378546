"""The tokenizer boundary (:class:`Tokenizer`, :func:`check_tokenizer`) and a character tokenizer
with reserved PAD/BOS/EOS ids.

Every consumer of tokens (the GRPO trainer, its rollout worker, the samplers) takes any object
satisfying :class:`Tokenizer`: :class:`CharTokenizer`, :class:`jaxflow.models.tokenizer_hf.HFTokenizer`,
or a transformers tokenizer through :class:`jaxflow.models.tokenizer_hf.TransformersTokenizer`.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from jaxflow.errors import UserError

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


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer (text in, ids out; all stop ids known).

    Attributes:
      eos_ids: every id that ends a response (>= 1 of them; Qwen3-instruct stops on two);
        samplers stop a row at any of them.
      eos_id: ``eos_ids[0]``.
      bos_id: the id put before a prompt, or None when the model uses none.
      pad_id: the id after a row's end (never scored).
      vocab_size: ids the tokenizer can emit.
    """

    eos_ids: tuple[int, ...]
    eos_id: int
    bos_id: int | None
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no specials added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        ...


class TokenizerError(UserError, TypeError):
    """An object given as a tokenizer lacks what :class:`Tokenizer` needs; the message names
    the missing or bad attribute."""


_TOKENIZER_ATTRS = ("encode", "decode", "eos_ids", "eos_id", "bos_id", "pad_id", "vocab_size")


def check_tokenizer(tok: Any) -> Any:
    """``tok`` itself when it satisfies :class:`Tokenizer`; else :class:`TokenizerError`, one
    line naming the missing attribute or the bad value (e.g. empty ``eos_ids``, ``eos_id`` not
    ``eos_ids[0]``)."""
    name = type(tok).__name__
    missing = [a for a in _TOKENIZER_ATTRS if not hasattr(tok, a)]
    if missing:
        hint = (" (wrap a transformers tokenizer in jaxflow.models.tokenizer_hf."
                "TransformersTokenizer)" if hasattr(tok, "convert_ids_to_tokens") else "")
        raise TokenizerError(f"tokenizer {name} has no {', '.join(missing)}; valid: an object with "
                             f"encode, decode, eos_ids (all stop ids), eos_id, bos_id, pad_id and "
                             f"vocab_size (jaxflow.data.tokenizer.Tokenizer){hint}")
    for attr in ("encode", "decode"):
        if not callable(getattr(tok, attr)):
            raise TokenizerError(f"tokenizer {name}.{attr} is not callable; valid: a method")
    try:
        ids = tuple(int(i) for i in tok.eos_ids)
    except TypeError:
        ids = ()
    if not ids or any(i < 0 for i in ids):
        raise TokenizerError(f"tokenizer {name}.eos_ids={tok.eos_ids!r}; valid: a non-empty "
                             "sequence of ids >= 0 (every id that ends a response)")
    if tok.eos_id != ids[0]:
        raise TokenizerError(f"tokenizer {name}.eos_id={tok.eos_id!r} is not eos_ids[0]="
                             f"{ids[0]}; valid: eos_id == eos_ids[0]")
    return tok


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
        self.eos_ids: tuple[int, ...] = (EOS_ID,)

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
