"""The jitted GRPO update: one optimizer step per mini-batch, in one pass
(:func:`update_step`) or with gradient accumulation over micro-batches
(:func:`accumulated_update_step`, ``GRPOConfig.microbatches`` > 1), and the cached jitted
programs a trainer runs (:func:`compiled_functions`). The loss, pi_old's statistics and the
config are :mod:`jaxflow.rl.grpo_step`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxflow.mesh import jit_on
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl import sis
from jaxflow.rl.grpo_step import GRPOConfig, MiniBatch, OldStats, _grpo_loss, grpo_loss, make_rl_optimizer, old_stats
from jaxflow.rl.policy_loss import aggregation_weight
from jaxflow.train.lm_state import LMFunctions, OptimConfig, lm_functions, model_optimizer
from jaxflow.train.state import TrainState

__all__ = ["update_step", "split_microbatches", "accumulated_update_step", "compiled_functions"]


def update_step(policy: TrainState, mb: MiniBatch, old: OldStats | None, *, fns: LMFunctions,
                config: GRPOConfig, key: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step: ``(policy, mini-batch, old stats, key) -> (policy, metrics)``.

    ``policy`` is a :class:`jaxflow.train.state.TrainState` (params a pure dict); the new one
    has ``step + 1``. Metrics are device scalars [] (:func:`grpo_loss`'s and ``grad_norm``).
    ``old=None``: pi_old's log-probs from this update's own forward (:func:`grpo_loss`)."""
    grads, metrics = jax.grad(grpo_loss, has_aux=True)(policy.params, mb, old, fns=fns,
                                                        config=config, key=key)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return policy.apply_gradients(grads), metrics


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[b, ...] rows -> [m, b / m, ...]: micro-batch j holds rows j, j + m, j + 2m, ... (so
    each takes the same share of every data shard's contiguous block of rows: no row moves
    between devices when ``m`` divides the rows per shard)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _combine_metrics(metrics: dict[str, jax.Array], weights: jax.Array) -> dict[str, jax.Array]:
    """Per-micro-batch metrics [m] -> scalars: the max for ``max_*`` / ``*_max`` names, else the
    mean weighted by ``weights`` [m] (the plain mean when every weight is 0)."""
    total = jnp.sum(weights)

    def one(name, x):
        if name.startswith("max_") or name.endswith("_max"):
            return jnp.max(x, axis=0)
        w = weights.astype(jnp.promote_types(x.dtype, jnp.float32))
        weighted = jnp.sum(x * w, axis=0) / jnp.maximum(total, 1.0).astype(w.dtype)
        return jnp.where(total > 0, weighted, jnp.mean(x, axis=0)).astype(x.dtype)

    return {k: one(k, v) for k, v in metrics.items()}


def accumulated_update_step(policy: TrainState, mb: MiniBatch, old: OldStats | None, *,
                            fns: LMFunctions, config: GRPOConfig, key: jax.Array
                            ) -> tuple[TrainState, dict[str, jax.Array]]:
    """:func:`update_step` with gradient accumulation over ``config.microbatches`` = M.

    The mini-batch's b rows (and ``old``'s) are split into M micro-batches of b / M
    (:func:`split_microbatches`); a ``lax.scan`` computes each one's loss gradient g_j and its
    weight w_j, the micro-batch's share of the loss normaliser (unmasked tokens after the
    correction's mask for ``token-mean``, rows with such a token for the ``seq-mean-*``
    aggregations: :func:`jaxflow.rl.policy_loss.aggregation_weight`), and accumulates
    ``sum_j w_j g_j`` in f32 (at least). One optimizer step then takes
    ``sum_j w_j g_j / sum_j w_j``: the whole mini-batch's gradient up to summation order, since
    ``w_j g_j`` is the gradient of the micro-batch's unnormalised sum. SIS's uniforms are drawn
    for the whole mini-batch from ``key`` and sliced, so SIS accepts the tokens :func:`update_step`
    accepts. Metrics as :func:`update_step`'s: per micro-batch, then their ``w``-weighted
    mean (``max_*`` / ``*_max``: the max); ``grad_norm`` of the accumulated gradient.

    Shapes: ``mb`` fields [b, ...], ``old`` fields [b, N(, K)] or None (pi_old from each
    micro-batch's own forward, ``config.old_from_update``); b divisible by M."""
    m = config.microbatches
    split = functools.partial(split_microbatches, m=m)
    uniforms = None
    if config.loss.uses_sis:  # the draw update_step's policy_loss makes, micro-batch by micro-batch
        uniforms = split(sis.sis_uniforms(key, mb.tokens.shape))
    xs = (jax.tree.map(split, mb), None if old is None else jax.tree.map(split, old), uniforms)
    agg = config.loss.aggregation
    params = policy.params

    def body(grad_sum, x):
        mb_j, old_j, u_j = x
        grads, (metrics, keep) = jax.grad(_grpo_loss, has_aux=True)(
            params, mb_j, old_j, fns=fns, config=config, key=key, uniforms=u_j)
        w = aggregation_weight(keep, agg)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype) * w.astype(s.dtype),
                                grad_sum, grads)
        return grad_sum, (metrics, w)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)),
                         params)
    grad_sum, (metrics, weights) = jax.lax.scan(body, zeros, xs)
    total = jnp.maximum(jnp.sum(weights), 1.0)  # all masked: every g_j is 0, and so is the step
    grads = jax.tree.map(lambda s, p: (s / total.astype(s.dtype)).astype(p.dtype), grad_sum, params)
    metrics = _combine_metrics(metrics, weights)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return policy.apply_gradients(grads), metrics


@functools.lru_cache(maxsize=64)
def compiled_functions(model_cfg: TransformerConfig, mesh: Mesh, config: GRPOConfig,
                       optim: OptimConfig, total_steps: int):
    """(fns, tx, policy shardings, jitted old_stats, jitted update) shared by equal configs,
    so the cells of a sweep reuse compilations.

    The policy shardings are a ``TrainState`` of ``NamedSharding`` (optimizer moments sharded
    like their params); ``update(policy, mb, old, key=)`` donates ``policy``: :func:`update_step`,
    or :func:`accumulated_update_step` when ``config.microbatches > 1``."""
    fns = lm_functions(model_cfg, mesh)
    tx = model_optimizer(make_rl_optimizer(optim, total_steps), model_cfg)
    shardings = TrainState.shardings(tx, fns.abstract_params(), fns.param_shardings)
    old_fn = jit_on(mesh, functools.partial(old_stats, fns, config=config))
    step = update_step if config.microbatches == 1 else accumulated_update_step
    update = jit_on(mesh, functools.partial(step, fns=fns, config=config),
                    out_shardings=(shardings, None), donate_argnums=(0,))
    return fns, tx, shardings, old_fn, update
