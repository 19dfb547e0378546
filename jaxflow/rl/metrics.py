"""Diagnostics of the policy loss (:func:`jaxflow.rl.policy_loss.policy_loss`'s ``metrics``).

Everything here is a pure function of stop-gradient arrays of shape [B, T] (B sequences, T
response positions) and a [B, T] mask (bool or any numeric dtype, nonzero = True:
:func:`jaxflow.rl.masks.as_bool_mask`); each returns a scalar.

The cumulative-deviation diagnostics come in three forms (``log_w`` is the log ratio clipped to
``+-log_ratio_clip``, 20 by default; in the ``d_sis*`` member of each pair a token SIS accepted
counts as 0):

* ``d_original`` / ``d_sis``: token means of ``|log_w|`` over the unmasked tokens.
* ``d_original_seq`` / ``d_sis_seq``: the SIS authors' logged form
  (:func:`fork_d_seq`): each token's ``|log_w|`` with ``log_w`` first clipped to the PPO range
  ``[log(1 - eps_low), log(1 + eps_high)]``, averaged per sequence, then over all B sequences,
  a sequence with no unmasked token counting as 0.
* ``d_original_seq_nonempty`` / ``d_sis_seq_nonempty``: the mean over the sequences that have
  an unmasked token of each sequence's token mean of ``|log_w|`` (+-20 clip only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxflow.rl.masks import as_bool_mask


def masked_percentile(values: jax.Array, mask: jax.Array, q: float) -> jax.Array:
    """Linear-interpolated percentile (numpy's default) over ``values[mask]``; 0 if empty.

    ``values``, ``mask``: same shape (any; mask bool or numeric, nonzero = True); ``q`` in
    [0, 100]. Returns a scalar."""
    mask = as_bool_mask(mask, shape=values.shape)
    flat = jnp.where(mask, values, -jnp.inf).reshape(-1)
    ordered = jnp.sort(flat)
    n = jnp.sum(mask)
    first = flat.shape[0] - n  # masked-out entries sort first
    pos = (q / 100.0) * jnp.maximum(n - 1, 0).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    frac = (pos - lo).astype(values.dtype)
    lo_v = ordered[jnp.clip(first + lo, 0, flat.shape[0] - 1)]
    hi_v = ordered[jnp.clip(first + hi, 0, flat.shape[0] - 1)]
    return jnp.where(n > 0, lo_v + frac * (hi_v - lo_v), 0.0)


def _row_means(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([B] each row's token mean of ``values`` over its unmasked tokens (0 for an empty row),
    [B] whether the row has an unmasked token)."""
    maskf = as_bool_mask(mask).astype(values.dtype)
    count = jnp.sum(maskf, axis=-1)
    return jnp.sum(values * maskf, axis=-1) / jnp.maximum(count, 1.0), count > 0


def nonempty_sequence_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over the sequences with an unmasked token of each one's token mean of ``values``
    ([B, T] each); 0 when every token is masked."""
    per_seq, nonempty = _row_means(values, mask)
    return jnp.sum(jnp.where(nonempty, per_seq, 0.0)) / jnp.maximum(jnp.sum(nonempty), 1)


def ppo_log_range(eps: tuple[float, float]) -> tuple[float, float]:
    """``(log(1 - eps_low), log(1 + eps_high))``: the PPO clip range of the ratio in log space
    (-inf when ``eps_low >= 1``, +inf for an infinite ``eps_high``)."""
    low, high = eps
    return (math.log(1.0 - low) if low < 1.0 else -math.inf,
            math.log1p(high) if math.isfinite(high) else math.inf)


def fork_d_seq(log_w: jax.Array, accept: jax.Array, mask: jax.Array,
               eps: tuple[float, float]) -> tuple[jax.Array, jax.Array]:
    """The SIS authors' logged D metrics, ``(D_original, D_sis)``.

    Per token ``v = |clip(log_w, log(1 - eps_low), log(1 + eps_high))|`` (the log of the
    PPO-clipped ratio); ``D_original`` = mean over all B rows of each row's token mean of ``v``
    over its unmasked tokens, an empty row counting as 0 (so it is in the denominator B);
    ``D_sis`` the same with the accepted tokens' ``v`` set to 0.

    Args:
      log_w: [B, T] log ratios (already clipped to +-log_ratio_clip).
      accept: [B, T] bool, SIS accepted (all False without SIS).
      mask: [B, T] response mask (bool or numeric, nonzero = True).
      eps: (eps_low, eps_high) of the base algorithm's clip.
    """
    low, high = ppo_log_range(eps)
    v = jnp.abs(jnp.clip(log_w, low, high))
    rows = log_w.shape[0]
    d_original, _ = _row_means(v, mask)
    d_sis, _ = _row_means(jnp.where(accept, 0.0, v), mask)
    return jnp.sum(d_original) / rows, jnp.sum(d_sis) / rows


def loss_metrics(log_w: jax.Array, accept: jax.Array, clip_active: jax.Array,
                 dual_active: jax.Array, weights: jax.Array, mask: jax.Array,
                 eps: tuple[float, float]) -> dict[str, jax.Array]:
    """The policy loss's diagnostics (scalars) over the tokens of ``mask``.

    Args:
      log_w: [B, T] log ratio before SIS, clipped to +-log_ratio_clip.
      accept, clip_active, dual_active: [B, T] bool (SIS accepted; the clip / dual clip changed
        the token's loss).
      weights: [B, T] the ratio value the loss uses after SIS times the TIS / MIS weight.
      mask: [B, T] the tokens the loss uses (bool or numeric, nonzero = True).
      eps: the base algorithm's (eps_low, eps_high).
    """
    mask = as_bool_mask(mask)
    log_w = jax.lax.stop_gradient(log_w)
    weights = jax.lax.stop_gradient(weights)
    maskf = mask.astype(log_w.dtype)
    n = jnp.sum(maskf)
    denom = jnp.maximum(n, 1.0)
    ratio = jnp.exp(log_w)
    abs_log_w = jnp.abs(log_w) * maskf
    abs_log_w_sis = jnp.where(accept, 0.0, abs_log_w)
    w = weights * maskf
    ess = jnp.where(n > 0, jnp.sum(w) ** 2 / jnp.maximum(n * jnp.sum(w * w), 1e-30), 0.0)
    d_original_seq, d_sis_seq = fork_d_seq(log_w, accept, mask, eps)
    return {
        "accept_rate": jnp.sum(jnp.logical_and(accept, mask)) / denom,
        "clip_fraction": jnp.sum(jnp.logical_and(clip_active, mask)) / denom,
        "dual_clip_fraction": jnp.sum(jnp.logical_and(dual_active, mask)) / denom,
        "d_original": jnp.sum(abs_log_w) / denom,
        "d_sis": jnp.sum(abs_log_w_sis) / denom,
        "d_original_seq": d_original_seq,
        "d_sis_seq": d_sis_seq,
        "d_original_seq_nonempty": nonempty_sequence_mean(abs_log_w, mask),
        "d_sis_seq_nonempty": nonempty_sequence_mean(abs_log_w_sis, mask),
        "ratio_max": jnp.where(n > 0, jnp.max(jnp.where(mask, ratio, -jnp.inf)), 0.0),
        "ratio_p99": masked_percentile(ratio, mask, 99.0),
        "ess": ess,
    }
