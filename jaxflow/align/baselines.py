"""The baselines FIGA is compared with: SFT on the revisions and DPO on (revised, original) pairs.

* SFT: token-mean NLL of the chosen (revised) responses.
* DPO (Rafailov et al., 2023): with sequence log-probs of the chosen / rejected responses
  under the policy (``pc``, ``pr``) and a frozen reference (``rc``, ``rr``),
  ``loss = -mean log sigmoid(beta * ((pc - rc) - (pr - rr)))``; beta = 0.1 is the common
  default.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflow.rl.masks import as_bool_mask


def _check_2d(name: str, x, ref_shape=None) -> None:
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"{name} must be a [B, T] array, got shape {getattr(x, 'shape', None)}")
    if ref_shape is not None and tuple(x.shape) != tuple(ref_shape):
        raise ValueError(f"{name} shape {x.shape} does not match logp shape {ref_shape} [B, T]")


def sequence_logp(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, T] token log-probs -> [B] sums over unmasked tokens (masked entries ignored;
    ``mask`` [B, T] bool or numeric, nonzero = True)."""
    _check_2d("logp", logp)
    _check_2d("mask", mask, logp.shape)
    return jnp.sum(jnp.where(as_bool_mask(mask), logp, 0.0), axis=-1)


def sft_loss(logp: jax.Array, mask: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """Token-mean NLL over unmasked tokens of [B, T] ``logp`` (0 when all are masked);
    ``mask`` [B, T] bool or numeric, nonzero = True (not a weight)."""
    _check_2d("logp", logp)
    _check_2d("mask", mask, logp.shape)
    keep = as_bool_mask(mask)
    n = jnp.sum(keep)
    loss = -jnp.sum(jnp.where(keep, logp, 0.0)) / jnp.maximum(n, 1)
    return loss, {"tokens": n}


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array,
             ref_rejected: jax.Array, *, beta: float = 0.1) -> tuple[jax.Array, dict[str, Any]]:
    """DPO on [P] sequence log-probs (policy differentiated, reference treated as data).

    Returns ``(loss, metrics)`` with ``reward_accuracy`` (fraction of pairs whose implicit
    reward ranks the chosen response higher) and ``margin`` (mean implicit reward margin).

    Raises:
      ValueError: arrays of different shapes or not 1-D, or beta <= 0.
    """
    arrays = {"policy_chosen": policy_chosen, "policy_rejected": policy_rejected,
              "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
    for name, x in arrays.items():
        if not hasattr(x, "ndim") or x.ndim != 1 or x.shape != policy_chosen.shape:
            raise ValueError(f"{name} shape {getattr(x, 'shape', None)} must be [P] = "
                             f"{getattr(policy_chosen, 'shape', None)} (policy_chosen's)")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    ref_c, ref_r = jax.lax.stop_gradient(ref_chosen), jax.lax.stop_gradient(ref_rejected)
    margin = beta * ((policy_chosen - ref_c) - (policy_rejected - ref_r))
    loss = -jnp.mean(jax.nn.log_sigmoid(margin))
    return loss, {"reward_accuracy": jnp.mean(margin > 0),
                  "margin": jnp.mean(jax.lax.stop_gradient(margin))}
