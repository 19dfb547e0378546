"""Instruction-Guided Retrieval (IGR): keep the m history behaviours most relevant to the
instruction, so a long history fits a short encoder (OxygenREC, 2025).

Relevance is the cosine between the instruction's query vector and each history item's key
vector. Selection is a *hard* top-m (``jax.lax.top_k``); the kept items stay in chronological
order. Gradients reach the scorer through a straight-through gate: each kept item's encoder
input is multiplied by ``g / stop_gradient(g)`` with ``g = sigmoid(score / temperature)``
(value exactly 1, derivative that of g), so the generation loss can teach relevance.
Recency truncation (TIGER's "last m items") is the same selection with score = position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def relevance_scores(query: jax.Array, keys: jax.Array) -> jax.Array:
    """Cosine relevance f32[B, H] of history keys f32[B, H, d] to queries f32[B, d]."""
    q = query / jnp.maximum(jnp.linalg.norm(query, axis=-1, keepdims=True), 1e-6)
    k = keys / jnp.maximum(jnp.linalg.norm(keys, axis=-1, keepdims=True), 1e-6)
    return jnp.einsum("bd,bhd->bh", q, k)


def top_m_indices(scores: jax.Array, valid: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Hard top-m selection of valid history positions, returned in chronological order.

    Args:
      scores: f32[B, H] relevance (higher = keep).
      valid: bool[B, H] real (non-padding) history entries.
      m: positions to keep (static), 1 <= m.

    Returns:
      (idx int32[B, m], kept bool[B, m]). Row b keeps exactly ``min(m, valid[b].sum())``
      positions; ``kept`` is False on the padding slots of rows with fewer than m valid items
      (their idx points at position 0 and must be ignored). Ties keep the earlier position.
    """
    if m < 1:
        raise ValueError(f"IGR keeps m={m} items; need m >= 1")
    h = scores.shape[1]
    if m > h:  # fewer history slots than m: pad the candidates with invalid ones
        scores = jnp.pad(scores, ((0, 0), (0, m - h)))
        valid = jnp.pad(valid, ((0, 0), (0, m - h)))
    # invalid positions rank last; among equal scores the earlier position wins
    ranked = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    _, idx = jax.lax.top_k(ranked, m)
    kept = jnp.take_along_axis(valid, idx, axis=1)
    # chronological order, padding slots last
    order_key = jnp.where(kept, idx, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(order_key, axis=1)
    idx = jnp.take_along_axis(idx, order, axis=1)
    kept = jnp.take_along_axis(kept, order, axis=1)
    return jnp.where(kept, idx, 0).astype(jnp.int32), kept


def recency_indices(valid: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """The last m valid positions (TIGER-style truncation), chronological: see top_m_indices."""
    pos = jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.float32), valid.shape)
    return top_m_indices(pos, valid, m)


def straight_through_gate(scores: jax.Array, temperature: float = 0.1) -> jax.Array:
    """f32[...] equal to 1 in value with the gradient of sigmoid(scores / temperature)."""
    g = jax.nn.sigmoid(scores / temperature)
    return g / jax.lax.stop_gradient(g)
