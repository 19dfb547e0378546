"""Gradient accumulation over micro-batches, as pure functions.

A trainer consumes one version's rows in micro-batches and accumulates
``grad(loss_mb) * weight_mb``, where the weight is the micro-batch's share of the loss
normaliser, counted after the correction's mask (tokens for ``token-mean``, rows with a token
for the ``seq-mean-*`` aggregations: :func:`jaxflow.rl.policy_loss.aggregation_weight`). One
optimizer step with ``sum(grads) / sum(weights)`` then equals the full-batch GRPO step up to the
summation order of the gradient.

The policy is a :class:`jaxflow.train.state.TrainState` and the step is its
:meth:`~jaxflow.train.state.TrainState.apply_gradients`. The accumulator (version, micro-batches
done, gradient sum, weight sum, policy) flattens to a dict of host arrays
(:func:`flatten_accumulator`) so the experience store can commit it atomically with the consumed
rows, and restores with :func:`unflatten_accumulator`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.rl.advantages import grpo_advantages
from jaxflow.rl.grpo import GRPOConfig, MiniBatch, old_stats
from jaxflow.rl.grpo_step import _grpo_loss
from jaxflow.rl.policy_loss import aggregation_weight
from jaxflow.rl.rollout import RolloutBatch
from jaxflow.train.state import TrainState

# A row's payload: MiniBatch's array fields. MARL rows carry no behaviour top-K or routing
# records (sis_b / routing replay are the GRPO trainer's), so those fields stay None.
PAYLOAD_FIELDS = ("prompts", "prompt_lengths", "tokens", "mask", "behaviour_logp", "advantages")


def weighted_grad(params: Any, mb: MiniBatch, old: Any, *, fns, config: GRPOConfig,
                  key: jax.Array) -> tuple[Any, jax.Array]:
    """``(grad(loss_mb) * weight_mb, weight_mb)`` for gradient accumulation: ``weight_mb`` the
    micro-batch's loss normaliser after the correction's mask (RS, IcePop and the menu's masks
    drop tokens from it; :func:`jaxflow.rl.policy_loss.aggregation_weight`), a f32 scalar."""
    grads, (_, keep) = jax.grad(_grpo_loss, has_aux=True)(params, mb, old, fns=fns, config=config,
                                                          key=key)
    w = aggregation_weight(keep, config.loss.aggregation)
    return jax.tree.map(lambda g: g * w, grads), w


def apply_accumulated(policy: TrainState, grad_sum: Any, weight_sum: jax.Array) -> TrainState:
    """One optimizer step (:meth:`TrainState.apply_gradients`) with the accumulated mean
    gradient ``grad_sum / weight_sum`` (``grad_sum`` like ``policy.params``, ``weight_sum`` [])."""
    return policy.apply_gradients(jax.tree.map(lambda g: g / weight_sum, grad_sum))


def accumulate(grad_sum: Any, weight_sum: jax.Array, params: Any, mb: MiniBatch, *, fns,
               config: GRPOConfig, key: jax.Array) -> tuple[Any, jax.Array]:
    """One micro-batch into the accumulator: pi_old stats, weighted gradient and the sums, in
    one program (one dispatch per micro-batch instead of one per op and leaf). ``grad_sum`` /
    ``weight_sum`` None (a version's first micro-batch): the sums start at this one's."""
    old = old_stats(fns, params, None, mb, config=config)
    g, w = weighted_grad(params, mb, old, fns=fns, config=config, key=key)
    if grad_sum is None:
        return g, w
    return jax.tree.map(jnp.add, grad_sum, g), weight_sum + w


def accumulate_apply(policy: TrainState, grad_sum: Any, weight_sum: jax.Array | None,
                     mb: MiniBatch, *, fns, config: GRPOConfig, key: jax.Array) -> TrainState:
    """A version's last micro-batch into the accumulator and the optimizer step, one program:
    :func:`apply_accumulated` of :func:`accumulate`."""
    g, w = accumulate(grad_sum, weight_sum, policy.params, mb, fns=fns, config=config, key=key)
    return apply_accumulated(policy, g, w)


def group_rows(batch: RolloutBatch, group_size: int, normalize_std: bool = True
               ) -> list[dict[str, np.ndarray]]:
    """One input's G trajectories -> G row payloads with group-normalised advantages."""
    adv = np.asarray(grpo_advantages(jnp.asarray(batch.rewards), group_size,
                                     normalize_std=normalize_std), np.float32)
    arrays = (batch.prompts, batch.prompt_lengths, batch.tokens, batch.mask,
              batch.behaviour_logp, adv)
    return [{f: a[t] for f, a in zip(PAYLOAD_FIELDS, arrays)} | {"reward": batch.rewards[t]}
            for t in range(group_size)]


def stack_rows(payloads: list[dict[str, np.ndarray]]) -> MiniBatch:
    """Row payloads -> a host MiniBatch (rows in the given order)."""
    return MiniBatch(*(np.stack([p[f] for p in payloads]) for f in PAYLOAD_FIELDS))


def relative_param_diff(a: Any, b: Any) -> float:
    """Max over leaves of ``||a - b||_2 / ||b||_2`` (host or device pytrees of equal structure)."""
    def leaf(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    return max(jax.tree.leaves(jax.tree.map(leaf, a, b)))


class Accumulator(NamedTuple):
    """A trainer part-way through a version: ``micro`` micro-batches of ``version`` are in
    ``grad_sum`` / ``weight_sum`` (None before the first), ``policy`` is its train state."""

    version: int
    micro: int
    grad_sum: Any
    weight_sum: Any
    policy: TrainState


def flatten_accumulator(acc: Accumulator) -> dict[str, np.ndarray]:
    """Host arrays ``version``, ``micro``, ``weight_sum``, ``g<i>`` (gradient leaves) and
    ``p<i>`` (the ``TrainState``'s leaves: params, optimizer state, step), for
    :meth:`ExperienceStore.commit`. An accumulator with no micro-batch in (``micro`` 0, sums
    None) has no ``weight_sum`` and no ``g<i>``."""
    out = {"version": np.asarray(acc.version), "micro": np.asarray(acc.micro)}
    if acc.grad_sum is not None:
        out["weight_sum"] = np.asarray(jax.device_get(acc.weight_sum))
    for i, x in enumerate(jax.tree.leaves(jax.device_get(acc.grad_sum))):
        out[f"g{i}"] = np.asarray(x)
    for i, x in enumerate(jax.tree.leaves(jax.device_get(acc.policy))):
        out[f"p{i}"] = np.asarray(x)
    return out


def unflatten_accumulator(state: dict, like_policy: TrainState, shardings: TrainState
                          ) -> Accumulator:
    """Inverse of :func:`flatten_accumulator`: the policy has ``like_policy``'s structure and
    is placed with ``shardings`` (the trainer's ``TrainState`` of ``NamedSharding``)."""
    pdef = jax.tree.structure(like_policy)
    gdef = jax.tree.structure(like_policy.params)
    policy = jax.tree.unflatten(pdef, [state[f"p{i}"] for i in range(pdef.num_leaves)])
    policy = jax.tree.map(jax.device_put, policy, shardings)
    if "weight_sum" not in state:  # no micro-batch of this version in yet
        return Accumulator(int(state["version"]), int(state["micro"]), None, None, policy)
    grads = jax.tree.unflatten(gdef, [state[f"g{i}"] for i in range(gdef.num_leaves)])
    grads = jax.tree.map(jax.device_put, grads, shardings.params)
    return Accumulator(int(state["version"]), int(state["micro"]), grads,
                       jnp.asarray(state["weight_sum"]), policy)
