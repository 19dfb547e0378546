"""Selective Importance Sampling (SIS): a token-level rejection test with pi_old as proposal.

Reference: arXiv 2607.04728 and ``shared/reference/sis.md``. Per response token t::

    log_w   = clip(logp_new(y_t) - logp_old(y_t), -20, 20)
    log_M   = max over the K given tokens v of clip(logp_new(v) - logp_old(v), -20, 20)
    accept  = (log u < log_w - log_M) or (log_w == 0)          # P(accept) = min(1, w / M)
    log_w  <- log_w - stop_gradient(accept * log_w)

An accepted token's ratio value is exactly 1 and its gradient is the on-policy
``grad log pi_theta(y_t)``; a rejected token keeps its ratio and the base algorithm's handling.
:func:`jaxflow.rl.policy_loss` takes an accepted token's gradient through the *unclipped*
log ratio (``raw - sg(raw)``, see :func:`sis_log_ratio`), so the on-policy gradient holds
even when ``|logp_new - logp_old| > 20``, where the authors' ``log_w - sg(log_w)`` has the
clip's zero gradient; the values (and every accept decision) are the same.

Envelope when the sampled token is not among the K given tokens: the envelope must satisfy
``M >= w`` for the sampled token, otherwise ``w / M > 1`` and the acceptance probability is no
longer ``w / M``. :func:`sis_log_envelope` therefore always includes the sampled token's own
(clipped) ``log_w`` in the max. When the sampled token *is* among the K tokens this changes
nothing (the value is already in the max); with K = |V| the envelope is exact.

The functions here are plain jnp functions: pure, jit-able, and shape-polymorphic over the
leading [B, T] axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOG_RATIO_CLIP = 20.0


def clipped_log_ratio(logp_new: jax.Array, logp_old: jax.Array,
                      clip: float = LOG_RATIO_CLIP) -> jax.Array:
    """``clip(logp_new - logp_old, -clip, clip)``; the gradient passes where not clipped."""
    return jnp.clip(logp_new - logp_old, -clip, clip)


def sis_log_envelope(log_w: jax.Array, new_topk_logp: jax.Array, old_topk_logp: jax.Array,
                     clip: float = LOG_RATIO_CLIP) -> jax.Array:
    """Log of the rejection-sampling envelope M per token (no gradient).

    Args:
      log_w: [B, T] clipped log ratio of the sampled token.
      new_topk_logp, old_topk_logp: [B, T, K] current / old log-probs at pi_old's top-K tokens.
      clip: the log-ratio clip applied to every top-K ratio.

    Returns:
      [B, T] ``max(max_k clip(new_k - old_k), log_w)``, stop-gradiented. Including ``log_w``
      keeps ``M >= w`` when the sampled token is outside the K given tokens (see module doc).
    """
    topk_log_w = clipped_log_ratio(new_topk_logp, old_topk_logp, clip)
    log_m = jnp.maximum(jnp.max(topk_log_w, axis=-1), log_w)
    return jax.lax.stop_gradient(log_m)


def sis_uniforms(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The float32 uniforms in [0, 1) that :func:`jaxflow.rl.policy_loss` draws from ``key``.

    Public so a caller (or a test) can reproduce exactly which tokens a loss call accepted.
    """
    return jax.random.uniform(key, shape, dtype=jnp.float32)


def sis_accept(log_w: jax.Array, log_envelope: jax.Array, uniforms: jax.Array) -> jax.Array:
    """The SIS acceptance test: ``log(u) < log_w - log_M`` or ``log_w == 0``.

    Args:
      log_w: [...] clipped log ratio of the sampled token.
      log_envelope: [...] log M (see :func:`sis_log_envelope`).
      uniforms: [...] draws from Uniform[0, 1), fresh at every loss evaluation.

    Returns:
      A bool array; ``P(accept) = min(1, w / M)`` for uniform ``u``. ``u == 0`` (log u = -inf)
      always accepts, which has probability about 2**-23 per float32 draw.
    """
    log_w = jax.lax.stop_gradient(log_w)
    log_envelope = jax.lax.stop_gradient(log_envelope)
    log_u = jnp.log(uniforms.astype(jnp.float32))
    margin = (log_w - log_envelope).astype(jnp.float32)
    return jnp.logical_or(log_u < margin, log_w == 0)


def sis_log_ratio(log_w: jax.Array, accept: jax.Array,
                  raw_log_ratio: jax.Array | None = None) -> jax.Array:
    """Value 0 and the on-policy gradient where accepted; ``log_w`` where rejected.

    Args:
      log_w: [...] the clipped log ratio ``clip(logp_new - logp_old, -c, c)``.
      accept: [...] bool, the SIS decisions.
      raw_log_ratio: optional [...] the unclipped ``logp_new - logp_old``. Given, an accepted
        token is ``raw - sg(raw)`` (value exactly 0, gradient ``grad logp_new`` even where
        ``|raw| > c``, where the clip's own gradient is 0); without it (the SIS authors'
        form) ``log_w - sg(log_w)``, whose gradient vanishes when the clip is active. A
        non-finite ``raw`` falls back to ``log_w``.

    Returns:
      [...] ``log_w - stop_gradient(accept * log_w)`` with the accepted branch as above.
    """
    if raw_log_ratio is None:
        on_policy = log_w
    else:
        on_policy = jnp.where(jnp.isfinite(raw_log_ratio), raw_log_ratio, log_w)
    accepted = on_policy - jax.lax.stop_gradient(on_policy)
    return jnp.where(accept, accepted, log_w)
