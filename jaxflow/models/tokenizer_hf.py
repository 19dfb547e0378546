"""A checkpoint's own tokenizer (``tokenizer.json``) with the character tokenizer's interface.

:class:`HFTokenizer` wraps the ``tokenizers`` package (the fast tokenizer of Hugging Face
checkpoints) and exposes what jaxflow's RL tasks, samplers and pruning study use from
:class:`jaxflow.data.tokenizer.CharTokenizer`: ``encode(text, bos=, eos=)``,
``decode(ids, stop_at_eos=)``, ``pad_batch``, ``vocab_size``, ``pad_id``, ``bos_id``,
``eos_id``, ``eos_ids`` (every stop id). Special tokens come from ``tokenizer_config.json``
(token strings) or ``config.json`` / ``generation_config.json`` (ids).
A checkpoint without a BOS token (Qwen3) prepends nothing for ``bos=True``; one without a PAD
token pads with EOS. :class:`TransformersTokenizer` gives a ``transformers`` tokenizer the same
interface.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import numpy as np

from jaxflow.data.tokenizer import TokenizerError, pad_token_lists
from jaxflow.errors import one_line
from jaxflow.models.architectures import CheckpointError, json_type, read_json_object

_SPECIALS = ("bos", "eos", "pad")
#: tokenizer.json model types -> the JSON container of their "vocab".
_MODEL_VOCAB = {"BPE": dict, "WordPiece": dict, "WordLevel": dict, "Unigram": list}


def _token_string(value: Any, file: str, key: str) -> str | None:
    """A tokenizer_config.json special token: a string, ``{"content": string, ...}`` (older
    configs) or null; CheckpointError naming the file and key otherwise."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is None or isinstance(text, str):
        return text
    raise CheckpointError(f"{file} {key}={value!r}; valid: a token string, "
                          '{"content": token string} or null')


def _token_ids(value: Any, file: str, key: str) -> list[int]:
    """A config.json / generation_config.json special token id: an int >= 0, a list of them
    (Qwen3-instruct stops on two EOS ids), or null -> the ids; CheckpointError naming the file
    and key otherwise."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        return list(items)
    raise CheckpointError(f"{file} {key}={value!r}; valid: a token id >= 0, a list of them, "
                          "or null")


def _stop_ids(eos_id: int, eos_ids: Iterable[int] | None) -> tuple[int, ...]:
    """``eos_id`` first, then the other ids of ``eos_ids`` in order, each once."""
    out = [int(eos_id)]
    for i in eos_ids or ():
        if int(i) not in out:
            out.append(int(i))
    return tuple(out)


def _decode_ids(ids: Iterable[int], stop: tuple[int, ...], stop_at_eos: bool) -> list[int]:
    """``ids`` as ints, cut at the first id of ``stop`` when ``stop_at_eos``."""
    out = []
    for i in ids:
        i = int(i)
        if stop_at_eos and i in stop:
            break
        out.append(i)
    return out


def _load_tokenizer(file: str):
    """``tokenizers.Tokenizer`` of tokenizer.json ``file``; CheckpointError naming the file
    (and the field) when it is not UTF-8, not JSON, or not a tokenizer."""
    from tokenizers import Tokenizer

    data = read_json_object(file, what="tokenizer")
    model = data.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"tokenizer {file!r} has no 'model' object (the vocabulary); "
                              'valid: a tokenizers tokenizer.json ({"model": {"type": "BPE", '
                              "...}, ...})")
    kind = model.get("type")
    if kind is not None and (not isinstance(kind, str) or kind not in _MODEL_VOCAB):
        raise CheckpointError(f"tokenizer {file!r} model.type={kind!r}; valid: "
                              f"{', '.join(_MODEL_VOCAB)}")
    for field, value, want in (("model.vocab", model.get("vocab"), _MODEL_VOCAB.get(kind)),
                               ("added_tokens", data.get("added_tokens"), list)):
        if value is not None and want is not None and not isinstance(value, want):
            raise CheckpointError(f"tokenizer {file!r} {field} is a JSON {json_type(value)}; "
                                  f"valid: a JSON {'object' if want is dict else 'array'}")
    with open(file, encoding="utf-8-sig") as f:  # read again: known to be UTF-8 JSON now
        text = f.read()
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception naming the field and line
        raise CheckpointError(f"tokenizer {file!r} is not a valid tokenizers tokenizer.json: "
                              f"{one_line(e)}") from None


class HFTokenizer:
    """``tokenizers.Tokenizer`` + special-token ids. Build with :meth:`from_pretrained`.

    ``eos_ids``: every id that ends a completion (``eos_id`` first; a sampler stops a row at
    any of them); ``eos_id``: the one appended by ``encode(eos=True)``."""

    def __init__(self, tokenizer, *, eos_id: int, bos_id: int | None = None,
                 pad_id: int | None = None, eos_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.eos_id, self.bos_id = int(eos_id), None if bos_id is None else int(bos_id)
        self.eos_ids = _stop_ids(self.eos_id, eos_ids)
        self.pad_id = self.eos_id if pad_id is None else int(pad_id)

    @classmethod
    def from_pretrained(cls, path: str) -> "HFTokenizer":
        """Reads ``path/tokenizer.json`` (+ tokenizer_config.json / config.json /
        generation_config.json for specials). ``eos_ids``: tokenizer_config.json's
        ``eos_token`` first, then every ``eos_token_id`` of config.json and
        generation_config.json (an int or a list).

        Raises CheckpointError naming the file and the field: a file missing, not UTF-8, not
        JSON or of the wrong structure, a special token of the wrong type or not in the
        vocabulary."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} does not exist (the checkpoint's fast tokenizer)")
        tok = _load_tokenizer(file)
        ids: dict[str, int | None] = {key: None for key in _SPECIALS}
        stops: list[int] = []
        for name, what in (("config.json", "checkpoint config"),
                           ("generation_config.json", "generation config")):
            cfg_file = os.path.join(path, name)
            if os.path.isfile(cfg_file):
                cfg = read_json_object(cfg_file, what=what)
                for key in ids:
                    values = _token_ids(cfg.get(f"{key}_token_id"), cfg_file, f"{key}_token_id")
                    if ids[key] is None and values:
                        ids[key] = values[0]
                    if key == "eos":
                        stops += values
        tok_cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tok_cfg):
            cfg = read_json_object(tok_cfg, what="tokenizer config")
            for key in ids:
                text = _token_string(cfg.get(f"{key}_token"), tok_cfg, f"{key}_token")
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
        return cls(tok, eos_id=ids["eos"], bos_id=ids["bos"], pad_id=ids["pad"], eos_ids=stops)

    def save_pretrained(self, path: str) -> list[str]:
        """Writes the files Hugging Face's fast tokenizers write into ``path``:
        ``tokenizer.json`` (the ``tokenizers`` model, as is), ``tokenizer_config.json``
        (``tokenizer_class`` PreTrainedTokenizerFast and the bos / eos / pad token strings,
        null where there is none) and ``special_tokens_map.json``; with several ``eos_ids``
        also ``generation_config.json``'s ``eos_token_id`` list (other keys of one already
        there are kept). :meth:`from_pretrained` and ``transformers.AutoTokenizer`` read them
        back with the same ids.

        Returns:
          The paths written.

        Raises:
          ValueError: a special id the tokenizer does not know (no token string to write).
        """
        specials: dict[str, str | None] = {}
        for key in _SPECIALS:
            token_id = getattr(self, f"{key}_id")
            text = None if token_id is None else self.tokenizer.id_to_token(token_id)
            if token_id is not None and text is None:
                raise ValueError(f"{key}_id={token_id} is not a token of this tokenizer "
                                 f"(vocab size {self.vocab_size}); valid: an id it can decode")
            specials[f"{key}_token"] = text
        os.makedirs(path, exist_ok=True)
        files = [os.path.join(path, name) for name in
                 ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]
        self.tokenizer.save(files[0])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
        present = {k: v for k, v in specials.items() if v is not None}
        for file, data in zip(files[1:], (config, present)):
            with open(file, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, ensure_ascii=False)
        if len(self.eos_ids) > 1:
            files.append(write_generation_eos(path, self.eos_ids))
        return files

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
        """Text of ``ids``; special tokens dropped, decoding stops at the first id of
        ``eos_ids``."""
        return self.tokenizer.decode(_decode_ids(ids, self.eos_ids, stop_at_eos),
                                     skip_special_tokens=True)

    def pad_batch(self, seqs: Sequence[Sequence[int]],
                  length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads token lists with ``pad_id``: (tokens [B, L] int32, lengths [B] int32)."""
        return pad_token_lists(seqs, self.pad_id, length)


def write_generation_eos(path: str, eos_ids: Sequence[int]) -> str:
    """Sets ``eos_token_id`` of ``path/generation_config.json`` (created when absent, its other
    keys kept): an int for one id, the list for several (what ``transformers.GenerationConfig``
    and :meth:`HFTokenizer.from_pretrained` read). Returns the file."""
    file = os.path.join(path, "generation_config.json")
    data = read_json_object(file, what="generation config") if os.path.isfile(file) else {}
    ids = [int(i) for i in eos_ids]
    data["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    os.makedirs(path, exist_ok=True)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    return file


def _generation_eos(generation_config: Any) -> list[int]:
    """The ``eos_token_id`` ids of a ``transformers.GenerationConfig``, a dict, or a path (a
    directory holding generation_config.json, or the file)."""
    if generation_config is None:
        return []
    if isinstance(generation_config, (str, os.PathLike)):
        file = os.fspath(generation_config)
        if os.path.isdir(file):
            file = os.path.join(file, "generation_config.json")
        value = read_json_object(file, what="generation config").get("eos_token_id")
        return _token_ids(value, file, "eos_token_id")
    value = (generation_config.get("eos_token_id") if isinstance(generation_config, dict)
             else getattr(generation_config, "eos_token_id", None))
    return _token_ids(value, "generation_config", "eos_token_id")


class TransformersTokenizer:
    """A ``transformers`` tokenizer (any ``PreTrainedTokenizerBase``, e.g.
    ``AutoTokenizer.from_pretrained(dir)``) with :class:`HFTokenizer`'s interface: what jaxflow's
    trainers, samplers and tasks call.

    ``encode`` adds no special tokens (a BOS only for ``bos=True``, as :class:`HFTokenizer`);
    ``decode`` skips special tokens, stops at the first id of ``eos_ids`` and does not clean
    up spaces (the ``tokenizers`` decode :class:`HFTokenizer` gives). ``eos_ids``: the
    tokenizer's ``eos_token_id`` first, then ``generation_config``'s (a
    ``transformers.GenerationConfig``, a dict, or a checkpoint directory / generation_config.json
    path); ``pad_id``: the tokenizer's pad token, else the EOS.

    Raises:
      TokenizerError: ``tok`` lacks ``encode`` / ``decode`` / ``eos_token_id`` (not a
        transformers tokenizer), or neither it nor ``generation_config`` names an EOS token.
    """

    def __init__(self, tok: Any, *, generation_config: Any = None):
        lacks = [a for a in ("encode", "decode", "eos_token_id", "__len__") if not hasattr(tok, a)]
        if lacks:
            raise TokenizerError(f"tokenizer {type(tok).__name__} lacks {', '.join(lacks)}; valid: "
                                 "a transformers tokenizer (PreTrainedTokenizerBase, e.g. "
                                 "AutoTokenizer.from_pretrained(dir))")
        own = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
        stops = own + _generation_eos(generation_config)
        if not stops:
            raise TokenizerError(f"tokenizer {type(tok).__name__} has no EOS token (eos_token_id is "
                                 "None) and generation_config names none; valid: a tokenizer with "
                                 "an eos_token, or generation_config with eos_token_id")
        self.tokenizer = tok
        self.eos_id = stops[0]
        self.eos_ids = _stop_ids(self.eos_id, stops)
        self.bos_id = None if tok.bos_token_id is None else int(tok.bos_token_id)
        pad = getattr(tok, "pad_token_id", None)
        self.pad_id = self.eos_id if pad is None else int(pad)

    @classmethod
    def from_pretrained(cls, path: str) -> "TransformersTokenizer":
        """``AutoTokenizer.from_pretrained(path)`` (local files only) with ``path``'s
        generation_config.json EOS ids when there is one."""
        from transformers import AutoTokenizer

        gen = os.path.join(path, "generation_config.json")
        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True),
                   generation_config=gen if os.path.isfile(gen) else None)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit (``len(tok)``: added tokens included)."""
        return len(self.tokenizer)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (no template, no automatic specials)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + [int(i) for i in ids] + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; special tokens dropped, decoding stops at the first id of
        ``eos_ids``."""
        return self.tokenizer.decode(_decode_ids(ids, self.eos_ids, stop_at_eos),
                                     skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def pad_batch(self, seqs: Sequence[Sequence[int]],
                  length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads token lists with ``pad_id``: (tokens [B, L] int32, lengths [B] int32)."""
        return pad_token_lists(seqs, self.pad_id, length)

    def save_pretrained(self, path: str) -> list[str]:
        """The tokenizer's own ``save_pretrained(path)`` files, plus ``generation_config.json``'s
        ``eos_token_id`` list with several ``eos_ids``."""
        files = [str(f) for f in self.tokenizer.save_pretrained(path)]
        if len(self.eos_ids) > 1:
            files.append(write_generation_eos(path, self.eos_ids))
        return files


def check_tokenizer_fits(tokenizer: Any, vocab_size: int) -> None:
    """None, or an :class:`HFTokenizer` / :class:`TransformersTokenizer` whose ids all fit a
    model of ``vocab_size``; a ValueError naming what is wrong otherwise (checked before a
    checkpoint is written)."""
    if tokenizer is None:
        return
    if not isinstance(tokenizer, (HFTokenizer, TransformersTokenizer)):
        raise ValueError(f"tokenizer={type(tokenizer).__name__}; valid: None, an HFTokenizer "
                         "(HFTokenizer.from_pretrained(dir), or HFTokenizer(tokenizers.Tokenizer, "
                         "eos_id=...)) or a TransformersTokenizer: the character tokenizer has no "
                         "tokenizer.json form")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {vocab_size}; valid: a tokenizer of at most vocab_size "
                         "tokens (the loader refuses a larger one)")
