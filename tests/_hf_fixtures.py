"""Tiny Hugging Face-format checkpoints written by tests: a byte-level BPE tokenizer.json
trained on arithmetic strings (the Llama-3 / Qwen tokenizer family), plus a random Qwen3."""
import json
import os

import numpy as np

from jaxflow.models import TransformerConfig
from jaxflow.models.hf_checkpoint import write_random_checkpoint

EOS = "<|endoftext|>"


def write_tokenizer(path: str, *, vocab_size: int = 300) -> None:
    """tokenizer.json (byte-level BPE, EOS "<|endoftext|>", no BOS, as Qwen3) +
    tokenizer_config.json into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    corpus = [f"{a}+{b}={a + b}" for a, b in rng.integers(0, 100, size=(2000, 2))]
    corpus += [f"{a},{b},{c}:{a * b - c}=" for a, b, c in rng.integers(1, 20, size=(500, 3))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "pad_token": EOS, "bos_token": None}, f)


def tiny_qwen3(vocab_size: int = 320) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, d_model=32, n_layers=1, n_heads=2,
                             n_kv_heads=1, d_ff=64, max_seq_len=32, head_dim_override=16,
                             qk_norm=True, rope_theta=1e6, tie_embeddings=True,
                             architecture="qwen3")


def write_tiny_qwen3(path: str, *, seed: int = 0) -> None:
    """A random tiny Qwen3 checkpoint with its tokenizer in ``path``."""
    write_random_checkpoint(tiny_qwen3(), path, seed=seed, std=0.2)
    write_tokenizer(path)
