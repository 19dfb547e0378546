"""A tiny Qwen3-shaped Hugging Face checkpoint directory, written without transformers or a
download: for the ``rl`` experiment's quick variant, notebooks and tests.

The directory holds what a real checkpoint holds: ``config.json`` + ``model.safetensors``
(random N(0, 0.02^2) weights through :func:`jaxflow.models.hf_checkpoint.write_random_checkpoint`),
a ``tokenizer.json`` built with the ``tokenizers`` library (character level: a BPE model with the
printable ASCII characters and no merges, a ``Fuse`` decoder, optional whole-phrase tokens such as
a task's fixed instruction), ``tokenizer_config.json`` / ``special_tokens_map.json`` and a
``generation_config.json`` naming the EOS ids. :class:`jaxflow.models.tokenizer_hf.HFTokenizer`
and ``transformers.AutoTokenizer`` read it back with the same ids.

Example::

    cfg = tiny_qwen3_config(vocab_size=128)
    write_tiny_checkpoint("/tmp/tiny", cfg, phrases=("Calculate",))
"""

from __future__ import annotations

import dataclasses
import json
import os
import string
from typing import Any, Sequence

from jaxflow.models.architectures import shipped_config
from jaxflow.models.transformer import TransformerConfig

#: The special tokens of the tiny tokenizer (Qwen3's names); ``<|endoftext|>`` is EOS and pad.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Every printable ASCII character but the form feed / vertical tab, plus newline.
CHARACTERS = tuple(c for c in string.printable if c not in "\x0b\x0c\r\t")


def char_tokenizer(phrases: Sequence[str] = ()):
    """A ``tokenizers.Tokenizer``: the special tokens (ids 0..2), one token per character of
    :data:`CHARACTERS`, then one token per phrase of ``phrases`` (matched whole, before the
    characters). Unknown characters are dropped (as a byte-less BPE does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    phrases = [p for p in dict.fromkeys(phrases) if p]
    if phrases:
        tok.add_tokens([AddedToken(p, normalized=False) for p in phrases])
    return tok


def tiny_qwen3_config(vocab_size: int, *, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                      n_kv_heads: int = 2, d_ff: int = 128, max_seq_len: int = 128) -> TransformerConfig:
    """Qwen3-8B's architecture (``configs/hf/qwen3-8b.json``: qk-norm, GQA, SwiGLU, untied
    embeddings) at a toy size; head_dim = d_model / n_heads."""
    base = shipped_config("qwen3-8b")
    # Qwen3's special ids (151643 / 151645) do not exist here: config.json names the tiny
    # tokenizer's EOS (id 0) instead, and no BOS (Qwen3 prepends none)
    extra = tuple((k, v) for k, v in base.hf_extra if k not in ("bos_token_id", "eos_token_id"))
    return dataclasses.replace(
        base, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, d_ff=d_ff, head_dim_override=d_model // n_heads,
        max_seq_len=max_seq_len, dtype="float32", param_dtype="float32",
        hf_extra=extra + (("eos_token_id", "0"),))


def write_tiny_checkpoint(path: str, config: TransformerConfig | None = None, *,
                          phrases: Sequence[str] = (), seed: int = 0) -> TransformerConfig:
    """Writes a random tiny Qwen3 checkpoint with the character tokenizer into ``path``.

    ``config`` defaults to :func:`tiny_qwen3_config` with the smallest vocabulary that holds the
    tokenizer (rounded up to a multiple of 8). Returns the config written.

    Raises:
      ValueError: ``config.vocab_size`` smaller than the tokenizer's vocabulary.
    """
    from jaxflow.models.hf_checkpoint import write_random_checkpoint
    from jaxflow.models.tokenizer_hf import HFTokenizer

    tok = char_tokenizer(phrases)
    n = tok.get_vocab_size(with_added_tokens=True)
    config = config or tiny_qwen3_config(-(-n // 8) * 8)
    if config.vocab_size < n:
        raise ValueError(f"vocab_size={config.vocab_size} cannot hold the tiny tokenizer's {n} "
                         f"tokens; valid: >= {n}")
    write_random_checkpoint(config, path, seed=seed)
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    HFTokenizer(tok, eos_id=eos, pad_id=eos).save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": [eos], "pad_token_id": eos, "do_sample": True}, f, indent=2)
    return config


def cached_tiny_checkpoint(cache_root: str, tiny: Any) -> str:
    """The directory of the tiny checkpoint ``tiny`` describes (fields of
    :func:`tiny_qwen3_config` plus ``seed`` and ``phrases``, e.g. ``configs.rl.TinyModelConfig``),
    written once under ``cache_root`` (``tiny_qwen3-v1-<hash>``) and reused after."""
    from jaxflow.cache import build_once, cache_entry

    entry = cache_entry(cache_root, "tiny_qwen3-v1", tiny)
    fields = {k: v for k, v in dataclasses.asdict(tiny).items() if k not in ("seed", "phrases")}
    build_once(entry, lambda tmp: write_tiny_checkpoint(
        str(tmp), tiny_qwen3_config(128, **fields), phrases=tiny.phrases, seed=tiny.seed),
        marker="generation_config.json")
    return str(entry)
