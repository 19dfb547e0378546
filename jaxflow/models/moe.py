"""Top-k routed mixture-of-experts SwiGLU layer: dense reference, capacity dispatch, and
expert parallelism over a mesh axis with ``shard_map`` all-to-all.

Routing follows Qwen3-MoE (Qwen team, 2025, "Qwen3 Technical Report"): softmax over the
router logits in float32, the top-k experts per token, their probabilities renormalised to
sum to 1 when ``norm_topk_prob``. Three ways to apply the experts, all plain functions:

* :func:`moe_dense` - every expert on every token, combined with the top-k weights. Exact
  reference (no token is ever dropped), memory O(tokens x experts x d_ff).
* :func:`moe_dispatch` - GShard-style (Lepikhin et al., 2020) fixed-capacity buffers: each
  expert takes at most ``capacity = ceil(capacity_factor * tokens * k / experts)`` (token,
  choice) pairs, first choices before second choices, tokens in order; the rest are dropped
  (they contribute 0, the residual carries the token). Equals :func:`moe_dense` when the
  capacity is at least the largest expert load.
* :func:`moe_expert_parallel` - the same on a mesh: tokens and experts both sharded over one
  mesh axis; each shard routes its tokens, ``all_to_all`` sends every expert its buffer rows,
  the expert FFNs run where their weights live, a second ``all_to_all`` brings the outputs
  back (Switch Transformer / GShard expert parallelism). Capacity is per (source shard,
  expert).

:func:`load_balancing_loss` is the Switch / Qwen3-MoE auxiliary loss over all MoE layers.

Routing replay (R3, for MoE RL): every path takes an optional ``experts`` [N, k] that replaces
the router's top-k choice (the rollout engine's recorded expert ids); the gates are the
trainer's own router probabilities at those experts, renormalised as usual, so the router still
gets its gradient -- as Megatron-LM's ``RouterReplay.get_replay_topk`` (REPLAY_FORWARD gathers
the scores at the replayed indices; ``megatron/core/transformer/moe/router_replay.py``,
NVIDIA/Megatron-LM@00caa53). :func:`expert_index_dtype` is the smallest unsigned integer that
holds the expert ids; :func:`routing_disagreement` the share of (token, layer) whose top-k set
differs between two routings.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

MOE_IMPLS = ("dense", "dispatch")


class Routing(NamedTuple):
    """Router output for N tokens: weights [N, k] f32, experts [N, k] int32, logits [N, E] f32."""

    weights: jax.Array
    experts: jax.Array
    logits: jax.Array


class MoEStats(NamedTuple):
    """Per-layer statistics: router logits [N, E] f32 and the dropped (token, choice) fraction."""

    router_logits: jax.Array
    dropped_fraction: jax.Array


def expert_index_dtype(n_experts: int) -> jnp.dtype:
    """The smallest unsigned integer dtype holding expert ids 0 .. n_experts - 1 (uint8 for
    <= 256 experts, uint16 for <= 65536, else uint32): the dtype of a routing record."""
    if not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts={n_experts!r}: need an int >= 1")
    for dtype in (jnp.uint8, jnp.uint16):
        if n_experts - 1 <= jnp.iinfo(dtype).max:
            return jnp.dtype(dtype)
    return jnp.dtype(jnp.uint32)


def routing_disagreement(experts_a: jax.Array, experts_b: jax.Array,
                         valid: jax.Array | None = None) -> jax.Array:
    """Share of (token, layer) whose top-k expert *set* differs between two routings.

    Args:
      experts_a, experts_b: [..., k] expert ids (any integer dtype; the order within the k
        choices does not matter).
      valid: optional [...] bool, the entries that count (e.g. response tokens x layers).

    Returns:
      a float32 scalar in [0, 1] (0 when nothing is valid).
    """
    a = jnp.sort(experts_a.astype(jnp.int32), axis=-1)
    b = jnp.sort(experts_b.astype(jnp.int32), axis=-1)
    differs = jnp.any(a != b, axis=-1)
    valid = jnp.ones(differs.shape, bool) if valid is None else jnp.broadcast_to(valid, differs.shape)
    return (jnp.sum(differs & valid) / jnp.maximum(jnp.sum(valid), 1)).astype(jnp.float32)


def route(x: jax.Array, router: jax.Array, *, k: int, norm_topk_prob: bool,
          experts: jax.Array | None = None) -> Routing:
    """Top-k routing. x [N, d], router [d, E] -> Routing (see class).

    ``experts`` [N, k] (any integer dtype): replay these experts instead of the top-k (R3); the
    weights are the router's probabilities at them (renormalised when ``norm_topk_prob``)."""
    logits = jnp.einsum("nd,de->ne", x, router.astype(x.dtype),
                        preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if experts is None:
        weights, experts = jax.lax.top_k(probs, k)
    else:
        if experts.shape != (x.shape[0], k):
            raise ValueError(f"replayed experts shape {experts.shape}; need [N, k] = [{x.shape[0]}, {k}]")
        experts = experts.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, experts.astype(jnp.int32), logits)


def _expert_ffn(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU per expert on its buffer: h [E, C, d] -> [E, C, d]."""
    dt = h.dtype
    gate = jnp.einsum("ecd,edf->ecf", h, w_gate.astype(dt))
    up = jnp.einsum("ecd,edf->ecf", h, w_up.astype(dt))
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down.astype(dt))


def moe_dense(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array) -> jax.Array:
    """All experts on all tokens. x [N, d]; w_gate, w_up [E, d, f]; w_down [E, f, d] -> [N, d]."""
    n_experts = w_gate.shape[0]
    out = _expert_ffn(jnp.broadcast_to(x[None], (n_experts,) + x.shape), w_gate, w_up, w_down)
    combine = jnp.sum(jax.nn.one_hot(routing.experts, n_experts, dtype=jnp.float32)
                      * routing.weights[..., None], axis=1)  # [N, E]
    return jnp.einsum("ne,end->nd", combine.astype(x.dtype), out)


def expert_capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """Buffer rows per expert: ceil(capacity_factor * n_tokens * k / n_experts), >= 1."""
    return max(1, math.ceil(capacity_factor * n_tokens * k / n_experts))


def _slots(experts: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Buffer slot of each (token, choice): experts [N, k] -> (slot [N, k] int32, kept [N, k]).

    Priority is choice-major (every token's first choice before any second choice), tokens in
    order within a choice; slot >= capacity means dropped."""
    n, k = experts.shape
    flat = experts.T.reshape(-1)  # [k * N], choice-major
    onehot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    slot = slot.reshape(k, n).T
    return slot, slot < capacity


def _dispatch_buffers(x, routing, n_experts, capacity):
    """(buffer [E, C, d], slot [N, k], kept [N, k])."""
    slot, kept = _slots(routing.experts, n_experts, capacity)
    n, k = slot.shape
    tok = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
    safe_slot = jnp.where(kept, slot, capacity)  # out of range -> dropped by mode="drop"
    buf = jnp.zeros((n_experts, capacity, x.shape[-1]), x.dtype)
    buf = buf.at[routing.experts, safe_slot].set(x[tok], mode="drop")
    return buf, slot, kept


def _combine(out, routing, slot, kept):
    """Weighted sum of each token's kept expert outputs: out [E, C, d] -> [N, d]."""
    capacity = out.shape[1]
    rows = out.at[routing.experts, jnp.minimum(slot, capacity - 1)].get(mode="clip")  # [N, k, d]
    w = jnp.where(kept, routing.weights, 0.0).astype(out.dtype)
    return jnp.einsum("nk,nkd->nd", w, rows)


def moe_dispatch(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array,
                 w_down: jax.Array, *, capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """Fixed-capacity dispatch on one device. Shapes as :func:`moe_dense`.

    Returns:
      (y [N, d], dropped_fraction scalar f32 = dropped (token, choice) pairs / (N * k)).
    """
    n_experts = w_gate.shape[0]
    capacity = expert_capacity(x.shape[0], routing.experts.shape[1], n_experts, capacity_factor)
    buf, slot, kept = _dispatch_buffers(x, routing, n_experts, capacity)
    y = _combine(_expert_ffn(buf, w_gate, w_up, w_down), routing, slot, kept)
    return y, 1.0 - jnp.mean(kept.astype(jnp.float32))


def moe_expert_parallel(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                        w_down: jax.Array, *, mesh, axis: str, k: int, norm_topk_prob: bool,
                        capacity_factor: float, experts: jax.Array | None = None
                        ) -> tuple[jax.Array, MoEStats]:
    """Expert-parallel MoE: tokens and experts sharded over mesh axis ``axis``.

    Args:
      x: [N, d] tokens, N divisible by the axis size (sharded over ``axis`` inside).
      router: [d, E] (replicated); w_gate, w_up: [E, d, f]; w_down: [E, f, d], E divisible
        by the axis size (expert e lives on shard e // (E / axis size)).
      mesh: the mesh (concrete or abstract) holding ``axis``.
      experts: optional [N, k] replayed experts (R3, :func:`route`), sharded like ``x``.

    Returns:
      (y [N, d], MoEStats(router_logits [N, E], dropped_fraction over all shards)).
    """
    n_shards = mesh.shape[axis]
    n_experts = w_gate.shape[0]
    if n_experts % n_shards or x.shape[0] % n_shards:
        raise ValueError(f"expert parallelism over {axis!r} (size {n_shards}) needs the expert "
                         f"count {n_experts} and the token count {x.shape[0]} divisible by it")
    local_experts = n_experts // n_shards
    capacity = expert_capacity(x.shape[0] // n_shards, k, n_experts, capacity_factor)

    def shard(x, router, w_gate, w_up, w_down, *replayed):
        routing = route(x, router, k=k, norm_topk_prob=norm_topk_prob,
                        experts=replayed[0] if replayed else None)
        buf, slot, kept = _dispatch_buffers(x, routing, n_experts, capacity)
        d = buf.shape[-1]
        # [E, C, d] -> [n_shards (destination), E_local, C, d]; receive [n_shards (source), ...]
        buf = buf.reshape(n_shards, local_experts, capacity, d)
        recv = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)
        h = recv.transpose(1, 0, 2, 3).reshape(local_experts, n_shards * capacity, d)
        out = _expert_ffn(h, w_gate, w_up, w_down)
        out = out.reshape(local_experts, n_shards, capacity, d).transpose(1, 0, 2, 3)
        back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(n_experts, capacity, d)
        y = _combine(back, routing, slot, kept)
        dropped = jax.lax.pmean(1.0 - jnp.mean(kept.astype(jnp.float32)), axis)
        return y, routing.logits, dropped

    y, logits, dropped = jax.shard_map(
        shard, mesh=mesh,
        in_specs=(P(axis), P(), P(axis), P(axis), P(axis)) + ((P(axis),) if experts is not None else ()),
        out_specs=(P(axis), P(axis), P()), check_vma=False,
    )(x, router, w_gate, w_up, w_down, *(() if experts is None else (experts,)))
    return y, MoEStats(logits, dropped)


def load_balancing_loss(router_logits: list[jax.Array] | tuple[jax.Array, ...], *, k: int,
                        n_experts: int) -> jax.Array:
    """Switch-Transformer auxiliary loss over all MoE layers, as Qwen3-MoE computes it.

    ``E * sum_e f_e * P_e`` where, over the concatenated tokens of every layer, ``f_e`` is the
    fraction of (token, choice) assignments [k, E] and ``P_e`` the mean router probability.
    Args: router_logits: per MoE layer [N, E]. Returns a scalar f32 (k for a uniform router).
    """
    logits = jnp.concatenate([jnp.asarray(l, jnp.float32) for l in router_logits], axis=0)
    probs = jax.nn.softmax(logits, axis=-1)
    _, experts = jax.lax.top_k(probs, k)
    tokens_per_expert = jnp.mean(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32), axis=0)
    return n_experts * jnp.sum(tokens_per_expert * jnp.mean(probs, axis=0)[None])


class MoE(nnx.Module):
    """Qwen3-MoE sparse block: router [d, E] and per-expert SwiGLU weights [E, d, f] / [E, f, d].

    ``config.moe_impl``: "dense" (reference) or "dispatch" (capacity ``config.capacity_factor``;
    expert-parallel over ``config.expert_axis`` when the surrounding ``jax.set_mesh`` mesh has
    that axis with size > 1, else on one device).
    """

    def __init__(self, config, *, rngs: nnx.Rngs):
        d, f, e = config.d_model, config.d_ff_expert, config.n_experts
        pdt = config.params_dtype

        def param(shape, std, axes):
            return nnx.Param(std * jax.random.normal(rngs.params(), shape, pdt),
                             out_sharding=axes, eager_sharding=False)

        self.router = param((d, e), d**-0.5, ("embed", None))
        self.w_gate = param((e, d, f), d**-0.5, ("expert", "embed", "mlp"))
        self.w_up = param((e, d, f), d**-0.5, ("expert", "embed", "mlp"))
        self.w_down = param((e, f, d), f**-0.5 / math.sqrt(2 * config.n_layers),
                            ("expert", "mlp", "embed"))
        self.k, self.norm_topk_prob = config.n_experts_per_token, config.norm_topk_prob
        self.impl, self.capacity_factor = config.moe_impl, config.capacity_factor
        self.expert_axis, self.dtype = config.expert_axis, config.compute_dtype
        # True: every __call__ keeps its routing (experts [B, T, k], gates [B, T, k] f32) as the
        # nnx.Intermediate "routing" -- how a sampler records it (:func:`pop_routing`)
        self.record_routing = False

    def apply(self, x: jax.Array, experts: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
        """x [B, T, d] -> (y [B, T, d], MoEStats with router_logits [B*T, E]).

        ``experts`` [B, T, k] (any integer dtype): replay these experts (R3, :func:`route`)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        replayed = None if experts is None else experts.reshape(b * t, -1)
        weights = (self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...])
        mesh = jax.sharding.get_abstract_mesh()
        if (self.impl == "dispatch" and not mesh.empty and self.expert_axis in mesh.shape
                and mesh.shape[self.expert_axis] > 1):
            y, stats = moe_expert_parallel(
                flat, *weights, mesh=mesh, axis=self.expert_axis, k=self.k,
                norm_topk_prob=self.norm_topk_prob, capacity_factor=self.capacity_factor,
                experts=replayed)
            return y.reshape(b, t, d), stats
        routing = route(flat, weights[0], k=self.k, norm_topk_prob=self.norm_topk_prob,
                        experts=replayed)
        if self.impl == "dispatch":
            y, dropped = moe_dispatch(flat, routing, *weights[1:],
                                      capacity_factor=self.capacity_factor)
        else:
            y, dropped = moe_dense(flat, routing, *weights[1:]), jnp.zeros((), jnp.float32)
        return y.reshape(b, t, d), MoEStats(routing.logits, dropped)

    def __call__(self, x: jax.Array) -> jax.Array:
        y, stats = self.apply(x)
        if self.record_routing:
            probs = jax.nn.softmax(stats.router_logits, axis=-1)
            gates, experts = jax.lax.top_k(probs, self.k)
            if self.norm_topk_prob:
                gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
            shape = x.shape[:2] + (self.k,)
            dtype = expert_index_dtype(self.router.shape[1])
            self.routing = nnx.Intermediate((experts.reshape(shape).astype(dtype), gates.reshape(shape)))
        return y


def record_routing(model) -> None:
    """Makes every MoE layer of ``model`` (a Transformer, e.g. merged inside a sampler's jitted
    function) keep its routing at each call; :func:`pop_routing` collects it."""
    for block in model.layers:
        if block.is_moe:
            block.mlp.record_routing = True


def pop_routing(model) -> tuple[jax.Array, jax.Array]:
    """The routing the MoE layers of ``model`` kept in their last call (:func:`record_routing`),
    removed from the model: (experts [B, T, L_moe, k] in :func:`expert_index_dtype`, gates
    [B, T, L_moe, k] f32), layers in order."""
    per_layer = [nnx.pop(block.mlp, nnx.Intermediate)["routing"].get_value()
                 for block in model.layers if block.is_moe]
    if not per_layer:
        raise ValueError("pop_routing: the model has no MoE layer (n_experts = 0): nothing to record")
    return tuple(jnp.stack([layer[i] for layer in per_layer], axis=2) for i in range(2))
