"""The engine's jitted device programs over a paged KV pool: prefill chunk, decode step, page copy.

The programs take whatever row count and page-table width the scheduler gives them: at most
``prefill_rows x prefill_chunk`` tokens and ``slots`` decode rows, in powers of two with
``EngineConfig.bucket_rows`` / ``narrow_tables`` (a few compiled shapes per program), or
exactly those (one shape each) without.

The arithmetic is the static sampler's (:func:`jaxflow.models.sampler.make_decoder`): the same
projections, RoPE, masked attention (:func:`jaxflow.models.attention.dot_product_attention` over
the row's pages gathered into a contiguous cache, token t at slot t), MLP and LM head, and the
same draw (:func:`jaxflow.models.sampler._draw` with per-row keys, token t of a row drawn with
``fold_in(row_key, t)``). Pools are donated, so page writes happen in place.

Routing record (R3, ``make_steps(record_routing=True)``, MoE models): prefill also returns each
MoE layer's experts and gates at every chunk position, and every decode step at the position it
feeds (``DecodeOut.routing_*``), computed from the router logits of the step's own forward as
:class:`jaxflow.models.moe.MoE` records them for the static sampler; the host collects them per
sequence (:mod:`jaxflow.rollout.records`).

Pool layout (the upstream paged-attention kernels'): per layer, keys and values
``[n_kv_heads, num_pages, page_size, head_dim]`` in the model's compute dtype (head_dim padded
to 128 lanes where decode runs the TPU kernel: :func:`jaxflow.rollout.pages.pool_head_dim`); token t of a row
lives in page ``page_table[t // page_size]`` at offset ``t % page_size``. Padding tokens and
empty slots write to the null page 0 (never read unmasked).

On a mesh (``make_steps(..., mesh=)``) the programs are :class:`jaxflow.mesh.MeshJit`: every
trace runs under ``jax.set_mesh(mesh)`` (so ``auto`` attention runs the platform's kernel per
shard in a ``shard_map``) and the pools stay sharded as :func:`pool_sharding` says: K/V heads
over the "model" axis where it divides them (tensor parallelism: each device holds the pages of
its own heads), page ids global. Decode rows are not split over other axes: an engine is one
tensor-parallel replica, and on a mesh with other axes (e.g. "data") every group along them
repeats the same work.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.models.attention_backends import HEAD_AXIS
from jaxflow.models.moe import expert_index_dtype
from jaxflow.models.sampler import LogitsHook, SamplingConfig, draw_with_dist, is_stop, sampled_topk
from jaxflow.models.transformer import Transformer
from jaxflow.rollout.paged_attention import paged_attention
from jaxflow.rollout.pages import NULL_PAGE
from jaxflow.rollout.prefill_attention import prefill_attention


class Pools(NamedTuple):
    """The paged KV pool: per layer k and v, each [n_kv_heads, num_pages, page_size, head_dim]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def pool_sharding(mesh: Mesh, n_kv_heads: int) -> NamedSharding:
    """The sharding of every K / V pool [KVH, P, S, D] on ``mesh``: K/V heads over the "model"
    axis when it is larger than 1 and divides ``n_kv_heads``; otherwise replicated."""
    tp = mesh.shape.get(HEAD_AXIS, 1)
    return NamedSharding(mesh, P(HEAD_AXIS) if tp > 1 and n_kv_heads % tp == 0 else P())


def empty_pools(*, n_layers: int, n_kv_heads: int, num_pages: int, page_size: int,
                head_dim: int, dtype, mesh: Mesh | None = None) -> Pools:
    """All-zero pools (zeros, not garbage: a masked NaN would poison the products); on ``mesh``
    sharded as :func:`pool_sharding` (each device allocates only its shard)."""
    return _pool_maker(n_layers, (n_kv_heads, num_pages, page_size, head_dim), jnp.dtype(dtype), mesh)()


@functools.lru_cache(maxsize=32)
def _pool_maker(n_layers: int, shape: tuple[int, ...], dtype, mesh: Mesh | None) -> Callable[[], Pools]:
    """One jitted call making every layer's K and V pool (a fresh engine's pools in one dispatch
    instead of 2 * n_layers)."""
    sharding = None if mesh is None else pool_sharding(mesh, shape[0])

    def make() -> Pools:
        return Pools(*(tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)) for _ in range(2)))

    return jax.jit(make, out_shardings=None if sharding is None else Pools(
        *((sharding,) * n_layers for _ in range(2))))


class DecodeOut(NamedTuple):
    """Draws per decode step and slot: token [n, B] int32 (pad_id where not live), logprob
    [n, B] f32 (of the distribution sampled from; 0 where not live), topk_logprobs [n, B, K]
    f32 and topk_indices [n, B, K] int32 (K = 0: empty), live [n, B] bool (a real token),
    routing_experts [n, B, L, k] (:func:`jaxflow.models.moe.expert_index_dtype`) and
    routing_gates [n, B, L, k] f32: each MoE layer's experts and gates at the position the step
    fed (``record_routing``; else [n, B, 0, 0])."""

    token: jax.Array
    logprob: jax.Array
    topk_logprobs: jax.Array
    topk_indices: jax.Array
    live: jax.Array
    routing_experts: jax.Array
    routing_gates: jax.Array


class Steps(NamedTuple):
    """Jitted programs (pools donated):

    prefill(state, pools, tokens [R, C], start [R], n_valid [R], page_table [R, W]) -> pools
        writes the keys/values of ``tokens[r, :n_valid[r]]`` at positions ``start[r] + i``;
        with ``record_routing`` -> (pools, (experts [R, C, L, k], gates [R, C, L, k])).
    decode(state, pools, tokens [B], lengths [B], page_table [B, W], key_data [B, ...], t [B],
           remaining [B], n_steps, hook_state=None) -> (pools, DecodeOut [n_steps, B, ...],
           hook_state): up to ``n_steps``
        (static) decode steps; row b feeds ``tokens[b]`` at position ``lengths[b] - 1``, draws
        its token ``t[b]`` with ``fold_in(key_b, t[b])`` and feeds it back, while it has
        ``remaining`` tokens to draw and has not drawn a stop id (``sampling.stop_ids``). Rows
        with remaining 0 (empty slots) write the null page only. The page table must cover every position written.
    copy_pages(pools, src [B], dst [B]) -> pools   page dst[i] := page src[i] in every layer.
    init_hook_rows(hook_state, rows [n], prompts [n, W], prompt_valid [n, W]) -> hook_state
        the logits hook's ``init`` for n sequences written to rows ``rows`` of the per-slot
        state (leaves [B, ...]; a row index >= B is dropped); hook_state None: the new state.
    one_step(model, pools, tokens [B], lengths [B], page_table [B, W], keys [B], t [B],
             live [B], hook_state) -> (pools, DecodeOut [B, ...], hook_state)
        not jitted: one decode step of ``decode``'s body, for programs built on it
        (:mod:`jaxflow.rollout.decode_loop`).
    """

    prefill: Callable
    decode: Callable
    copy_pages: Callable
    init_hook_rows: Callable
    one_step: Callable | None = None


def _write(pool: jax.Array, new: jax.Array, dest: jax.Array) -> jax.Array:
    """pool [KVH, P, S, D] with new [B, T, KVH, D] written at flat slots dest [B, T] (page * S +
    offset); a pool stored padded (D' > D, :func:`jaxflow.rollout.pages.pool_head_dim`) gets
    new's values zero-padded to D'."""
    kvh, p, s, d = pool.shape
    flat = pool.reshape(kvh, p * s, d)
    if new.shape[-1] != d:
        new = jnp.pad(new, [(0, 0)] * (new.ndim - 1) + [(0, d - new.shape[-1])])
    update = jnp.transpose(new.reshape(-1, kvh, d), (1, 0, 2)).astype(pool.dtype)
    return flat.at[:, dest.reshape(-1)].set(update).reshape(kvh, p, s, d)


def _slots(page_table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int
           ) -> jax.Array:
    """Flat pool slots [R, T] of ``positions`` [R, T] under ``page_table`` [R, W]; the null page
    where not ``valid``."""
    width = page_table.shape[1]
    page_idx = jnp.clip(positions // page_size, 0, width - 1)
    pages = jnp.take_along_axis(page_table, page_idx, axis=1)
    real = pages * page_size + positions % page_size
    pad = NULL_PAGE * page_size + positions % page_size
    return jnp.where(valid, real, pad)


def _mlp(block, h: jax.Array, record: bool) -> tuple[jax.Array, tuple | None]:
    """The block's MLP on h [B, T, d] -> (y [B, T, d], routing): with ``record`` and an MoE
    block, routing = (experts, gates) [B, T, k] as :class:`jaxflow.models.moe.MoE` records them
    (its router's top-k of the softmax, renormalised when ``norm_topk_prob``); else None."""
    if not (record and block.is_moe):
        return block.mlp(h), None
    mlp = block.mlp
    y, stats = mlp.apply(h)
    gates, experts = jax.lax.top_k(jax.nn.softmax(stats.router_logits, axis=-1), mlp.k)
    if mlp.norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    shape = h.shape[:2] + (mlp.k,)
    return y, (experts.reshape(shape).astype(expert_index_dtype(mlp.router.shape[1])), gates.reshape(shape))


def _stack_routing(per_layer: list, rows: int, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """Per MoE layer (experts, gates) [B, T, k] -> (experts, gates) [B, T, L, k]; none recorded:
    empty [B, 0, 0] (a decode step's record when ``record_routing`` is off)."""
    if not per_layer:
        return (jnp.zeros((rows, 0, 0), expert_index_dtype(max(n_experts, 1))),
                jnp.zeros((rows, 0, 0), jnp.float32))
    return tuple(jnp.stack([layer[i] for layer in per_layer], axis=2) for i in range(2))


@functools.lru_cache(maxsize=32)
def make_steps(graphdef: nnx.GraphDef, sampling: SamplingConfig, *, page_size: int,
               attention: str = "auto", interpret: bool = False, top_logprobs: int = 0,
               logit_noise_std: float = 0.0, logits_hook: LogitsHook | None = None,
               vocab_size: int = 0, mesh: Mesh | None = None, sampled_topk_of: bool = False,
               record_routing: bool = False) -> Steps:
    """The engine's programs for one model structure and sampling config (see Steps); on
    ``mesh``: MeshJit programs keeping the pools sharded (module docstring).

    ``top_logprobs=K``: each step also returns K top log-probs and ids: of the model
    (log_softmax of the raw logits, temperature 1) by default, or with ``sampled_topk_of`` of
    the distribution the token was drawn from (temperature, logit noise, hook and top-k / top-p
    applied: the behaviour policy's top-K that ``sis_b`` needs, as
    :func:`jaxflow.models.sampler.sampled_topk`), 0 where the row has no real token.
    ``record_routing`` (MoE models): prefill and every decode step also return each MoE layer's
    experts and gates per position fed (module docstring; :class:`DecodeOut`)."""

    def placed(pools: Pools) -> Pools:
        if mesh is None:
            return pools
        sharding = pool_sharding(mesh, pools.k[0].shape[0])
        return jax.lax.with_sharding_constraint(pools, Pools(*(
            (sharding,) * len(pools.k) for _ in range(2))))

    def prefill(state, pools: Pools, tokens, start, n_valid, page_table):
        model: Transformer = nnx.merge(graphdef, state)
        c = tokens.shape[1]
        offs = jnp.arange(c, dtype=jnp.int32)
        positions = start[:, None] + offs[None, :]
        valid = offs[None, :] < n_valid[:, None]
        dest = _slots(page_table, positions, valid, page_size)
        x = model._embed(tokens)
        new_k, new_v, routing = [], [], []
        for block, kp, vp in zip(model.layers, pools.k, pools.v):
            q, k, v = block.attn.project_qkv(block.attn_norm(x), positions)
            kp, vp = _write(kp, k, dest), _write(vp, v, dest)
            # query at position p sees the keys at positions <= p (the static prefill's mask
            # for real tokens); xla on CPU, the ragged kernel on TPU, the Triton one on GPU (auto)
            attn = prefill_attention(q, kp, vp, page_table, start, n_valid, backend=attention,
                                     interpret=interpret)
            x = x + block.attn.project_out(attn)
            y, routed = _mlp(block, block.mlp_norm(x), record_routing)
            x = x + y
            new_k.append(kp)
            new_v.append(vp)
            routing += [routed] if routed is not None else []
        pools = placed(Pools(tuple(new_k), tuple(new_v)))
        if not record_routing:
            return pools
        return pools, _stack_routing(routing, tokens.shape[0], model.config.n_experts)

    def one_step(model: Transformer, pools: Pools, tokens, lengths, page_table, keys, t, live,
                 hook_state):
        positions = (lengths - 1)[:, None]
        dest = _slots(page_table, positions, live[:, None], page_size)
        x = model._embed(tokens[:, None])
        new_k, new_v, routing = [], [], []
        for block, kp, vp in zip(model.layers, pools.k, pools.v):
            q, k, v = block.attn.project_qkv(block.attn_norm(x), positions)
            kp, vp = _write(kp, k, dest), _write(vp, v, dest)
            attn = paged_attention(q[:, 0], kp, vp, lengths, page_table, backend=attention,
                                   interpret=interpret)
            x = x + block.attn.project_out(attn[:, None])
            y, routed = _mlp(block, block.mlp_norm(x), record_routing)
            x = x + y
            new_k.append(kp)
            new_v.append(vp)
            routing += [routed] if routed is not None else []
        logits = model._logits(model.final_norm(x))[:, 0]
        step_keys = jax.vmap(jax.random.fold_in)(keys, t)
        token, logprob, dist = draw_with_dist(logits, step_keys, sampling, logit_noise_std, True,
                                              logits_hook, hook_state, t, None)
        if top_logprobs and sampled_topk_of:
            top_lp, top_idx = sampled_topk(dist, top_logprobs, live)
        elif top_logprobs:
            top_lp, top_idx = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_logprobs)
        else:
            top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
            top_idx = jnp.zeros((logits.shape[0], 0), jnp.int32)
        experts, gates = _stack_routing(routing, tokens.shape[0], model.config.n_experts)
        if routing:  # [B, 1, L, k] -> [B, L, k]
            experts, gates = experts[:, 0], gates[:, 0]
        out = DecodeOut(jnp.where(live, token, sampling.pad_id), jnp.where(live, logprob, 0.0),
                        top_lp, top_idx.astype(jnp.int32), live, experts, gates)
        if logits_hook is not None and logits_hook.update is not None:
            new_state = logits_hook.update(hook_state, out.token, None)
            hook_state = jax.tree.map(  # rows without a real token keep their state
                lambda new, old: jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
                new_state, hook_state)
        return placed(Pools(tuple(new_k), tuple(new_v))), out, hook_state

    def decode(state, pools: Pools, tokens, lengths, page_table, key_data, t, remaining,
               n_steps: int, hook_state=None):
        model: Transformer = nnx.merge(graphdef, state)
        keys = jax.random.wrap_key_data(key_data)

        def body(carry, _):
            pools, tokens, lengths, t, remaining, live, hook_state = carry
            pools, out, hook_state = one_step(model, pools, tokens, lengths, page_table, keys, t,
                                              live, hook_state)
            remaining = remaining - 1
            still = live & (remaining > 0)
            stop = is_stop(out.token, sampling)
            if stop is not None:
                still = still & ~stop
            carry = (pools, jnp.where(still, out.token, tokens), lengths + still, t + still,
                     remaining, still, hook_state)
            return carry, out

        carry = (pools, tokens, lengths, t, remaining, remaining > 0, hook_state)
        carry, outs = jax.lax.scan(body, carry, None, length=n_steps)
        return carry[0], outs, carry[-1]

    def init_hook_rows(hook_state, rows, prompts, prompt_valid):
        new = logits_hook.init(prompts, prompt_valid, vocab_size, None)
        if hook_state is None:
            return new
        return jax.tree.map(lambda old, x: old.at[rows].set(x, mode="drop"), hook_state, new)

    def copy_pages(pools: Pools, src, dst):
        def one(pool):
            return pool.at[:, dst].set(pool[:, src])
        return placed(Pools(tuple(map(one, pools.k)), tuple(map(one, pools.v))))

    jitted = Steps(jax.jit(prefill, donate_argnums=1),
                   jax.jit(decode, donate_argnums=(1, 9), static_argnums=8),
                   jax.jit(copy_pages, donate_argnums=0),
                   jax.jit(init_hook_rows, donate_argnums=0), one_step)
    if mesh is None:
        return jitted
    from jaxflow.mesh import MeshJit

    return Steps(*(MeshJit(fn, mesh) for fn in jitted[:4]), one_step)


_BY_IDENTITY: collections.OrderedDict = collections.OrderedDict()


def by_identity(graphdef: nnx.GraphDef, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` memoised on this very ``graphdef`` object and ``key`` (hashable options): a
    fresh engine on the same model finds its config and programs without hashing the GraphDef,
    which the programs' own caches do on every call (~0.3 ms each on a two-layer model). Holds
    the graphdef, so its id is not reused while cached; the 64 latest entries are kept."""
    full = (id(graphdef),) + key
    hit = _BY_IDENTITY.get(full)
    if hit is not None and hit[0] is graphdef:
        _BY_IDENTITY.move_to_end(full)
        return hit[1]
    value = make()
    _BY_IDENTITY[full] = (graphdef, value)
    while len(_BY_IDENTITY) > 64:
        _BY_IDENTITY.popitem(last=False)
    return value


def host_out(out: DecodeOut) -> DecodeOut:
    """A decode call's draws on the host; empty fields (top-K off, no routing record) are made
    here rather than fetched (each fetch is a transfer of its own)."""
    fetch = [i for i, x in enumerate(out) if x.size]
    fields = [np.empty(x.shape, x.dtype) for x in out]
    for i, x in zip(fetch, jax.device_get([out[i] for i in fetch])):
        fields[i] = x
    return DecodeOut(*fields)
