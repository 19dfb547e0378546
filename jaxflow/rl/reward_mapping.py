"""Unified reward mapping: several business rewards -> one scalar reward, weighted per scenario.

OxygenREC (arXiv 2512.22386) trains one generative recommender for many scenarios ("train once,
deploy everywhere") and maps the objectives each scenario cares about (click, add-to-cart,
purchase, ...) to one reward before SA-GCPO's group normalisation. The paper gives no formula
beyond per-scenario weighting, so this is the plain form::

    reward[b] = sum_k weights[scenario[b], k] * (rewards[b, k] - offsets[k]) / scales[k]

``offsets`` / ``scales`` (default 0 / 1) put objectives of different units on one scale before
weighting. Pure; differentiable in every float argument (rewards are data in RL, but a learned
weight table works too).

Example::

    weights = jnp.array([[1.0, 0.0, 0.0],     # scenario 0: clicks only
                         [0.2, 0.3, 0.5]])    # scenario 1: purchase-heavy
    r = unified_reward(jnp.array([[1., 0., 0.], [1., 1., 1.]]), jnp.array([0, 1]), weights)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_float(name: str, x, shape: tuple[int, ...], what: str) -> None:
    if not hasattr(x, "shape") or tuple(x.shape) != shape:
        raise ValueError(f"{name} shape {getattr(x, 'shape', None)} must be {what} = {shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")


def unified_reward(rewards: jax.Array, scenario: jax.Array, weights: jax.Array, *,
                   offsets: jax.Array | None = None,
                   scales: jax.Array | None = None) -> jax.Array:
    """One reward per row from K business rewards and the row's scenario.

    Args:
      rewards: [B, K] float, the K objectives' rewards of each response.
      scenario: [B] int, each row's scenario id in [0, S).
      weights: [S, K] float, the objectives' weights per scenario.
      offsets, scales: optional [K] float; each objective becomes
        ``(rewards[:, k] - offsets[k]) / scales[k]`` before weighting (scales must be nonzero).

    Returns:
      [B] float (rewards' dtype).

    Raises:
      ValueError: a shape or dtype that does not fit, or a scenario id outside [0, S) (checked
        when ``scenario`` is concrete, i.e. outside jit).
    """
    if not hasattr(rewards, "ndim") or rewards.ndim != 2:
        raise ValueError(f"rewards must be [B, K], got shape {getattr(rewards, 'shape', None)}")
    b, k = rewards.shape
    _check_float("rewards", rewards, (b, k), "[B, K]")
    if not hasattr(weights, "ndim") or weights.ndim != 2 or weights.shape[1] != k:
        raise ValueError(f"weights shape {getattr(weights, 'shape', None)} must be [S, K] with "
                         f"K = {k} (rewards shape {rewards.shape})")
    _check_float("weights", weights, tuple(weights.shape), "[S, K]")
    if not hasattr(scenario, "shape") or tuple(scenario.shape) != (b,):
        raise ValueError(f"scenario shape {getattr(scenario, 'shape', None)} must be [B] = ({b},)")
    if not jnp.issubdtype(scenario.dtype, jnp.integer):
        raise ValueError(f"scenario must be integer ids, got dtype {scenario.dtype}")
    if not isinstance(scenario, jax.core.Tracer):
        lo, hi = int(jnp.min(scenario, initial=0)), int(jnp.max(scenario, initial=0))
        if lo < 0 or hi >= weights.shape[0]:
            raise ValueError(f"scenario ids must lie in [0, S={weights.shape[0]}), got range "
                             f"[{lo}, {hi}]")
    x = rewards
    if offsets is not None:
        _check_float("offsets", offsets, (k,), "[K]")
        x = x - offsets
    if scales is not None:
        _check_float("scales", scales, (k,), "[K]")
        x = x / scales
    return jnp.sum(weights[scenario] * x, axis=-1)
