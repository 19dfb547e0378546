"""SA-GCPO policy loss for the RL stage (OxygenREC, 2025), local to the recommender.

Kept as one small function with the argument layout of ``jaxflow.rl.policy_loss`` (per-token
logp / old_logp / mask, per-sequence advantages), so the RL stage can switch to
``policy_loss(..., config=PolicyLossConfig(algo="sa_gcpo"))`` once that exists.

* advantages, per request group: ``A = (r - mean_g r) / (std_g r + eps)``; a positive A is
  set to 0 when the sample's reward is below the request's target reward;
* token ratio ``rho = exp(logp - old_logp)`` and the soft gate (SAPO's)
  ``f = sigmoid(tau (rho - 1)) * 4 / tau`` with tau = 2 for A > 0 and 5 for A < 0 (its
  derivative at rho = 1 is 1, so on-policy it is the plain policy gradient);
* objective = mean over sequences of (mean over tokens of f) * A; the loss is its negative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sa_gcpo_advantages(rewards: jax.Array, target_reward: jax.Array,
                       eps: float = 1e-6) -> jax.Array:
    """f32[B, G] group-normalised advantages, positives zeroed below the target reward.

    Args:
      rewards: f32[B, G] (G samples per request); target_reward: f32[B] or a scalar.
    """
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    adv = (rewards - mean) / (std + eps)
    target = jnp.asarray(target_reward, rewards.dtype)
    target = target[:, None] if target.ndim == 1 else target
    return jnp.where((adv > 0) & (rewards < target), 0.0, adv)


def sa_gcpo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                 *, tau_pos: float = 2.0, tau_neg: float = 5.0):
    """SA-GCPO loss (to minimise) and metrics.

    Args:
      logp, old_logp: f32[N, T] per-token log-probs (current policy / the sampler's).
      advantages: f32[N] per sequence (from :func:`sa_gcpo_advantages`, flattened).
      mask: bool[N, T] tokens that count; masked entries may hold anything (even -inf).

    Returns:
      (loss scalar, {"gate_mean": mean f over tokens, "ratio_max": max rho}).
    """
    maskf = mask.astype(jnp.float32)
    mask = mask.astype(bool)
    logp = jnp.where(mask, logp, 0.0)
    old_logp = jnp.where(mask, old_logp, 0.0)
    rho = jnp.exp(jnp.clip(logp - jax.lax.stop_gradient(old_logp), -20.0, 20.0))
    adv = jax.lax.stop_gradient(advantages)[:, None]
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (rho - 1.0)) * 4.0 / tau
    per_seq = jnp.sum(gate * maskf, 1) / jnp.maximum(maskf.sum(1), 1.0)
    loss = -jnp.mean(per_seq * adv[:, 0])
    n = jnp.maximum(maskf.sum(), 1.0)
    return loss, {"gate_mean": jnp.sum(gate * maskf) / n,
                  "ratio_max": jnp.max(jnp.where(mask, rho, 0.0))}
