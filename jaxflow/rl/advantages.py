"""Per-sequence advantages from per-sequence rewards, grouped by prompt.

Rewards come as [B] with the G responses of each prompt contiguous (B = num_prompts * G), the
layout a group sampler produces. All functions return [B] advantages (broadcast over tokens by
:func:`jaxflow.rl.policy_loss`) and carry no gradient concerns (rewards are data).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _grouped(rewards: jax.Array, group_size: int, min_group: int) -> jax.Array:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {rewards.shape}")
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        raise ValueError(f"rewards must be floating point, got dtype {rewards.dtype}")
    if not isinstance(group_size, int) or group_size < min_group:
        raise ValueError(f"group_size must be an int >= {min_group}, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"batch size {rewards.shape[0]} is not a multiple of group_size={group_size}")
    return rewards.reshape(-1, group_size)


def grpo_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> jax.Array:
    """GRPO: ``(r - mean_group(r)) / (std_group(r) + eps)``, or without the std (Dr. GRPO).

    The std is the population std over the group (ddof=0). A group whose rewards are all equal
    gets advantage 0 either way.
    """
    groups = _grouped(rewards, group_size, min_group=1)
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if normalize_std:
        centred = centred / (jnp.std(groups, axis=1, keepdims=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """RLOO: ``r_i - mean_{j != i} r_j`` within each group (needs group_size >= 2)."""
    groups = _grouped(rewards, group_size, min_group=2)
    total = jnp.sum(groups, axis=1, keepdims=True)
    leave_one_out_mean = (total - groups) / (group_size - 1)
    return (groups - leave_one_out_mean).reshape(-1)


def zero_positive_below_target(advantages: jax.Array, rewards: jax.Array,
                               target_reward: jax.Array) -> jax.Array:
    """SA-GCPO's target gate: positive advantages of rows whose reward is below the row's target
    reward become 0 (a response better than its group but not good enough for its request
    gets no push up); negative and zero advantages are unchanged.

    Args:
      advantages: [B] or [B, T].
      rewards, target_reward: [B] each (per request row).

    Returns:
      advantages' shape and dtype.
    """
    for name, x in (("rewards", rewards), ("target_reward", target_reward)):
        if not hasattr(x, "shape") or x.shape != advantages.shape[:1]:
            raise ValueError(f"{name} shape {getattr(x, 'shape', None)} must be [B] = "
                             f"{advantages.shape[:1]} to match advantages shape "
                             f"{advantages.shape}")
    below = rewards < target_reward
    if advantages.ndim == 2:
        below = below[:, None]
    return jnp.where(jnp.logical_and(below, advantages > 0),
                     jnp.zeros((), advantages.dtype), advantages)


def sa_gcpo_advantages(rewards: jax.Array, target_reward: jax.Array, group_size: int, *,
                       eps: float = 1e-6) -> jax.Array:
    """SA-GCPO (OxygenREC, arXiv 2512.22386): group-normalised advantages
    ``(r - mean) / (std + eps)`` per request group, then positive ones zeroed where the reward
    is below the row's ``target_reward`` [B]. Returns [B]."""
    adv = grpo_advantages(rewards, group_size, eps=eps)
    return zero_positive_below_target(adv, rewards, target_reward)
