"""Input checks of :func:`jaxflow.rl.policy_loss`: shapes, dtypes, and the arrays the configured
correction needs (one line naming the bad value and what is valid)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflow.rl.masks import as_bool_mask


def check_like(name: str, x: Any, ref: jax.Array, ndim_extra: int = 0) -> None:
    """Raises ValueError unless ``x`` is an array of ``ref``'s dtype and shape [B, T] (with
    ``ndim_extra=1``: [B, T, K], K >= 1)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if ndim_extra == 0 and x.shape != ref.shape:
        raise ValueError(f"{name} shape {x.shape} does not match logp shape {ref.shape} [B, T]")
    if ndim_extra == 1 and (x.ndim != 3 or x.shape[:2] != ref.shape or x.shape[2] < 1):
        raise ValueError(f"{name} shape {x.shape} must be [B, T, K] = [{ref.shape[0]}, "
                         f"{ref.shape[1]}, K>=1] to match logp shape {ref.shape}")
    if x.dtype != ref.dtype:
        raise ValueError(f"{name} dtype {x.dtype} does not match logp dtype {ref.dtype}")


def check_rows(name: str, x: Any, logp: jax.Array) -> None:
    """Raises ValueError unless ``x`` is a floating [B] array, one value per row of ``logp``."""
    if not hasattr(x, "shape") or x.shape != logp.shape[:1]:
        raise ValueError(f"{name} shape {getattr(x, 'shape', None)} must be [B] = "
                         f"{logp.shape[:1]} (one per row of logp shape {logp.shape})")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")


def validate_loss_inputs(logp, old_logp, advantages, mask, config, key, old_topk_logp, new_topk_logp,
                         behaviour_logp, uniforms=None, rewards=None, target_reward=None,
                         behaviour_topk_logp=None) -> None:
    """Raises ValueError naming the first of :func:`jaxflow.rl.policy_loss`'s arguments that is
    malformed (shape, dtype) or missing for ``config`` (a PolicyLossConfig): its SIS inputs,
    ``behaviour_logp``, sa_gcpo's ``rewards`` / ``target_reward``."""
    if not hasattr(logp, "ndim") or logp.ndim != 2:
        raise ValueError(f"logp must be a [B, T] array, got shape {getattr(logp, 'shape', None)}")
    if not jnp.issubdtype(logp.dtype, jnp.floating):
        raise ValueError(f"logp must be floating point, got dtype {logp.dtype}")
    check_like("old_logp", old_logp, logp)
    if not hasattr(mask, "shape") or mask.shape != logp.shape:
        raise ValueError(f"mask shape {getattr(mask, 'shape', None)} does not match logp shape "
                         f"{logp.shape} [B, T]")
    as_bool_mask(mask)  # dtype check: bool or numeric
    if not hasattr(advantages, "shape") or advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages shape {getattr(advantages, 'shape', None)} must be [B] = "
                         f"{logp.shape[:1]} or [B, T] = {logp.shape}")
    if not jnp.issubdtype(advantages.dtype, jnp.floating):
        raise ValueError(f"advantages must be floating point, got dtype {advantages.dtype}")
    if rewards is not None or target_reward is not None:
        if config.algo != "sa_gcpo":
            raise ValueError(f"rewards / target_reward apply to algo 'sa_gcpo', not "
                             f"{config.algo!r}")
        if rewards is None or target_reward is None:
            missing = "rewards" if rewards is None else "target_reward"
            raise ValueError(f"sa_gcpo's target gate needs both rewards= and target_reward= "
                             f"[B]; {missing} is None")
        check_rows("rewards", rewards, logp)
        check_rows("target_reward", target_reward, logp)
    if config.uses_sis:
        if key is None and uniforms is None:
            raise ValueError(f"correction {config.correction!r} needs key= (a PRNG key for the "
                             "SIS uniforms); got None")
        if uniforms is not None and getattr(uniforms, "shape", None) != logp.shape:
            raise ValueError(f"uniforms shape {getattr(uniforms, 'shape', None)} does not match "
                             f"logp shape {logp.shape} [B, T]")
        behaviour = config.sis_proposal == "behaviour"
        proposal = ("behaviour_topk_logp", behaviour_topk_logp) if behaviour else ("old_topk_logp", old_topk_logp)
        for name, arr in (proposal, ("new_topk_logp", new_topk_logp)):
            if arr is None:
                raise ValueError(f"correction {config.correction!r} needs {name}= [B, T, K] (log-probs at "
                                 f"{'the behaviour policy' if behaviour else 'pi_old'}'s top-K tokens); got None")
            check_like(name, arr, logp, ndim_extra=1)
        if proposal[1].shape != new_topk_logp.shape:
            raise ValueError(f"{proposal[0]} shape {proposal[1].shape} does not match "
                             f"new_topk_logp shape {new_topk_logp.shape}")
    if config.needs_behaviour_logp:
        if behaviour_logp is None:
            raise ValueError(f"correction {config.correction!r} needs behaviour_logp= [B, T] "
                             "(the sampler's log-probs); got None")
        check_like("behaviour_logp", behaviour_logp, logp)
    elif behaviour_logp is not None:
        check_like("behaviour_logp", behaviour_logp, logp)
