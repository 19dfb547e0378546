"""Editing: rewrites as per-token edit operations, the edit head's bidirectional trunk built from
the project's transformer blocks, and edit similarity.

DecorateLM (Zhao et al., EMNLP 2024) edits texts into a cleaner, more formal register without
adding information. Here a rewrite is a sequence-to-sequence map realised as one operation per
source token (KEEP, DELETE, LOWER), the tagging formulation of text editing (LaserTagger, Malmi
et al., 2019): the output sequence is ``apply_ops(source, ops)``. It covers the removals and
case fixes the built-in teacher makes, predicts all positions in one parallel pass (so
decoration is one jitted forward per batch, no autoregressive loop), and can never add
information. An external annotator's free-form edits are mapped to operations by alignment
(``ops_from_edit``); what operations cannot express is counted, not hidden.

``BidirectionalTrunk`` stacks ``jaxflow.models.transformer.Block`` layers (RMSNorm, RoPE GQA
attention, SwiGLU) with a padding-only (non-causal) mask, so every position sees the whole
text.
"""

from __future__ import annotations

import difflib

import jax
import jax.numpy as jnp
import Levenshtein
import numpy as np
from flax import nnx

from jaxflow.models.transformer import Block, RMSNorm, TransformerConfig

KEEP, DELETE, LOWER = 0, 1, 2
N_OPS = 3
OP_NAMES = ("keep", "delete", "lower")


def apply_ops(text: str, ops) -> str:
    """The edited text: characters with KEEP, lower-cased with LOWER, dropped with DELETE.

    ``ops`` may be longer than ``text`` (padding is ignored) but not shorter."""
    ops = np.asarray(ops)
    if ops.shape[0] < len(text):
        raise ValueError(f"{ops.shape[0]} edit ops for a text of {len(text)} characters")
    bad = np.flatnonzero((ops[: len(text)] < 0) | (ops[: len(text)] >= N_OPS))
    if bad.size:
        raise ValueError(f"edit op {int(ops[bad[0]])} at position {int(bad[0])}; valid 0..{N_OPS - 1}")
    return "".join(c.lower() if o == LOWER else c for c, o in zip(text, ops.tolist()) if o != DELETE)


def ops_from_edit(source: str, target: str) -> tuple[np.ndarray, int]:
    """Edit operations on ``source`` that come closest to ``target``.

    Aligns the lower-cased texts (difflib): characters in equal spans are KEEP, or LOWER where
    the source character is upper case and the target's is its lower case; deleted spans are
    DELETE; replaced spans stay KEEP. Replaced and inserted target characters cannot be expressed by the operations.

    Returns:
      (ops [len(source)] int8, unrepresentable target characters).
    """
    ops = np.zeros(len(source), np.int8)
    missing = 0
    sm = difflib.SequenceMatcher(None, source.lower(), target.lower(), autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                if source[i] != target[j]:
                    if source[i].lower() == target[j]:
                        ops[i] = LOWER
                    else:
                        missing += 1
        elif tag == "delete":
            ops[i1:i2] = DELETE
        elif tag == "replace":  # kept as is
            missing += j2 - j1
        else:  # insert
            missing += j2 - j1
    return ops, missing


def levenshtein(a: str, b: str) -> int:
    """Character edit distance (insert, delete, substitute, cost 1): ``Levenshtein.distance``."""
    return int(Levenshtein.distance(a, b))


def edit_similarity(a: str, b: str) -> float:
    """1 - levenshtein(a, b) / max(len(a), len(b)) in [0, 1] (1 for two empty strings)."""
    n = max(len(a), len(b))
    return 1.0 if n == 0 else 1.0 - levenshtein(a, b) / n


class BidirectionalTrunk(nnx.Module):
    """Token embedding + ``Block`` layers with a non-causal padding mask + final RMSNorm.

    Usage:
      trunk = BidirectionalTrunk(TransformerConfig(vocab_size=99, ...), rngs=nnx.Rngs(0))
      hidden = trunk(tokens, valid)        # [B, T] int32, [B, T] bool -> [B, T, d_model]
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embedding = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.d_model),
                                     config.params_dtype))
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(config)

    def __call__(self, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        b, t = tokens.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.config.compute_dtype)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = valid.astype(bool)
        mask = valid[:, :, None] & valid[:, None, :]
        for block in self.layers:
            x = block(x, positions, mask)
        return self.final_norm(x)


class EditHead(nnx.Module):
    """Per-token edit-operation logits: hidden [B, T, d] -> [B, T, N_OPS] float32."""

    def __init__(self, d_model: int, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(d_model, N_OPS, rngs=rngs)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        return self.proj(hidden).astype(jnp.float32)
