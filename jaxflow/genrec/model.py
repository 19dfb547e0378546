"""Encoder-decoder generative recommender (TIGER / OxygenREC "fast" model) in flax nnx.

Built from the project's decoder blocks (``jaxflow.models.transformer``): the encoder is a
stack of the LM's pre-norm ``Block`` run with a *non-causal* padding mask; a decoder block is
self-attention + cross-attention + SwiGLU, each sub-layer one of the LM's ``Attention`` /
``RMSNorm`` / ``SwiGLU`` modules. Cross-attention reuses ``Attention.project_qkv`` (queries
from the decoder stream, keys / values from the encoder output) at position 0 for both, so
RoPE is the identity there: cross-attention is position-free, as in T5.

Encoder input: ``[BOS, instruction tokens..., history items...]``; the instruction sits
right after BOS (OxygenREC). A history item's token is the sum of its semantic-ID code
embeddings (one embedding table per level) plus its behaviour-type embedding. Decoder input:
``[BOS, c_0, ..., c_{L-2}]``; position l predicts code c_l with level l's head over W codes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.genrec import igr
from jaxflow.models.attention import dot_product_attention, segment_causal_mask
from jaxflow.models.transformer import Attention, Block, RMSNorm, TransformerConfig


@dataclasses.dataclass(frozen=True)
class GenRecConfig:
    """Architecture of :class:`GenRec`.

    Attributes:
      levels, width: semantic-ID shape (L codes, each in [0, W)).
      instruction_vocab: instruction token ids in [0, instruction_vocab), 0 = padding.
      max_instruction: instruction slots in the encoder.
      max_history: m, history slots in the encoder (IGR / recency keep m items).
      behaviours: number of behaviour types (ids in [0, behaviours)).
      d_model, n_heads, d_ff, encoder_layers, decoder_layers: transformer sizes.
      use_igr: True keeps the m most instruction-relevant history items, False the m latest.
      igr_temperature: temperature of IGR's straight-through gate.
    """

    levels: int = 3
    width: int = 16
    instruction_vocab: int = 16
    max_instruction: int = 2
    max_history: int = 8
    behaviours: int = 3
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 128
    encoder_layers: int = 2
    decoder_layers: int = 2
    use_igr: bool = True
    igr_temperature: float = 0.1

    def __post_init__(self):
        for name in ("levels", "width", "instruction_vocab", "max_history", "behaviours",
                     "d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenRecConfig.{name}={value!r}: must be a positive int")
        if self.max_instruction < 0:
            raise ValueError(f"GenRecConfig.max_instruction={self.max_instruction}: must be >= 0")

    @property
    def encoder_length(self) -> int:
        """Encoder positions: one query token, the instruction and the history."""
        return 1 + self.max_instruction + self.max_history

    def blocks(self) -> TransformerConfig:
        """The TransformerConfig the shared blocks are built from."""
        return TransformerConfig(vocab_size=1, d_model=self.d_model, n_layers=max(
            self.encoder_layers, self.decoder_layers), n_heads=self.n_heads,
            n_kv_heads=self.n_heads, d_ff=self.d_ff, max_seq_len=max(self.encoder_length,
                                                                     self.levels + 1))


def _param(rngs: nnx.Rngs, shape, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


class CrossAttention(nnx.Module):
    """Queries from the decoder, keys / values from the encoder, via the LM's Attention."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.attn = Attention(config, rngs=rngs)

    def memory_kv(self, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys, values [B, S, H, hd] of the encoder output memory [B, S, d] (once per input)."""
        zeros = jnp.zeros(memory.shape[:2], jnp.int32)
        _, k, v = self.attn.project_qkv(memory, zeros)
        return k, v

    def __call__(self, x, k, v, memory_valid):
        zeros = jnp.zeros(x.shape[:2], jnp.int32)
        q, _, _ = self.attn.project_qkv(x, zeros)
        mask = jnp.broadcast_to(memory_valid[:, None, :], (x.shape[0], x.shape[1], k.shape[1]))
        return self.attn.project_out(dot_product_attention(q, k, v, mask))


class DecoderBlock(nnx.Module):
    """x + self_attn(norm(x)) (causal); x + cross_attn(norm(x), memory); x + mlp(norm(x))."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_block = Block(config, rngs=rngs)  # causal self-attention + MLP of the LM
        self.cross_norm = RMSNorm(config)
        self.cross = CrossAttention(config, rngs=rngs)

    def __call__(self, x, positions, mask, k, v, memory_valid):
        b = self.self_block
        x = x + b.attn(b.attn_norm(x), positions, mask)
        x = x + self.cross(self.cross_norm(x), k, v, memory_valid)
        return x + b.mlp(b.mlp_norm(x))


class GenRec(nnx.Module):
    """Encoder-decoder over semantic IDs; see the module docstring for the token layout."""

    def __init__(self, config: GenRecConfig, *, rngs: nnx.Rngs):
        self.config = config
        tc = config.blocks()
        d, L, W = config.d_model, config.levels, config.width
        self.bos = _param(rngs, (2, d), 0.02)  # [encoder BOS, decoder BOS]
        self.instruction_embed = _param(rngs, (config.instruction_vocab, d), 0.02)
        self.code_embed = _param(rngs, (L, W, d), 0.02)
        self.behaviour_embed = _param(rngs, (config.behaviours, d), 0.02)
        self.encoder = nnx.List([Block(tc, rngs=rngs) for _ in range(config.encoder_layers)])
        self.encoder_norm = RMSNorm(tc)
        self.decoder = nnx.List([DecoderBlock(tc, rngs=rngs)
                                 for _ in range(config.decoder_layers)])
        self.decoder_norm = RMSNorm(tc)
        self.head = _param(rngs, (L, d, W), d ** -0.5)
        self.query_proj = _param(rngs, (d, d), d ** -0.5)
        self.item_proj = _param(rngs, (d, d), d ** -0.5)

    # -- item / instruction vectors -------------------------------------------------------

    def item_embedding(self, codes: jax.Array) -> jax.Array:
        """Sum of code embeddings: codes int[..., L] -> f32[..., d]."""
        table = self.code_embed[...]
        return sum(table[lv][codes[..., lv]] for lv in range(self.config.levels))

    def instruction_vector(self, instruction: jax.Array) -> jax.Array:
        """Mean embedding of the non-padding instruction tokens: int[B, I] -> f32[B, d]
        (zeros for an empty instruction)."""
        valid = (instruction > 0).astype(jnp.float32)
        emb = self.instruction_embed[...][instruction] * valid[..., None]
        return emb.sum(1) / jnp.maximum(valid.sum(1, keepdims=True), 1.0)

    def query_vector(self, instruction: jax.Array) -> jax.Array:
        """Instruction query f32[B, d] used by IGR and the Q2I loss."""
        return self.instruction_vector(instruction) @ self.query_proj[...]

    def item_key(self, codes: jax.Array) -> jax.Array:
        """Item key f32[..., d] used by IGR and the Q2I loss: codes int[..., L]."""
        return self.item_embedding(codes) @ self.item_proj[...]

    # -- encoder --------------------------------------------------------------------------

    def select_history(self, instruction, history_codes, history_valid):
        """IGR (or recency) selection of m of H history items.

        Args:
          instruction: int32[B, I]; history_codes: int32[B, H, L]; history_valid: bool[B, H].

        Returns:
          (idx int32[B, m], kept bool[B, m], gate f32[B, m]) with gate = 1 in value.
        """
        c = self.config
        if c.use_igr:
            scores = igr.relevance_scores(self.query_vector(instruction),
                                          self.item_key(history_codes))
            idx, kept = igr.top_m_indices(scores, history_valid, c.max_history)
            gate = igr.straight_through_gate(jnp.take_along_axis(scores, idx, 1),
                                             c.igr_temperature)
        else:
            idx, kept = igr.recency_indices(history_valid, c.max_history)
            gate = jnp.ones(idx.shape, jnp.float32)
        return idx, kept, gate

    def encode(self, instruction, history_codes, history_behaviour, history_valid):
        """Encoder output.

        Args:
          instruction: int32[B, I], I <= max_instruction, 0 = padding.
          history_codes: int32[B, H, L] semantic IDs of the history (any H >= 1).
          history_behaviour: int32[B, H] behaviour types.
          history_valid: bool[B, H] real history entries (an all-False row is an empty
            history: the encoder then reads BOS and the instruction only).

        Returns:
          (memory f32[B, T, d], memory_valid bool[B, T]) with T = encoder_length.
        """
        c = self.config
        b = instruction.shape[0]
        if instruction.shape[1] > c.max_instruction:
            raise ValueError(f"instruction length {instruction.shape[1]} exceeds the encoder's "
                             f"max_instruction={c.max_instruction}")
        instruction = jnp.pad(instruction, ((0, 0), (0, c.max_instruction - instruction.shape[1])))
        idx, kept, gate = self.select_history(instruction, history_codes, history_valid)
        codes = jnp.take_along_axis(history_codes, idx[..., None], 1)
        beh = jnp.take_along_axis(history_behaviour, idx, 1)
        hist = (self.item_embedding(codes) + self.behaviour_embed[...][beh]) * gate[..., None]
        x = jnp.concatenate([
            jnp.broadcast_to(self.bos[...][0], (b, 1, c.d_model)),
            self.instruction_embed[...][instruction], hist], axis=1)
        valid = jnp.concatenate([jnp.ones((b, 1), bool), instruction > 0, kept], axis=1)
        positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), valid.shape)
        mask = valid[:, :, None] & valid[:, None, :]  # non-causal, padding never attended
        for block in self.encoder:
            x = block(x, positions, mask)
        return self.encoder_norm(x), valid

    # -- decoder --------------------------------------------------------------------------

    def memory_kv(self, memory):
        """Per decoder layer (k, v) of the memory, computed once per request."""
        return [layer.cross.memory_kv(memory) for layer in self.decoder]

    def decode(self, prefix: jax.Array, kv, memory_valid: jax.Array) -> jax.Array:
        """Code logits for every decoder position.

        Args:
          prefix: int32[B, l] the codes c_0..c_{l-1} generated so far (0 <= l < L).
          kv: memory_kv(memory) (rows aligned with prefix).
          memory_valid: bool[B, T].

        Returns:
          f32[B, l + 1, W]: position j holds level j's logits given c_0..c_{j-1}.
        """
        c = self.config
        b, n = prefix.shape
        code_emb = self.code_embed[...]
        tokens = [jnp.broadcast_to(self.bos[...][1], (b, c.d_model))]
        tokens += [code_emb[j][prefix[:, j]] for j in range(n)]
        x = jnp.stack(tokens, axis=1)
        positions = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), (b, n + 1))
        mask = segment_causal_mask(jnp.ones((b, n + 1), jnp.int32))
        for layer, (k, v) in zip(self.decoder, kv):
            x = layer(x, positions, mask, k, v, memory_valid)
        x = self.decoder_norm(x)
        head = self.head[...][: n + 1]
        return jnp.einsum("bjd,jdw->bjw", x, head)

    def __call__(self, instruction, history_codes, history_behaviour, history_valid,
                 target_codes):
        """Teacher-forced logits f32[B, L, W] for target_codes int32[B, L]."""
        memory, valid = self.encode(instruction, history_codes, history_behaviour, history_valid)
        return self.decode(target_codes[:, :-1], self.memory_kv(memory), valid)
