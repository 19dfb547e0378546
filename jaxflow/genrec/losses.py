"""Training losses of the generative recommender: behaviour-weighted next-code NLL and the
in-batch Query-to-Item (Q2I) contrastive loss (OxygenREC, 2025)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def generation_loss(logits: jax.Array, target_codes: jax.Array,
                    weights: jax.Array | None = None) -> jax.Array:
    """Behaviour-weighted next-token NLL of the target semantic IDs.

    ``sum_b w_b sum_l -log softmax(logits[b, l])[c_bl] / (L sum_b w_b)``: each request's L code
    tokens count with its behaviour weight (e.g. click 1, cart 2, purchase 3); w = 1 is the
    plain mean token NLL.

    Args:
      logits: f32[B, L, W]; target_codes: int[B, L]; weights: optional f32[B] >= 0.

    Returns:
      f32 scalar (0 when every weight is 0).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, target_codes[..., None].astype(jnp.int32), -1)[..., 0]
    w = jnp.ones(nll.shape[:1], jnp.float32) if weights is None else weights.astype(jnp.float32)
    return jnp.sum(w[:, None] * nll) / jnp.maximum(jnp.sum(w) * nll.shape[1], 1e-12)


def q2i_loss(query: jax.Array, item: jax.Array, *, item_ids: jax.Array | None = None,
             temperature: float = 0.1) -> jax.Array:
    """In-batch InfoNCE from each instruction query to its target item.

    ``logits = cos(query_i, item_j) / temperature``; loss = mean_i -log softmax_j(logits)[i].
    With ``item_ids``, column j != i whose item equals row i's target is not a negative
    (its logit is removed), so duplicate targets in a batch are not pushed apart.

    Args:
      query: f32[B, d] instruction query vectors; item: f32[B, d] target item keys.
      item_ids: optional int[B] target item ids.
      temperature: > 0.

    Returns:
      f32 scalar.
    """
    if not temperature > 0:
        raise ValueError(f"q2i temperature={temperature!r}: must be > 0")
    q = query / jnp.maximum(jnp.linalg.norm(query, axis=-1, keepdims=True), 1e-6)
    k = item / jnp.maximum(jnp.linalg.norm(item, axis=-1, keepdims=True), 1e-6)
    logits = (q @ k.T).astype(jnp.float32) / temperature
    b = logits.shape[0]
    eye = jnp.eye(b, dtype=bool)
    if item_ids is not None:
        same = item_ids[:, None] == item_ids[None, :]
        logits = jnp.where(same & ~eye, -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.diagonal(logp))
