"""Train/inference mismatch diagnostics: how far the sampler (mu, ``behaviour_logp``) is from the
trainer's pi_old (``old_logp``), and how much of the batch the active correction masks or clips.

All are pure functions of [B, T] arrays (masked entries may hold anything) returning scalars, as
every framework logs them (verl ``rollout_corr/*``, prime-rl ``mismatch_kl``, NeMo-RL
``is_oob_ratio``). With ``log_rho = log pi_old - log mu`` (clipped to +-20) on the tokens the
sampler drew:

* ``mismatch/kl``: the k3 estimator ``rho - 1 - log rho`` of KL(mu || pi_old), token mean:
  unbiased (``E_mu[rho] = 1``) and non-negative per token (prime-rl's ``mismatch_kl``, verl's
  ``k3_kl``); ``mismatch/kl_k1``: the k1 estimator ``-log rho`` (verl's ``kl``; unbiased, noisier,
  may be negative).
* ``mismatch/log_ratio_p05`` / ``_p50`` / ``_p95``: quantiles of ``log_rho`` (numpy's linear
  interpolation); ``mismatch/abs_log_ratio_max``.
* ``mismatch/masked_fraction/<part>``: the share of the mask's tokens the correction removes from
  the loss or weighs 0 -- ``rs`` (verl's token rejection), ``mis`` (zero MIS weight), or the menu
  entry's name (``icepop``, ``geo-rs``, ...); ``mismatch/clipped_fraction/tis``: the share whose
  TIS weight is truncated at the cap (``geo-rs+tis`` reports its TIS share the same way;
  ``mismatch/clipped_fraction/seq-tis``: ``geo-rs+seq-tis``'s tokens in rows whose sequence weight is
  truncated). Each part
  is counted on the given mask, independently of the others. SIS needs pi_theta and is reported by
  the loss itself (``accept_rate``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxflow.rl import correction_menu, corrections
from jaxflow.rl.masks import as_bool_mask
from jaxflow.rl.metrics import masked_percentile
from jaxflow.rl.policy_loss import PolicyLossConfig

QUANTILES = (5, 50, 95)


def _share(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.logical_and(x, mask)) / jnp.maximum(jnp.sum(mask), 1)


def mismatch_kl(old_logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(k3, k1) token means of KL(mu || pi_old) over ``mask``'s tokens (0 when it is empty).

    ``old_logp``, ``behaviour_logp``: [B, T] log-probs of the sampled tokens under pi_old and mu;
    ``mask``: [B, T] bool or numeric (nonzero = the token counts)."""
    mask = as_bool_mask(mask, name="mask", shape=old_logp.shape)
    log_rho = correction_menu.behaviour_log_ratio(jnp.where(mask, old_logp, 0.0), jnp.where(mask, behaviour_logp, 0.0))
    n = jnp.maximum(jnp.sum(mask), 1)
    k3 = jnp.sum(jnp.where(mask, jnp.exp(log_rho) - 1.0 - log_rho, 0.0)) / n
    k1 = jnp.sum(jnp.where(mask, -log_rho, 0.0)) / n
    return k3, k1


def correction_shares(config: PolicyLossConfig, old_logp: jax.Array, behaviour_logp: jax.Array,
                      mask: jax.Array) -> dict[str, jax.Array]:
    """The share of ``mask``'s tokens each part of ``config.correction`` masks or clips.

    Args:
      config: the policy loss's config (its correction and bounds).
      old_logp, behaviour_logp: [B, T] pi_old's and mu's log-probs of the sampled tokens.
      mask: [B, T] the response mask (bool or numeric).

    Returns:
      ``{"mismatch/masked_fraction/<part>": share, "mismatch/clipped_fraction/tis": share}`` for
      the parts the correction has (empty for "none" and "sis"); scalars in [0, 1].
    """
    mask = as_bool_mask(mask, name="mask", shape=old_logp.shape)
    old_c, beh_c = jnp.where(mask, old_logp, 0.0), jnp.where(mask, behaviour_logp, 0.0)
    out = {}
    if config.correction in correction_menu.MENU:
        menu = correction_menu.menu_correction(config.correction, config.menu, old_c, beh_c, mask,
                                               tis_cap=config.tis_cap)
        out[f"mismatch/masked_fraction/{config.correction}"] = _share(menu.masked, mask)
        log_rho = correction_menu.behaviour_log_ratio(old_c, beh_c)
        if config.correction == "geo-rs+tis":
            out["mismatch/clipped_fraction/tis"] = _share(jnp.logical_and(jnp.exp(log_rho) > config.tis_cap, menu.keep),
                                                          mask)
        elif config.correction == "geo-rs+seq-tis":
            seq = jnp.sum(jnp.where(mask, log_rho, 0.0), axis=-1, keepdims=True)
            capped = jnp.logical_and(seq > math.log(config.tis_cap), menu.keep)
            out["mismatch/clipped_fraction/seq-tis"] = _share(capped, mask)
        return out
    if config.uses_rs:
        low, high = config.rs_bounds
        out["mismatch/masked_fraction/rs"] = _share(~corrections.rs_keep_mask(old_c, beh_c, low, high), mask)
    if config.behaviour_correction == "mis":
        weights = corrections.mis_weights(old_c, beh_c, config.mis_low, config.mis_high)
        out["mismatch/masked_fraction/mis"] = _share(weights == 0, mask)
    elif config.behaviour_correction == "tis":
        rho = jnp.exp(correction_menu.behaviour_log_ratio(old_c, beh_c))
        out["mismatch/clipped_fraction/tis"] = _share(rho > config.tis_cap, mask)
    return out


def mismatch_metrics(old_logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, *,
                     config: PolicyLossConfig | None = None) -> dict[str, jax.Array]:
    """Every mismatch diagnostic of the module docstring for one batch.

    Args:
      old_logp, behaviour_logp: [B, T] pi_old's and the sampler's log-probs of the sampled tokens.
      mask: [B, T] the response mask (bool or numeric, nonzero = the token counts).
      config: the policy loss's config; None reports no correction shares.

    Returns:
      a dict of scalars named ``mismatch/...`` (the keys depend only on ``config``, so the dict
      is jit-friendly).
    """
    mask = as_bool_mask(mask, name="mask", shape=old_logp.shape)
    k3, k1 = mismatch_kl(old_logp, behaviour_logp, mask)
    log_rho = correction_menu.behaviour_log_ratio(jnp.where(mask, old_logp, 0.0), jnp.where(mask, behaviour_logp, 0.0))
    out = {"mismatch/kl": k3, "mismatch/kl_k1": k1,
           "mismatch/abs_log_ratio_max": jnp.max(jnp.where(mask, jnp.abs(log_rho), 0.0))}
    for q in QUANTILES:
        out[f"mismatch/log_ratio_p{q:02d}"] = masked_percentile(log_rho, mask, q)
    if config is not None:
        out.update(correction_shares(config, old_logp, behaviour_logp, mask))
    return out
