"""Behaviour-policy corrections: truncated (TIS) and masked (MIS / IcePop) importance weights and
verl's token rejection sampling (RS).

All three correct for the gap between the policy that sampled the data (``behaviour_logp``, the
sampler's report, mu) and the trainer's own recomputation at the start of the rollout's
updates (``old_logp``, pi_old), e.g. a bf16 sampler vs an f32 trainer. Per token::

    rho = pi_old(y_t) / mu(y_t)
    TIS:  weight = min(rho, cap)                      (cap ~ 2)
    MIS:  weight = rho if low <= rho <= high else 0   (token-level IcePop-style mask)
    RS:   keep   = low <= rho <= high                 (verl rollout_rs="token")

The weights are detached (no gradient) and multiply every token's loss, SIS-accepted or not; a
token MIS zeroes still counts in the aggregation's denominator. RS weighs nothing: a token it
rejects is removed from the response mask (verl's ``modified_response_mask``), so it leaves
the denominator too. With the same bounds MIS and RS drop the same tokens and differ in the
denominator and in the kept tokens' weight (rho for MIS, 1 for RS). MIS with the bounds
[0.5, 5] is NeMo-RL's IcePop (``correction="icepop"``); the other corrections of the frameworks
are in :mod:`jaxflow.rl.correction_menu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflow.rl.sis import LOG_RATIO_CLIP


def _behaviour_log_ratio(old_logp: jax.Array, behaviour_logp: jax.Array) -> jax.Array:
    log_rho = jnp.clip(old_logp - behaviour_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return jax.lax.stop_gradient(log_rho)


def tis_weights(old_logp: jax.Array, behaviour_logp: jax.Array, cap: float) -> jax.Array:
    """[B, T] ``min(pi_old / mu, cap)``, detached."""
    return jnp.minimum(jnp.exp(_behaviour_log_ratio(old_logp, behaviour_logp)), cap)


def mis_weights(old_logp: jax.Array, behaviour_logp: jax.Array, low: float,
                high: float) -> jax.Array:
    """[B, T] ``pi_old / mu`` where it lies in [low, high], else 0; detached."""
    rho = jnp.exp(_behaviour_log_ratio(old_logp, behaviour_logp))
    keep = jnp.logical_and(rho >= low, rho <= high)
    return jnp.where(keep, rho, jnp.zeros_like(rho))


def rs_keep_mask(old_logp: jax.Array, behaviour_logp: jax.Array, low: float,
                 high: float) -> jax.Array:
    """[B, T] bool: ``low <= pi_old / mu <= high`` (ratio from the +-20-clipped log ratio, as
    verl's token rejection sampling); the tokens RS keeps in the mask."""
    rho = jnp.exp(_behaviour_log_ratio(old_logp, behaviour_logp))
    return jnp.logical_and(rho >= low, rho <= high)
