"""Single-device dense reference: ``jnp.take`` + pooling, dense gradient, optimizer on the rows
the batch touched. The sharded, replicated and host-resident paths are tested against it."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.embeddings.optimizers import SparseOptimizer, dense_update
from jaxflow.embeddings.spec import IdPolicy, Pooling, TableSpec


def reference_ids(spec: TableSpec, ids: jax.Array) -> jax.Array:
    """Policy-applied ids (-1 = padding); ids that break an "error" policy become padding."""
    ids = jnp.asarray(ids, jnp.int32)
    if spec.id_policy == IdPolicy.HASH_MODULO.value:
        return jnp.where(ids >= 0, ids % spec.vocab_size, -1)
    return jnp.where((ids >= 0) & (ids < spec.vocab_size), ids, -1)


def reference_lookup(specs: list[TableSpec], tables: dict, ids: dict) -> dict:
    out = {}
    for s in specs:
        i = reference_ids(s, ids[s.name])
        valid = (i >= 0)[..., None]
        rows = jnp.where(valid, jnp.take(tables[s.name], jnp.maximum(i, 0), axis=0), 0)
        if s.pooling == Pooling.NONE.value:
            out[s.name] = rows
        else:
            pooled = rows.sum(axis=1)
            if s.pooling == Pooling.MEAN.value:
                pooled = pooled / jnp.maximum(valid.sum(axis=1), 1)
            out[s.name] = pooled
    return out


def touched_rows(spec: TableSpec, ids: jax.Array) -> jax.Array:
    i = reference_ids(spec, ids).reshape(-1)
    return jnp.zeros((spec.vocab_size,), bool).at[jnp.where(i >= 0, i, spec.vocab_size)].set(
        True, mode="drop")


def reference_step(specs: list[TableSpec], optimizer: SparseOptimizer, tables: dict, opt: dict,
                   step: int, ids: dict, loss: Callable[[dict], jax.Array]):
    """One update: dense gradient of ``loss(reference_lookup(...))``, optimizer on touched rows."""
    tables = {k: jnp.asarray(v) for k, v in tables.items()}
    grads = jax.grad(lambda t: loss(reference_lookup(specs, t, ids)))(tables)
    new_t, new_o = {}, {}
    for s in specs:
        new_t[s.name], new_o[s.name] = dense_update(
            optimizer, tables[s.name], {k: jnp.asarray(v) for k, v in opt[s.name].items()},
            grads[s.name], touched_rows(s, ids[s.name]), jnp.int32(step))
    return ({k: np.asarray(v) for k, v in new_t.items()},
            {k: {kk: np.asarray(vv) for kk, vv in v.items()} for k, v in new_o.items()})
