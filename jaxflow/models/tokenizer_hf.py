"""A checkpoint's own tokenizer (``tokenizer.json``) with the character tokenizer's interface.

:class:`HFTokenizer` wraps the ``tokenizers`` package (the fast tokenizer of Hugging Face
checkpoints) and exposes what jaxflow's RL tasks, samplers and pruning study use from
:class:`jaxflow.data.tokenizer.CharTokenizer`: ``encode(text, bos=, eos=)``,
``decode(ids, stop_at_eos=)``, ``pad_batch``, ``vocab_size``, ``pad_id``, ``bos_id``,
``eos_id``. Special tokens come from ``tokenizer_config.json`` (token strings) or
``config.json`` (ids). A checkpoint without a BOS token (Qwen3) prepends nothing for
``bos=True``; one without a PAD token pads with EOS.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np

from jaxflow.data.tokenizer import pad_token_lists
from jaxflow.models.architectures import CheckpointError


def _token_string(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """``tokenizers.Tokenizer`` + special-token ids. Build with :meth:`from_pretrained`."""

    def __init__(self, tokenizer, *, eos_id: int, bos_id: int | None = None,
                 pad_id: int | None = None):
        self.tokenizer = tokenizer
        self.eos_id, self.bos_id = int(eos_id), None if bos_id is None else int(bos_id)
        self.pad_id = self.eos_id if pad_id is None else int(pad_id)

    @classmethod
    def from_pretrained(cls, path: str) -> "HFTokenizer":
        """Reads ``path/tokenizer.json`` (+ tokenizer_config.json / config.json for specials).

        Raises CheckpointError naming the missing file or special token."""
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} does not exist (the checkpoint's fast tokenizer)")
        tok = Tokenizer.from_file(file)
        ids: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
        for name in ("config.json", "generation_config.json"):
            cfg_file = os.path.join(path, name)
            if os.path.isfile(cfg_file):
                cfg = json.load(open(cfg_file))
                for key in ids:
                    value = cfg.get(f"{key}_token_id")
                    if isinstance(value, list):
                        value = value[0] if value else None
                    if ids[key] is None and isinstance(value, int):
                        ids[key] = value
        tok_cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tok_cfg):
            cfg = json.load(open(tok_cfg))
            for key in ids:
                text = _token_string(cfg.get(f"{key}_token"))
                if text is None:
                    continue
                token_id = tok.token_to_id(text)
                if token_id is None:
                    raise CheckpointError(f"{tok_cfg} names {key}_token {text!r}, which is not "
                                          f"in {file}")
                ids[key] = token_id  # the tokenizer's own config wins
        if ids["eos"] is None:
            raise CheckpointError(f"no EOS token: neither {tok_cfg} (eos_token) nor config.json "
                                  "(eos_token_id) names one")
        return cls(tok, eos_id=ids["eos"], bos_id=ids["bos"], pad_id=ids["pad"])

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit (added tokens included); a model's vocab may be larger."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (no template, no automatic specials)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + list(ids) + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; special tokens dropped, decoding stops at the first EOS."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            out.append(i)
        return self.tokenizer.decode(out, skip_special_tokens=True)

    def pad_batch(self, seqs: Sequence[Sequence[int]],
                  length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads token lists with ``pad_id``: (tokens [B, L] int32, lengths [B] int32)."""
        return pad_token_lists(seqs, self.pad_id, length)
