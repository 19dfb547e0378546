"""A pure train step over sharded embeddings plus replicated dense parameters, in ``shard_map``.

``(state, ids, batch) -> (state, metrics)``: lookup (all stages of ``lookup.py``), the user's
loss on this device's batch slice, gradients w.r.t. the dense parameters (``psum`` over the
axis) and w.r.t. each device's deduplicated rows (sent to their owners), then the dense optax
update (``TrainState.apply_gradients``) and the sparse row update. The global loss is the mean
of the per-device losses, so with equal slices it is the global-batch mean. Every collective is
written out.

State: ``{"emb": ShardedEmbeddings state, "dense": TrainState | {}}``. The dense part is a
:class:`jaxflow.train.state.TrainState` (params, optimizer state, its own step; replicated), or
``{}`` for an embedding-only loss.

``backend``: "auto" (default) runs the fused host-kernel step (``fused_step.py``: pooling
straight from the table, dedup + row-gradient accumulation + optimizer in one in-place kernel)
where it applies (CPU, one device, float32 pooled tables, SGD / row-wise Adagrad); on a CPU
mesh of several devices, this ``shard_map`` step with the owners' updates done by that kernel
(``fused_step.owner_update_kernel``); elsewhere this step as written. "xla": always this step
in XLA (the reference, and the accelerator path); "host_kernel": the fused step or a
ValueError saying why not.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings.fused_step import (
    fused_unsupported,
    make_fused_train_step,
    owner_kernel_unsupported,
    owner_update_kernel,
)
from jaxflow.embeddings.lookup import ShardedEmbeddings, apply_owner_update, error_stats
from jaxflow.train.state import TrainState

#: loss_fn(dense_params, embeddings {table: [b, D] | [b, L, D]}, batch slice) -> (loss, aux dict)
LossFn = Callable[[Any, dict, dict], tuple[jax.Array, dict]]

#: the train step's implementations (``make_train_step(backend=...)``)
STEP_BACKENDS = ("auto", "xla", "host_kernel")


def step_backend(emb: ShardedEmbeddings, backend: str = "auto") -> str:
    """The implementation ``make_train_step(emb, ..., backend=backend)`` runs: "host_kernel"
    (the fused step), "xla+owner_kernel" (``shard_map`` step, owners update with the host
    kernel) or "xla". ValueError (one line) for an unknown backend, or "host_kernel" where it
    cannot run."""
    if backend not in STEP_BACKENDS:
        raise ValueError(f"embedding step backend {backend!r}; valid: {', '.join(STEP_BACKENDS)}")
    if backend == "xla":
        return "xla"
    reason = fused_unsupported(emb)
    if reason is None:
        return "host_kernel"
    if backend == "host_kernel":
        raise ValueError(f"embedding step backend 'host_kernel' unavailable: {reason}; valid: "
                         "'xla' or 'auto'")
    return "xla" if owner_kernel_unsupported(emb) else "xla+owner_kernel"


def state_specs(emb: ShardedEmbeddings, dense_state: Any = None) -> dict:
    """shard_map specs: embedding state as placed, dense state (a ``TrainState`` or ``{}``)
    replicated (``P()`` is a prefix of every leaf)."""
    return {"emb": emb.state_specs(), "dense": P()}


def abstract_state(emb: ShardedEmbeddings, dense_state: Any = None) -> dict:
    """The step's state as ``jax.ShapeDtypeStruct`` leaves carrying the shardings
    ``emb.init`` places them with (compile-only: nothing is allocated): ``{"emb": {"tables":
    {group: [rows, D] param_dtype}, "opt": {group: {name: [rows, ...]}}, "step": int32[]},
    "dense": dense_state}``; ``dense_state`` an abstract ``TrainState``
    (``TrainState.abstract``) or None for ``{}`` (an embedding-only loss)."""
    shardings = emb.state_shardings()
    tables, opt = {}, {}
    for g in emb.plan.groups:
        shape = g.global_shape(emb.plan.num_shards)
        tables[g.name] = jax.ShapeDtypeStruct(shape, jnp.dtype(emb.param_dtype),
                                              sharding=shardings["tables"][g.name])
        init = jax.eval_shape(lambda shape=shape, dim=g.dim: emb.optimizer.init(shape[0], dim))
        opt[g.name] = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                               sharding=shardings["opt"][g.name][k])
                       for k, v in init.items()}
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings["step"])
    return {"emb": {"tables": tables, "opt": opt, "step": step},
            "dense": {} if dense_state is None else dense_state}


def dense_params(dense_state: TrainState | dict) -> Any:
    """The dense parameters of ``state["dense"]`` (``{}`` for an embedding-only state)."""
    return dense_state.params if isinstance(dense_state, TrainState) else {}


def make_train_step(emb: ShardedEmbeddings, loss_fn: LossFn, *, donate: bool = True,
                    backend: str = "auto"):
    """Jitted ``step(state, ids, batch) -> (state, metrics)``; ``backend`` as in
    :func:`step_backend` (the module docstring).

    ``state = {"emb": ShardedEmbeddings state, "dense": TrainState | {}}``; ``ids`` and
    ``batch`` are split over ``emb.axis``. The dense optimizer is the TrainState's ``tx``.
    ``metrics``: loss, aux means, and the overflow / bad-id counts. A traced step cannot raise:
    call ``lookup.check_stats(metrics)`` (a host sync) every step or every few steps; a step
    that overflowed its capacity applied an incomplete update and the run must stop there.
    """
    impl = step_backend(emb, backend)
    if impl == "host_kernel":
        return make_fused_train_step(emb, loss_fn, donate=donate)
    owner_update = owner_update_kernel if impl == "xla+owner_kernel" else apply_owner_update
    axis, n = emb.axis, emb.plan.num_shards

    def local(state, ids, batch):
        embs, ctxs = emb.local_forward(state["emb"]["tables"], ids)
        dense = state["dense"]

        def objective(params, embs):
            loss, aux = loss_fn(params, emb.local_pool(embs, ctxs, ids), batch)
            return loss / n, (loss, aux)

        (_, (loss, aux)), (g_dense, g_rows) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True)(dense_params(dense), embs)
        new_state = {"emb": emb.local_update(state["emb"], ctxs, g_rows, owner_update), "dense": dense}
        if isinstance(dense, TrainState):
            new_state["dense"] = dense.apply_gradients(jax.lax.psum(g_dense, axis))
        metrics = {"loss": jax.lax.pmean(loss, axis),
                   **{k: jax.lax.pmean(v, axis) for k, v in aux.items()},
                   **error_stats(ctxs, axis)}
        return new_state, metrics

    def step(state, ids, batch):
        specs = state_specs(emb, state["dense"])
        fn = jax.shard_map(local, mesh=emb.mesh, in_specs=(specs, P(axis), P(axis)),
                           out_specs=(specs, P()), check_vma=False)
        return fn(state, ids, batch)

    return jax.jit(step, donate_argnums=(0,) if donate else ())
