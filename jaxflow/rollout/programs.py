"""The rollout engine's device programs with abstract arguments, for ``--compile-only``.

:func:`engine_programs` returns the programs a :class:`jaxflow.rollout.RolloutEngine` on
``mesh`` runs, each the engine's own jitted function (:func:`jaxflow.rollout.model_step.
make_steps` with ``mesh=``): a prefill chunk call and a decode call over every slot, with the
weights as SparseRL-Sync's bf16 replica holds them (the model's parameter shardings) and the
K/V pools sharded by heads over "model" (:func:`jaxflow.rollout.model_step.pool_sharding`).
Nothing is allocated. :func:`engine_figures` gives the per-chip pool bytes and the decode
roofline the compiled report is read against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program, count_params, mesh_note, sds
from jaxflow.models.sampler import SamplingConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rollout.engine import EngineConfig
from jaxflow.rollout.model_step import Pools, make_steps, pool_sharding
from jaxflow.rollout.pages import bucket, pages_for, pool_head_dim

__all__ = ["engine_figures", "engine_programs"]


def engine_figures(model: TransformerConfig, mesh: Mesh, config: EngineConfig,
                   param_dtype=jnp.bfloat16, *, n_params: int | None = None,
                   stored_head_dim: int | None = None) -> dict:
    """Per-device sizes of an engine on ``mesh``: ``kv_bytes_per_token`` (all layers, K and V),
    ``pool_bytes`` (the whole pool, at ``stored_head_dim``: the pool's last axis,
    :func:`jaxflow.rollout.pages.pool_head_dim`; default the model's head_dim) and
    ``pool_bytes_per_device`` (its head shard),
    ``n_params`` (counted from the model when not given), ``weights_bytes`` /
    ``weights_bytes_per_device`` (``param_dtype`` leaves over the tensor-parallel axis),
    ``max_seq_len`` and ``pages_per_seq``."""
    max_len = config.max_seq_len or model.max_seq_len
    itemsize = jnp.dtype(model.compute_dtype).itemsize
    per_token = 2 * model.n_layers * model.n_kv_heads * model.head_dim * itemsize
    pool = config.num_pages * config.page_size * per_token * (
        stored_head_dim or model.head_dim) // model.head_dim
    heads_here = pool_sharding(mesh, model.n_kv_heads).shard_shape(
        (model.n_kv_heads, 1, 1, 1))[0]
    tp = mesh.shape.get("model", 1)
    n_params = _n_params(model) if n_params is None else n_params
    weights = n_params * jnp.dtype(param_dtype).itemsize
    return {"kv_bytes_per_token": per_token, "pool_bytes": pool, "n_params": n_params,
            "pool_bytes_per_device": pool * heads_here // model.n_kv_heads,
            "weights_bytes": weights, "weights_bytes_per_device": weights // tp,
            "max_seq_len": max_len, "pages_per_seq": pages_for(max_len, config.page_size)}


def _n_params(model: TransformerConfig) -> int:
    from flax import nnx

    from jaxflow.models.transformer import Transformer

    return count_params(nnx.state(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))),
                                  nnx.Param))


def engine_programs(model: TransformerConfig, mesh: Mesh, config: EngineConfig,
                    sampling: SamplingConfig, *, prompt_len: int, context: int | None = None,
                    param_dtype=jnp.bfloat16, prefix: str = "rollout/engine/") -> list[Program]:
    """[prefill, decode] of an engine on ``mesh`` (abstract arguments, see the module doc).

    Args:
      model: the policy's TransformerConfig; mesh: the engine's mesh (K/V heads over "model").
      config: the engine's shapes (slots, pages, chunk, decode_steps, attention backend).
      sampling: its SamplingConfig.
      prompt_len: the longest prompt (the prefill call's page-table width).
      context: tokens per sequence the decode call's roofline assumes every slot holds
        (default: max_seq_len, the worst case); the compiled decode call reads page tables of
        the full ``pages_per_seq`` width either way.
      param_dtype: the weights' float dtype (bf16: what SparseRL-Sync's receiver holds; None:
        the model's param_dtype, e.g. the f32 params a one-job GRPO run publishes).
    """
    from jaxflow.train.lm_state import lm_functions

    fns = lm_functions(model, mesh)
    param_dtype = jnp.dtype(model.param_dtype if param_dtype is None else param_dtype)
    params = jax.tree.map(
        lambda a, s: sds(a.shape, param_dtype if jnp.issubdtype(a.dtype, jnp.floating)
                         else a.dtype, s), fns.abstract_params(), fns.param_shardings)
    state = fns.nnx_state(params)
    steps = make_steps(fns.graphdef, sampling, page_size=config.page_size,
                       attention=config.attention, top_logprobs=config.top_logprobs,
                       vocab_size=model.vocab_size, mesh=mesh, record_routing=config.record_routing)
    n_params = count_params(params)
    max_len = config.max_seq_len or model.max_seq_len
    head_dim = pool_head_dim(  # the engine's own choice (128 lanes where decode runs the TPU kernel)
        n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, head_dim=model.head_dim,
        rows=config.slots, num_pages=config.num_pages, page_size=config.page_size,
        pages_per_seq=pages_for(max_len, config.page_size), dtype=model.compute_dtype,
        backend=config.attention, interpret=config.interpret, mesh=mesh)
    fig = engine_figures(model, mesh, config, param_dtype, n_params=n_params,
                         stored_head_dim=head_dim)
    width = fig["pages_per_seq"]
    pool = sds((model.n_kv_heads, config.num_pages, config.page_size, head_dim),
               model.compute_dtype, pool_sharding(mesh, model.n_kv_heads))
    pools = Pools((pool,) * model.n_layers, (pool,) * model.n_layers)
    rep = NamedSharding(mesh, P())
    i32 = jnp.int32
    key_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    d_attn = model.n_heads * model.head_dim
    note = mesh_note(mesh) + (f"; {fig['pool_bytes_per_device'] / 2**30:.2f} GiB of KV pool "
                              f"and {fig['weights_bytes_per_device'] / 2**30:.2f} GiB of "
                              f"{jnp.dtype(param_dtype).name} weights per device")

    r, c = config.prefill_rows, config.prefill_chunk
    pw = bucket(pages_for(prompt_len, config.page_size), width)
    prefill_tokens = r * c
    prefill = Program(
        prefix + "prefill", steps.prefill,
        (state, pools, sds((r, c), i32, rep), sds((r,), i32, rep), sds((r,), i32, rep),
         sds((r, pw), i32, rep)), mesh, kind="sample",
        model_flops=2.0 * n_params * prefill_tokens
        + 4.0 * model.n_layers * prefill_tokens * prompt_len * d_attn,
        model_bytes=fig["weights_bytes"] + r * prompt_len * fig["kv_bytes_per_token"],
        tokens=prefill_tokens,
        note=note + f"; {r} prompts x {c}-token chunk, tables {pw} pages")

    b, n = config.slots, config.decode_steps
    ctx = fig["max_seq_len"] if context is None else int(context)
    decode = Program(
        prefix + "decode", steps.decode,
        (state, pools, sds((b,), i32, rep), sds((b,), i32, rep), sds((b, width), i32, rep),
         sds((b,) + tuple(key_shape), jnp.uint32, rep), sds((b,), i32, rep),
         sds((b,), i32, rep), n), mesh, kind="sample",
        model_flops=n * (2.0 * n_params * b + 4.0 * model.n_layers * b * ctx * d_attn),
        model_bytes=n * (fig["weights_bytes"] + b * ctx * fig["kv_bytes_per_token"]),
        tokens=b * n,
        note=note + f"; {b} slots x {n} step(s), {ctx}-token context per slot "
                    f"(tables {width} pages of {config.page_size})")
    return [prefill, decode]
