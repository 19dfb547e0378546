"""Rotary position embeddings and masked (grouped-query) dot-product attention.

Plain XLA einsums with a boolean mask; this is the reference path that any fused
kernel must match. Pure functions on arrays, no parameters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Large finite negative (not -inf) so that a query row that sees no key at all gives a
# uniform, finite softmax instead of NaN; such rows are zeroed afterwards.
_MASK_VALUE = -1e30


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float,
               inv_freq: jax.Array | None = None) -> jax.Array:
    """Rotates feature pairs (rotate-half convention) by position-dependent angles.

    Args:
      x: [B, T, H, D] queries or keys, D even.
      positions: [B, T] integer positions.
      theta: RoPE base frequency.
      inv_freq: optional [D/2] inverse frequencies overriding ``theta`` (e.g. Llama-3's
        scaled ones, :func:`jaxflow.models.rope.rope_inv_freq`).

    Returns:
      [B, T, H, D] in x.dtype; the rotation itself is computed in float32.
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """Mask for packed sequences: causal, same segment, key not padding (segment 0).

    Args:
      segment_ids: [B, T] int, 0 marks padding.

    Returns:
      [B, T, T] bool, True where query t may attend to key s.
    """
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    key_real = (segment_ids != 0)[:, None, :]
    return causal[None] & same & key_real


def cache_causal_mask(query_slots: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Mask for attending from new tokens to a KV cache.

    Args:
      query_slots: [B, L] int cache slot each query token was written to.
      key_valid: [B, S] bool, cache slots holding real (written, non-padding) entries.

    Returns:
      [B, L, S] bool, True where the key slot is valid and not after the query slot.
    """
    s = key_valid.shape[1]
    causal = jnp.arange(s)[None, None, :] <= query_slots[:, :, None]
    return causal & key_valid[:, None, :]


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> jax.Array:
    """Masked softmax attention with grouped-query heads.

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, K, D] keys, K divides H (each key head serves H/K query heads).
      v: [B, S, K, D] values.
      mask: [B, T, S] bool, True = attend.

    Returns:
      [B, T, H, D] in q.dtype. Rows whose mask is all False return zeros (no NaN).
      Logits and softmax are computed in float32.
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    q = q.reshape(b, t, kv_heads, groups, d)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32
    ) * (d**-0.5)
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(m, probs, 0.0).astype(v.dtype)
    # probs on the left: the product comes out [B, K, G, T, D] (head_dim minor), then moves T
    # forward. With v on the left (what einsum picks) T ends up minor, and XLA:GPU's gemm tiling
    # of the output projection fails on that layout whenever T is not a power of 2
    # ("Couldn't find output tile sizes", e.g. a 9-token prefill on H100).
    out = jax.lax.dot_general(probs, v, (((4,), (1,)), ((0, 1), (0, 2))))
    out = jnp.transpose(out, (0, 3, 1, 2, 4))
    return out.reshape(b, t, h, d).astype(q.dtype)
