"""What an alignment method trains from a warm start: all of its weights, or LoRA adapters over
it (:mod:`jaxflow.models.lora`), with the optimizer and the merge its sampler needs."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding

from jaxflow.models import lora
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import LMFunctions, lm_functions, model_optimizer


class Policy(NamedTuple):
    """What every method trains (:func:`lora_policy`).

    Attributes:
      model_cfg: the trained model (the warm start's, with ``lora`` when on).
      fns: its :class:`LMFunctions` (the losses' forward; with adapters the base is frozen).
      params: the initial params (pure dict): the warm start, or it plus fresh adapters (B = 0).
      tx: the optimizer (with LoRA: moments and updates for the adapter leaves only).
      to_sampler: trained params -> the base-shaped params the warm start's sampler takes
        (identity, or the jitted :func:`jaxflow.models.lora.merge`).
    """

    model_cfg: TransformerConfig
    fns: LMFunctions
    params: Any
    tx: optax.GradientTransformation
    to_sampler: Callable[[Any], Any]


def lora_policy(model_cfg: TransformerConfig, lora_cfg: lora.LoraConfig, fns: LMFunctions, warm: Any,
                tx: optax.GradientTransformation, replicated: NamedSharding) -> Policy:
    """The :class:`Policy` for ``lora_cfg``: rank 0 returns ``model_cfg``, ``fns``, ``warm`` and
    ``tx`` themselves (full fine-tuning, unchanged); otherwise ``model_cfg`` with those adapters,
    ``warm`` plus fresh adapters (B = 0: it computes exactly the warm start, so it also serves
    as DPO's frozen reference), ``tx`` on the adapters only, and a merge for the sampler (all
    placed ``replicated``)."""
    if not lora_cfg.enabled:
        return Policy(model_cfg, fns, warm, tx, lambda params: params)
    cfg = dataclasses.replace(model_cfg, lora=lora_cfg)
    params = jax.device_put(lora.add_adapters(warm, cfg), replicated)
    merge = jax.jit(functools.partial(lora.merge, lora=lora_cfg), out_shardings=replicated)
    return Policy(cfg, lm_functions(cfg, replicated.mesh), params, model_optimizer(tx, cfg), merge)


def lora_info(policy: Policy) -> dict:
    """The adapters' size: rank, alpha, targets, trainable (adapter) and frozen (base) params."""
    cfg = policy.model_cfg.lora
    count = lambda tree: int(sum(x.size for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"rank": cfg.rank, "alpha": cfg.alpha, "targets": list(cfg.targets),
            "adapter_params": count(lora.adapters(policy.params)),
            "base_params": count(lora.strip(policy.params))}
