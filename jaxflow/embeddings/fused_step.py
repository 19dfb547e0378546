"""The CPU train step over one device's tables with the compiled host kernels (``host_kernel``).

``make_train_step`` (``step.py``) picks it on a one-device CPU mesh (``backend="auto"``):
same signature, state and metrics as the ``shard_map`` step, same results (pooling and SGD
bit-identical; row-wise Adagrad within float rounding). Per group of tables:

  1. keys: the id policy and the packed row of every id (``routing.table_keys``), in XLA;
  2. ``host_kernel.pool_from_table``: bags pooled straight from the table (no dedup, no
     capacity-sized gathered rows);
  3. the user's loss and its gradient w.r.t. the dense parameters and the pooled bags (XLA);
  4. ``host_kernel.fused_update``: dedup by direct addressing, per-row gradient accumulation
     and the optimizer's row update, in place in the donated table and accumulator.

On a CPU mesh of several devices the ``shard_map`` step stays (dedup, All2All, pooling in
XLA) but each owner's update of its shard is :func:`owner_update_kernel`: the received row
gradients summed per row (in the order ``lookup.apply_owner_update`` sums them) and the
optimizer applied in place by the same kernel, instead of a sort-based unique, capacity-sized
gathers and scatters.

Nothing is capacity-sized: ``capacity`` only sets the overflow flag the metrics report (as
the XLA step does, so ``check_stats`` raises at the same point), and the update applied is
complete even then. Supported: CPU, one device on the embedding axis, float32 tables, pooled
("sum" / "mean") tables, SGD or row-wise Adagrad, and the host kernels loading
(``host_kernel.unavailable``: else XLA, with one warning); :func:`fused_unsupported` says why not.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxflow.embeddings import host_kernel
from jaxflow.embeddings.lookup import ShardedEmbeddings, check_id_dtype, narrow_ids
from jaxflow.embeddings.routing import SENTINEL, table_keys
from jaxflow.embeddings.spec import Pooling
from jaxflow.train.state import TrainState
from pallas_kernels import dispatch

_KINDS = {"sgd": host_kernel.KIND_SGD, "rowwise_adagrad": host_kernel.KIND_ADAGRAD}


def _not_on_cpu(mesh) -> str | None:
    """Why the program is not built for CPU: the mesh's devices, or the platform the program is
    being built for (``dispatch.backend_platform``: a TPU / GPU target lowered on a CPU mesh)."""
    platforms = {d.platform for d in mesh.devices.flat}
    if platforms != {"cpu"}:
        return f"devices are {sorted(platforms)}, the host kernels run on cpu only"
    building = dispatch.backend_platform()
    if building != "cpu":
        return f"the program is built for {building}, the host kernels run on cpu only"
    return None


def kernel_unsupported(mesh, param_dtype, optimizer) -> str | None:
    """Why the fused host kernel cannot update rows of ``param_dtype`` with ``optimizer`` (a
    ``SparseOptimizer``) on ``mesh``'s devices, or None when it can: a CPU program, float32,
    SGD / row-wise Adagrad, and ``host_kernel.unavailable()`` (the FFI layout and numba's
    threads, checked once per process) None."""
    why = _not_on_cpu(mesh)
    if why is not None:
        return why
    if jnp.dtype(param_dtype) != jnp.float32:
        return f"param_dtype {jnp.dtype(param_dtype)}, the kernels take float32"
    if optimizer.name not in _KINDS:
        return f"optimizer {optimizer.name!r}, the kernels apply {' / '.join(_KINDS)}"
    return host_kernel.unavailable()


def owner_kernel_unsupported(emb: ShardedEmbeddings) -> str | None:
    """Why :func:`owner_update_kernel` cannot update ``emb``'s shards, or None when it can."""
    return kernel_unsupported(emb.mesh, emb.param_dtype, emb.optimizer)


def fused_unsupported(emb: ShardedEmbeddings) -> str | None:
    """Why the fused host-kernel step cannot run ``emb``'s tables, or None when it can: the
    owner update's conditions, one device, pooled tables only."""
    why = owner_kernel_unsupported(emb)
    if why is not None:
        return why
    if emb.plan.num_shards != 1:
        return f"axis {emb.axis!r} has {emb.plan.num_shards} devices, the fused step takes 1"
    unpooled = [s.name for s in emb.plan.specs if s.pooling == Pooling.NONE.value]
    if unpooled:
        return f"tables {unpooled} are unpooled (pooling='none'), the kernels pool sum / mean"
    return None


def owner_update_kernel(optimizer, shard: jax.Array, opt_shard: dict, recv_ids: jax.Array,
                        recv_grads: jax.Array, step: jax.Array):
    """``lookup.apply_owner_update`` with the fused host kernel (per device, inside
    ``shard_map``): shard f32[S, D], recv_ids int32[P, Cb] (-1 = none), recv_grads f32[P, Cb,
    D] -> (new shard, new optimizer state); every requested row's gradients summed in
    ``recv`` order, then SGD / row-wise Adagrad on the row, in place."""
    hyper = dict(optimizer.hyper)
    keys = jnp.where(recv_ids >= 0, recv_ids, SENTINEL).reshape(-1).astype(jnp.int32)
    n = keys.shape[0]
    desc, _ = host_kernel.bag_layout([(n, 1, False)])
    accum = opt_shard.get("accum", jnp.zeros((1,), jnp.float32))
    table, accum, _ = host_kernel.fused_update(
        shard, accum, keys, desc, recv_grads.reshape(n, -1).astype(jnp.float32), _KINDS[optimizer.name],
        hyper["learning_rate"], hyper.get("eps", 0.0), n)
    return table, ({"accum": accum} if "accum" in opt_shard else {})


def _group_keys(emb: ShardedEmbeddings, group, ids: dict):
    """(keys int32[N] of the group's tables concatenated, bag desc, bags, [(name, bags)], bad)."""
    keys, bags, names, bad = [], [], [], jnp.int32(0)
    for layout in emb.plan.group_tables(group.name):
        spec = layout.spec
        x = ids[spec.name]
        check_id_dtype(spec.name, x)
        if x.ndim != 2:
            raise ValueError(f"table {spec.name!r}: ids of shape {tuple(x.shape)}; valid: [batch, bag] "
                             "(-1 = padding)")
        k, b = table_keys(layout, narrow_ids(x, spec.vocab_size, spec.id_policy), group.shard_rows, 1)
        keys.append(k.reshape(-1))
        bags.append((x.shape[0], x.shape[1], spec.pooling == Pooling.MEAN.value))
        names.append((spec.name, x.shape[0]))
        bad = bad + b
    desc, n_bags = host_kernel.bag_layout(bags)
    return jnp.concatenate(keys), desc, n_bags, names, bad


def make_fused_train_step(emb: ShardedEmbeddings, loss_fn: Callable[[Any, dict, dict], tuple],
                          *, donate: bool = True):
    """Jitted ``step(state, ids, batch) -> (state, metrics)`` with the host kernels: the
    contract of ``step.make_train_step`` (state ``{"emb", "dense"}``, metrics loss / aux /
    overflow / bad_ids / max_unique). ValueError (one line) where :func:`fused_unsupported`."""
    reason = fused_unsupported(emb)
    if reason is not None:
        raise ValueError(f"embedding step backend 'host_kernel' unavailable: {reason}; valid: "
                         "backend='xla' (or 'auto', which picks it)")
    hyper = dict(emb.optimizer.hyper)
    kind, lr, eps = _KINDS[emb.optimizer.name], hyper["learning_rate"], hyper.get("eps", 0.0)

    def step(state, ids, batch):
        tables, opt = state["emb"]["tables"], state["emb"]["opt"]
        pooled, routes, bad = {}, {}, jnp.int32(0)
        for g in emb.plan.groups:
            keys, desc, n_bags, names, b = _group_keys(emb, g, ids)
            out = host_kernel.pool_from_table(tables[g.name], keys, desc, n_bags)
            start = 0
            for name, rows in names:
                pooled[name] = out[start:start + rows]
                start += rows
            routes[g.name] = (keys, desc, names)
            bad = bad + b
        dense = state["dense"]
        params = dense.params if isinstance(dense, TrainState) else {}

        def objective(params, pooled):
            loss, aux = loss_fn(params, pooled, batch)
            return loss, (loss, aux)

        (_, (loss, aux)), (g_dense, g_pooled) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True)(params, pooled)
        new_tables, new_opt = {}, {}
        overflow, n_unique = jnp.int32(0), jnp.int32(0)
        for g in emb.plan.groups:
            keys, desc, names = routes[g.name]
            grad = jnp.concatenate([g_pooled[name] for name, _ in names]).astype(jnp.float32)
            accum = opt[g.name].get("accum", jnp.zeros((1,), jnp.float32))
            new_tables[g.name], accum, stats = host_kernel.fused_update(
                tables[g.name], accum, keys, desc, grad, kind, lr, eps, emb.capacity)
            new_opt[g.name] = {"accum": accum} if "accum" in opt[g.name] else {}
            n_unique, overflow = n_unique + stats[0], overflow + stats[1]
        new_state = {"emb": {"tables": new_tables, "opt": new_opt, "step": state["emb"]["step"] + 1},
                     "dense": dense.apply_gradients(g_dense) if isinstance(dense, TrainState) else dense}
        metrics = {"loss": loss, **aux, "overflow": overflow, "bad_ids": bad, "max_unique": n_unique}
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())
