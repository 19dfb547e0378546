"""Decoder-only transformer LM (flax nnx): pre-norm blocks, RoPE, GQA, SwiGLU, no biases.

Public API: TransformerConfig, Transformer, PRESETS, param_count, logical_axes.

The config also expresses the Llama-3 (Meta, 2024) and Qwen3 / Qwen3-MoE (Qwen team, 2025)
decoders: an explicit ``head_dim_override``, Qwen3's per-head q/k RMSNorm (``qk_norm``), the
checkpoint's RoPE theta and Llama-3 frequency scaling (``rope_scaling``), tied or untied
embeddings, and top-k routed experts (``n_experts`` > 0, see :mod:`jaxflow.models.moe`).
``jaxflow.models.architectures`` maps Hugging Face config.json files onto these fields.

Every parameter carries logical axis names (nnx metadata ``out_sharding``, with
``eager_sharding=False`` so a model can be built without a mesh); ``logical_axes`` reads
them back so the mesh code can map logical names -> mesh axes. Logical names used:
"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm".

Attention over packed rows runs on the backend ``TransformerConfig.attention`` names
(:mod:`jaxflow.models.attention_backends`: XLA reference, splash on TPU, Pallas flash or cuDNN
on GPU, ``auto``); ``remat`` / ``remat_policy`` rematerialise each block under a
``jax.checkpoint_policies`` policy. KV-cache decoding uses the XLA reference, or a paged decode
kernel over a heads-major cache (``cache_attention``, :mod:`jaxflow.models.decode_kernel`).

Dtypes: parameters are stored in ``param_dtype`` and cast to ``dtype`` for the matmuls;
the residual stream is carried in ``dtype``; RMSNorm statistics, attention logits/softmax
and the returned logits are float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.models import lora
from jaxflow.models.attention import (
    apply_rope,
    cache_causal_mask,
    dot_product_attention,
)
from jaxflow.models.attention_backends import attention as segment_attention
from jaxflow.models.kv_cache import KVCache, empty_cache, write_rows
from jaxflow.models.moe import MoE, MoEStats
from jaxflow.models.rope import rope_inv_freq
from jaxflow.models.transformer_config import (  # noqa: F401  (re-exported: the public API)
    _DTYPES,
    LOGICAL_AXIS_NAMES,
    PRESETS,
    REMAT_POLICIES,
    TransformerConfig,
)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, axes: tuple[str, ...],
           dtype: jnp.dtype) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis (size ``size``, default d_model),
    statistics in float32."""

    def __init__(self, config: TransformerConfig, size: int | None = None):
        self.eps = config.norm_eps
        self.dtype = config.compute_dtype
        self.scale = nnx.Param(jnp.ones((size or config.d_model,), config.params_dtype),
                               out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Attention(nnx.Module):
    """Multi-head (grouped-query) self-attention with RoPE; projections without bias."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
        d, h, k, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        pdt = config.params_dtype
        out_std = (h * hd) ** -0.5 / math.sqrt(2 * config.n_layers)
        self.wq = _param(rngs, (d, h, hd), d**-0.5, ("attn_embed", "heads", "head_dim"), pdt)
        self.wk = _param(rngs, (d, k, hd), d**-0.5, ("attn_embed", "kv_heads", "head_dim"), pdt)
        self.wv = _param(rngs, (d, k, hd), d**-0.5, ("attn_embed", "kv_heads", "head_dim"), pdt)
        self.wo = _param(rngs, (h, hd, d), out_std, ("heads", "head_dim", "attn_embed"), pdt)
        lora.attach(self, config.lora, layer, "attn")  # no-op unless config.lora.rank > 0
        if config.qk_norm:
            self.q_norm = RMSNorm(config, hd)
            self.k_norm = RMSNorm(config, hd)
        self.qk_norm = config.qk_norm
        self.rope_theta = config.rope_theta
        # A hashable host tuple (module attributes are static); rope_inv_freq is exact f32.
        self.rope_inv_freq = tuple(float(f) for f in rope_inv_freq(hd, config.rope_theta,
                                                                   config.rope_scaling))
        self.dtype = config.compute_dtype
        self.attention = config.attention

    def project_qkv(self, x: jax.Array, positions: jax.Array):
        """Queries, keys, values with RoPE applied: x [B, T, d], positions [B, T] ->
        q [B, T, n_heads, head_dim], k and v [B, T, n_kv_heads, head_dim].

        Public so other attention implementations (segment-id Pallas kernels, pruning hooks)
        can reuse this layer's projections."""
        dt = self.dtype
        q = jnp.einsum("btd,dhk->bthk", x, lora.weight(self, "wq").astype(dt))
        k = jnp.einsum("btd,dhk->bthk", x, lora.weight(self, "wk").astype(dt))
        v = jnp.einsum("btd,dhk->bthk", x, lora.weight(self, "wv").astype(dt))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = np.asarray(self.rope_inv_freq, np.float32)
        q = apply_rope(q, positions, theta=self.rope_theta, inv_freq=inv_freq)
        k = apply_rope(k, positions, theta=self.rope_theta, inv_freq=inv_freq)
        return q, k, v

    def project_out(self, attn: jax.Array) -> jax.Array:
        """Output projection: attn [B, T, n_heads, head_dim] -> [B, T, d]."""
        return jnp.einsum("bthk,hkd->btd", attn, lora.weight(self, "wo").astype(self.dtype))

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        """Attention under an explicit mask [B, T, T] (XLA reference): x [B, T, d] -> [B, T, d]."""
        q, k, v = self.project_qkv(x, positions)
        return self.project_out(dot_product_attention(q, k, v, mask))

    def segments(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, *,
                 attention: str | None = None, interpret: bool = False,
                 causal: bool = True) -> jax.Array:
        """Attention within segments (segment_ids [B, T], 0 = padding), causal by default
        (``causal=False``: bidirectional within a segment, the ViT encoder's), by backend
        (``attention``, default the config's; see jaxflow.models.attention_backends):
        x [B, T, d] -> [B, T, d]."""
        q, k, v = self.project_qkv(x, positions)
        out = segment_attention(q, k, v, segment_ids, backend=attention or self.attention,
                                interpret=interpret, causal=causal)
        return self.project_out(out)

    def decode(self, x, positions, k_cache, v_cache, index, slots, key_valid,
               cache_attention=None):
        """Writes this step's keys/values at `index` and attends over the cache: the XLA
        reference, or ``cache_attention(q, k, v, k_cache, v_cache, index, slots, key_valid) ->
        (out, k_cache, v_cache)`` (another cache layout and a decode kernel,
        :mod:`jaxflow.models.decode_kernel`)."""
        q, k, v = self.project_qkv(x, positions)
        if cache_attention is not None:
            out, k_cache, v_cache = cache_attention(q, k, v, k_cache, v_cache, index, slots,
                                                    key_valid)
            return self.project_out(out), k_cache, v_cache
        k_cache = write_rows(k_cache, k, index)
        v_cache = write_rows(v_cache, v, index)
        mask = cache_causal_mask(slots, key_valid)
        return self.project_out(dot_product_attention(q, k_cache, v_cache, mask)), k_cache, v_cache


class SwiGLU(nnx.Module):
    """down(silu(x @ gate) * (x @ up)), no biases."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
        d, f, pdt = config.d_model, config.d_ff, config.params_dtype
        self.w_gate = _param(rngs, (d, f), d**-0.5, ("embed", "mlp"), pdt)
        self.w_up = _param(rngs, (d, f), d**-0.5, ("embed", "mlp"), pdt)
        self.w_down = _param(rngs, (f, d), f**-0.5 / math.sqrt(2 * config.n_layers),
                             ("mlp", "embed"), pdt)
        self.dtype = config.compute_dtype
        lora.attach(self, config.lora, layer, "mlp")  # no-op unless config.lora.rank > 0

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        gate = x @ lora.weight(self, "w_gate").astype(dt)
        up = x @ lora.weight(self, "w_up").astype(dt)
        return (jax.nn.silu(gate) * up) @ lora.weight(self, "w_down").astype(dt)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x)). ``mlp`` is SwiGLU or,
    on MoE layers, :class:`jaxflow.models.moe.MoE`."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = RMSNorm(config)
        self.attn = Attention(config, rngs=rngs, layer=layer)
        self.mlp_norm = RMSNorm(config)
        self.is_moe = config.is_moe_layer(layer)
        self.mlp = MoE(config, rngs=rngs) if self.is_moe else SwiGLU(config, rngs=rngs, layer=layer)

    def forward(self, x, positions, segment_ids, *, attention: str | None = None,
                interpret: bool = False, experts: jax.Array | None = None,
                causal: bool = True) -> tuple[jax.Array, MoEStats | None]:
        """Packed rows: segment_ids [B, T] (0 = padding), attention by backend (default the
        config's), causal within a segment unless ``causal=False`` (bidirectional);
        ``experts`` [B, T, k]: replayed routing of a MoE layer (R3). Returns
        (x [B, T, d], MoEStats on MoE layers else None)."""
        h = self.attn_norm(x)
        return self._mlp(x + self.attn.segments(h, positions, segment_ids, attention=attention,
                                                interpret=interpret, causal=causal), experts)

    def _mlp(self, x, experts=None) -> tuple[jax.Array, MoEStats | None]:
        if self.is_moe:
            y, stats = self.mlp.apply(self.mlp_norm(x), experts)
            return x + y, stats
        return x + self.mlp(self.mlp_norm(x)), None

    def __call__(self, x, positions, mask):
        """Under an explicit mask [B, T, T] (XLA reference): x [B, T, d] -> [B, T, d]."""
        return self._mlp(x + self.attn(self.attn_norm(x), positions, mask))[0]

    def decode(self, x, positions, k_cache, v_cache, index, slots, key_valid,
               cache_attention=None):
        attn, k_cache, v_cache = self.attn.decode(
            self.attn_norm(x), positions, k_cache, v_cache, index, slots, key_valid,
            cache_attention)
        x = x + attn
        return x + self.mlp(self.mlp_norm(x)), k_cache, v_cache


class Transformer(nnx.Module):
    """Decoder-only language model.

    Usage:
      model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
      logits = model(tokens)                       # [B, T] int32 -> [B, T, V] float32
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt = config.params_dtype
        self.embedding = _param(rngs, (config.vocab_size, config.d_model), 0.02,
                                ("vocab", "embed"), pdt)
        self.layers = nnx.List([Block(config, rngs=rngs, layer=i)
                                for i in range(config.n_layers)])
        self.final_norm = RMSNorm(config)
        if not config.tie_embeddings:
            self.lm_head = _param(rngs, (config.d_model, config.vocab_size),
                                  config.d_model**-0.5, ("embed", "vocab"), pdt)

    # -- forward ---------------------------------------------------------------------

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.config.compute_dtype)

    def head_weight(self) -> jax.Array:
        """[d_model, vocab_size] LM-head matrix in param_dtype (embedding.T when tied)."""
        if self.config.tie_embeddings:
            return self.embedding[...].T
        return self.lm_head[...]

    def _logits(self, hidden: jax.Array) -> jax.Array:
        w = self.head_weight().astype(self.config.compute_dtype)
        return jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)

    def hidden_states(self, tokens: jax.Array | None = None, *,
                      positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None,
                      inputs_embeds: jax.Array | None = None,
                      attention: str | None = None, interpret: bool = False) -> jax.Array:
        """Final-RMSNorm output that the LM head sees (see :meth:`hidden_states_with_aux`)."""
        return self.hidden_states_with_aux(tokens, positions=positions, segment_ids=segment_ids,
                                           inputs_embeds=inputs_embeds, attention=attention,
                                           interpret=interpret)[0]

    def hidden_states_with_aux(self, tokens: jax.Array | None = None, *,
                               positions: jax.Array | None = None,
                               segment_ids: jax.Array | None = None,
                               inputs_embeds: jax.Array | None = None,
                               attention: str | None = None, interpret: bool = False,
                               routing: jax.Array | None = None
                               ) -> tuple[jax.Array, tuple[MoEStats, ...]]:
        """Final-RMSNorm output that the LM head sees, and each MoE layer's MoEStats.

        Args:
          tokens: [B, T] int32; or None when ``inputs_embeds`` is given.
          positions: [B, T] int32 RoPE positions (per segment); default arange(T).
          segment_ids: [B, T] int32, tokens attend causally within their own segment only;
            0 marks padding. Default all ones.
          inputs_embeds: [B, T, d_model] input embeddings used instead of looking ``tokens``
            up (e.g. image embeddings spliced into text); cast to the compute dtype.
            Exactly one of ``tokens`` / ``inputs_embeds``.
          attention: attention backend for this call (``ATTENTION_BACKENDS``); default the
            config's ``attention``.
          interpret: run a Pallas attention kernel (splash / flash) in interpret mode.
          routing: [B, T, L_moe, k] expert ids (any integer dtype) replayed by the MoE layers in
            layer order instead of their routers' top-k (R3, :mod:`jaxflow.models.moe`); not
            with ``scan_layers``.

        Returns:
          ([B, T, d_model] in the compute dtype, one MoEStats per MoE layer in layer order;
          empty for dense models). Padding rows are finite but meaningless.
        """
        if (tokens is None) == (inputs_embeds is None):
            raise ValueError("hidden_states takes exactly one of tokens / inputs_embeds, got "
                             f"tokens={'None' if tokens is None else tokens.shape}, inputs_embeds="
                             f"{'None' if inputs_embeds is None else inputs_embeds.shape}")
        if inputs_embeds is not None:
            if inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != self.config.d_model:
                raise ValueError(f"inputs_embeds shape {inputs_embeds.shape}; need "
                                 f"[B, T, d_model={self.config.d_model}]")
            x = inputs_embeds.astype(self.config.compute_dtype)
        else:
            x = self._embed(tokens)
        b, t = x.shape[:2]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        def forward(blk, h, experts=None):
            return blk.forward(h, positions, segment_ids, attention=attention,
                               interpret=interpret, experts=experts)

        n_moe = sum(block.is_moe for block in self.layers)
        if routing is not None and (self.config.scan_layers or routing.shape[:3] != (b, t, n_moe)):
            raise ValueError(f"routing shape {routing.shape}: need [B, T, MoE layers, k] = [{b}, {t}, {n_moe}, k] "
                             f"and scan_layers off (it is {self.config.scan_layers})")

        policy = (getattr(jax.checkpoint_policies, self.config.remat_policy)
                  if self.config.remat else None)
        if self.config.scan_layers:
            return self.final_norm(scan_blocks(self.layers, forward, x, policy)), ()
        if policy is not None:
            forward = nnx.remat(forward, policy=policy)
        stats = []
        for block in self.layers:
            replayed = None if routing is None or not block.is_moe else routing[:, :, len(stats)]
            x, s = forward(block, x, replayed)
            if s is not None:
                stats.append(s)
        return self.final_norm(x), tuple(stats)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits. tokens [B, T] int32 -> [B, T, vocab_size] float32 (see hidden_states)."""
        return self._logits(
            self.hidden_states(tokens, positions=positions, segment_ids=segment_ids))

    def forward_with_aux(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None
                         ) -> tuple[jax.Array, tuple[MoEStats, ...]]:
        """(logits [B, T, V] f32, per-MoE-layer MoEStats) - router logits feed
        :func:`jaxflow.models.moe.load_balancing_loss`; dropped fractions are reported."""
        hidden, stats = self.hidden_states_with_aux(tokens, positions=positions,
                                                    segment_ids=segment_ids)
        return self._logits(hidden), stats

    # -- incremental decoding --------------------------------------------------------

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """Empty KVCache with per-layer k/v of shape [batch_size, max_len, n_kv_heads, head_dim]."""
        c = self.config
        if max_len > c.max_seq_len:
            raise ValueError(f"cache max_len={max_len} exceeds max_seq_len={c.max_seq_len}")
        return empty_cache(n_layers=c.n_layers, batch_size=batch_size, max_len=max_len,
                           n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                           dtype=c.compute_dtype)

    def decode(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array,
               valid: jax.Array | None = None, cache_attention=None
               ) -> tuple[jax.Array, KVCache]:
        """Appends tokens to the cache and returns their logits.

        Row b's tokens are written at cache slots index[b] .. index[b]+L-1; then index[b]
        advances by the number of VALID tokens, so valid tokens must be a prefix of each
        row (right padding) and the next call overwrites the padding slots: every row
        continues right after its own real tokens. The cache must have room for
        index[b] + L slots (writes past the end are clamped, i.e. wrong).

        Args:
          tokens: [B, L] int32 (L = prompt length for prefill, 1 for a step).
          cache: KVCache from init_cache or a previous decode.
          positions: [B, L] int32 RoPE positions.
          valid: [B, L] bool, False for padding tokens (never attended to). Default all True.
          cache_attention: None (the XLA reference over a [B, S, KVH, D] cache), or each
            layer's write + attention for another cache layout (:class:`Attention.decode`).

        Returns:
          (logits [B, L, vocab_size] float32, updated cache). Each token attends to the
          valid cache entries at or before its own slot. Logits of invalid tokens are
          finite but meaningless.
        """
        b, l = tokens.shape
        if valid is None:
            valid = jnp.ones((b, l), bool)
        valid = valid.astype(bool)
        index = cache.index
        slots = index[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]
        key_valid = write_rows(cache.valid, valid, index)
        x = self._embed(tokens)
        new_k, new_v = [], []
        for block, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x, k_cache, v_cache = block.decode(x, positions, k_cache, v_cache, index, slots,
                                               key_valid, cache_attention)
            new_k.append(k_cache)
            new_v.append(v_cache)
        logits = self._logits(self.final_norm(x))
        new_index = index + valid.sum(axis=1, dtype=jnp.int32)
        return logits, KVCache(k=tuple(new_k), v=tuple(new_v), valid=key_valid,
                               index=new_index)


def scan_blocks(blocks, forward, x: jax.Array, policy=None) -> jax.Array:
    """``x`` through every block of ``blocks`` (dense, alike) as one ``lax.scan``.

    Args:
      blocks: the decoder's :class:`Block` s, stored per layer; their weights are stacked
        ([n_layers, ...] per leaf) for the scan.
      forward: ``(block, h) -> (h, None)``, one block's packed forward.
      x: [B, T, d_model] the residual stream entering the first block.
      policy: a ``jax.checkpoint_policies`` policy to rematerialise each block under, or None.

    Returns:
      [B, T, d_model] the residual stream after the last block (the same arithmetic as the
      Python loop over ``blocks``; compiled once for the layer body).
    """
    graphdef, first = nnx.split(blocks[0])
    treedef = jax.tree.structure(first)
    stacked = [jnp.stack(leaves) for leaves in
               zip(*(jax.tree.leaves(nnx.state(blk)) for blk in blocks))]

    def body(h, leaves):
        return forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), h)[0], None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy)
    return jax.lax.scan(body, x, stacked)[0]


# -- parameter utilities ---------------------------------------------------------------


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_count(model_or_state) -> int:
    """Number of scalar parameters in a Transformer (its nnx.Param state) or any pytree.

    Works on abstract states (ShapeDtypeStruct leaves, e.g. from nnx.eval_shape).
    """
    if isinstance(model_or_state, nnx.Module):
        model_or_state = nnx.state(model_or_state, nnx.Param)
    return int(sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(model_or_state)))


def logical_axes(state) -> nnx.State:
    """Logical axis names of every parameter.

    Args:
      state: nnx.state(model, nnx.Param) (or a model), leaves must still be nnx.Variables
        (the metadata lives there; a pure array dict has lost it).

    Returns:
      Same tree structure as `state`, each leaf a tuple[str | None, ...] of length
      param.ndim with names from LOGICAL_AXIS_NAMES. Note tuples are pytree nodes: use
      `jax.tree.map(f, axes, is_leaf=lambda x: isinstance(x, tuple))`.
    """
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)

    def axes(variable):
        if not _is_variable(variable):
            raise ValueError(
                f"logical_axes needs nnx.Variable leaves carrying metadata, got "
                f"{type(variable).__name__}; pass nnx.state(model, nnx.Param)")
        names = variable.get_metadata().get("out_sharding")
        if names is None:
            raise ValueError(f"parameter of shape {np.shape(variable[...])} has no logical "
                             "axis annotation")
        return tuple(names)

    return jax.tree.map(axes, state, is_leaf=_is_variable)
