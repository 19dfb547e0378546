"""NestPipe's five stages over host-resident tables and a DLRM, as plain functions.

  1. ``load_batch``      data prefetch: the synthetic generator writes one batch in host memory;
  2. ``to_device``       host-to-device copy of the dense features and labels;
  3. ``route_keys``      key routing: dedup each table's ids, bucket the distinct keys by owner;
  4. ``retrieve_rows``   embedding retrieval: read those rows (and their optimizer state) from
                         the host tables into a fixed-capacity device buffer;
  5. ``Compute``         forward/backward and the update (dense Adam, sparse row optimizer),
                         followed by ``write_back`` of the updated rows to the host tables.

Every pipeline in ``pipelines.py`` calls exactly these functions; they differ only in when.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxflow.embeddings.host import HostBatch, HostTable, write_back
from jaxflow.embeddings.lookup import CapacityOverflowError
from jaxflow.embeddings.optimizers import SparseOptimizer
from jaxflow.embeddings.pooling import pool_bags
from jaxflow.embeddings.routing import check_ids_host
from jaxflow.embeddings.spec import IdPolicy, TableSpec

__all__ = ["DeviceBatch", "Routed", "load_batch", "reorder_batch", "to_device", "route_keys", "retrieve_rows",
           "make_compute", "write_back", "clone_tables"]


class DeviceBatch(NamedTuple):
    dense: jax.Array  # f32[B, F]
    label: jax.Array  # f32[B]


class Routed(NamedTuple):
    """Distinct keys of one batch per table, and where each id's row sits in the buffer."""

    unique_ids: dict[str, np.ndarray]  # int[n] sorted distinct rows
    inverse: dict[str, np.ndarray]  # int32[B, L] buffer slot per id (-1 = padding)
    owner_counts: dict[str, np.ndarray]  # int[num_shards] distinct keys per owning shard


def load_batch(gen, step: int, batch_size: int) -> dict:
    """Stage 1: batch ``step`` in host memory."""
    return gen.batch(step, batch_size)


def reorder_batch(batch: dict, order: np.ndarray) -> dict:
    """The batch with its samples permuted by ``order`` (key-centric clustering)."""
    return {"dense": batch["dense"][order], "label": batch["label"][order],
            "sparse": {k: v[order] for k, v in batch["sparse"].items()}}


def to_device(batch: dict, device: Any = None) -> DeviceBatch:
    """Stage 2: host-to-device copy of the dense part of the batch."""
    return DeviceBatch(jax.device_put(batch["dense"], device), jax.device_put(batch["label"], device))


def route_keys(specs: list[TableSpec], ids: dict[str, np.ndarray], num_shards: int = 1) -> Routed:
    """Stage 3: per table, apply the id policy, dedup, and count distinct keys per owner shard
    (``id % num_shards``, the row-wise placement)."""
    uniques, inverses, owners = {}, {}, {}
    for spec in specs:
        x = np.asarray(ids[spec.name])
        check_ids_host(spec.name, x, spec.vocab_size, spec.id_policy)
        if spec.id_policy == IdPolicy.HASH_MODULO.value:
            x = np.where(x >= 0, x % spec.vocab_size, -1)
        valid = x >= 0
        uniq, inv = np.unique(x[valid], return_inverse=True)
        full = np.full(x.shape, -1, np.int32)
        full[valid] = inv
        uniques[spec.name], inverses[spec.name] = uniq, full
        owners[spec.name] = np.bincount(uniq % num_shards, minlength=num_shards)
    return Routed(uniques, inverses, owners)


def retrieve_rows(tables: dict[str, HostTable], routed: Routed, capacity: int,
                  device: Any = None) -> HostBatch:
    """Stage 4: read the routed rows and optimizer state from the host tables, pad to
    ``capacity`` and place them on ``device``. Raises CapacityOverflowError, never drops."""
    rows, opt, inverse = {}, {}, {}
    for name, table in tables.items():
        uniq = routed.unique_ids[name]
        if uniq.size > capacity:
            raise CapacityOverflowError(f"table {name!r}: {uniq.size} distinct ids > capacity {capacity}")
        values, state = table.read_rows(uniq)
        pad = lambda a: np.concatenate([a, np.zeros((capacity - a.shape[0],) + a.shape[1:], a.dtype)])
        rows[name] = jax.device_put(pad(values), device)
        opt[name] = {k: jax.device_put(pad(v), device) for k, v in state.items()}
        inverse[name] = jax.device_put(routed.inverse[name], device)
    return HostBatch(rows, opt, inverse, dict(routed.unique_ids))


def clone_tables(tables: dict[str, HostTable]) -> dict[str, HostTable]:
    """In-memory copies (values and optimizer state) so pipelines start from the same tables."""
    out = {}
    for name, t in tables.items():
        values, state = t.to_numpy()
        c = HostTable(t.spec, t.optimizer, values)
        c.load(values, state)
        out[name] = c
    return out


def make_compute(apply: Callable, specs: list[TableSpec], optimizer: SparseOptimizer,
                 dense_tx: optax.GradientTransformation, micro_batches: int = 1):
    """Stage 5, jitted: ``(dense_state, rows, opt, inverse, batch) -> (dense_state, rows, opt, loss)``.

    ``dense_state = {"params", "opt", "step"}``; ``rows[name]`` f32[C, D] is the buffer of
    retrieved rows, ``inverse[name]`` int32[B, L] its slot per id. The loss is the batch mean of
    the logistic loss. ``micro_batches = N > 1`` is the frozen window: rows and dense params stay
    fixed while the N micro-batches' gradients are summed (each micro-batch's loss is its sum /
    B), then one update is applied — the same update up to the order of the batch sum.
    """
    names = [s.name for s in specs]
    pooling = {s.name: s.pooling for s in specs}

    def per_sample_loss(params, rows, inverse, dense, label):
        emb = jnp.stack([pool_bags(rows[n], inverse[n], pooling[n]) for n in names], axis=1)
        return optax.sigmoid_binary_cross_entropy(apply(params, dense, emb), label)

    def grads(params, rows, inverse, batch: DeviceBatch):
        b = batch.label.shape[0]
        if micro_batches == 1:
            obj = lambda p, r: jnp.mean(per_sample_loss(p, r, inverse, batch.dense, batch.label))
            return jax.value_and_grad(obj, argnums=(0, 1))(params, rows)
        if b % micro_batches:
            raise ValueError(f"batch {b} is not divisible by micro_batches={micro_batches}")
        split = lambda x: x.reshape((micro_batches, b // micro_batches) + x.shape[1:])
        xs = ({n: split(inverse[n]) for n in names}, split(batch.dense), split(batch.label))

        def body(carry, x):
            inv, dense, label = x
            obj = lambda p, r: jnp.sum(per_sample_loss(p, r, inv, dense, label)) / b
            loss, g = jax.value_and_grad(obj, argnums=(0, 1))(params, rows)
            return jax.tree.map(jnp.add, carry, (loss, g)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), (params, rows)))
        (loss, g), _ = jax.lax.scan(body, zero, xs)
        return loss, g

    def compute(dense_state, rows, opt, inverse, batch: DeviceBatch):
        params, step = dense_state["params"], dense_state["step"] + 1
        loss, (g_params, g_rows) = grads(params, rows, inverse, batch)
        new_rows, new_opt = {}, {}
        for n in names:
            new_rows[n], new_opt[n] = optimizer.apply(rows[n], g_rows[n], opt[n], step)
        updates, dopt = dense_tx.update(g_params, dense_state["opt"], params)
        dense_state = {"params": optax.apply_updates(params, updates), "opt": dopt, "step": step}
        return dense_state, new_rows, new_opt, loss

    return jax.jit(compute)
