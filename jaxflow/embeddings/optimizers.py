"""Sparse row optimizers: applied to the rows a step touched, nothing else (FBGEMM-style).

An optimizer is ``init(num_rows, dim) -> state`` (per-row arrays, leading dim = rows) and
``apply(rows, grads, state_rows, step) -> (rows, state_rows)`` on gathered rows, where ``grads``
already sums every occurrence of a row in the global batch and ``step`` counts updates from 1.
The same ``apply`` serves sharded, replicated, host-resident and the dense reference
(``dense_update``), so they agree by construction up to the order of the gradient sums.

Adam is *lazy* (TF LazyAdam, FBGEMM's sparse Adam): an untouched row's moments do not decay;
bias correction uses the global step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")


@dataclasses.dataclass(frozen=True)
class SparseOptimizer:
    """A row-wise optimizer for embedding tables: ``init(num_rows, dim) -> state`` and ``apply(rows, grads,
    state_rows, step) -> (rows, state_rows)`` on the rows a step touched (float32[R, D]);
    ``hyper``: its hyperparameters as ``(name, value)`` pairs (what a fused kernel needs)."""
    name: str
    init: Callable[[int, int], dict[str, jax.Array]]
    apply: Callable[[jax.Array, jax.Array, dict[str, jax.Array], jax.Array], tuple[jax.Array, dict]]
    hyper: tuple[tuple[str, float], ...] = ()


def sgd(learning_rate: float) -> SparseOptimizer:
    """Plain SGD on the touched rows: ``rows - learning_rate * grads``; no state."""
    def init(num_rows, dim):
        return {}

    def apply(rows, grads, state, step):
        return rows - learning_rate * grads, state

    return SparseOptimizer("sgd", init, apply, (("learning_rate", learning_rate),))


def rowwise_adagrad(learning_rate: float, eps: float = 1e-8,
                    initial_accumulator: float = 0.0) -> SparseOptimizer:
    """One accumulator per row: ``acc += mean(g^2)``; ``row -= lr * g / (sqrt(acc) + eps)``."""

    def init(num_rows, dim):
        return {"accum": jnp.full((num_rows,), initial_accumulator, jnp.float32)}

    def apply(rows, grads, state, step):
        acc = state["accum"] + jnp.mean(jnp.square(grads), axis=-1)
        rows = rows - learning_rate * grads / (jnp.sqrt(acc)[:, None] + eps)
        return rows, {"accum": acc}

    return SparseOptimizer("rowwise_adagrad", init, apply,
                           (("learning_rate", learning_rate), ("eps", eps),
                            ("initial_accumulator", initial_accumulator)))


def adam(learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> SparseOptimizer:
    """Adam on the touched rows only: per-row first and second moments, bias correction by the global step."""
    def init(num_rows, dim):
        return {"m": jnp.zeros((num_rows, dim), jnp.float32), "v": jnp.zeros((num_rows, dim), jnp.float32)}

    def apply(rows, grads, state, step):
        t = step.astype(jnp.float32)
        m = b1 * state["m"] + (1 - b1) * grads
        v = b2 * state["v"] + (1 - b2) * jnp.square(grads)
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        return rows - learning_rate * m_hat / (jnp.sqrt(v_hat) + eps), {"m": m, "v": v}

    return SparseOptimizer("adam", init, apply,
                           (("learning_rate", learning_rate), ("b1", b1), ("b2", b2), ("eps", eps)))


def make_sparse_optimizer(name: str, learning_rate: float, **kwargs: Any) -> SparseOptimizer:
    """The sparse optimizer called ``name`` (``sgd``, ``rowwise_adagrad``, ``adam``); ValueError names the valid
    ones."""
    if name == "sgd":
        return sgd(learning_rate)
    if name == "rowwise_adagrad":
        return rowwise_adagrad(learning_rate, **kwargs)
    if name == "adam":
        return adam(learning_rate, **kwargs)
    raise ValueError(f"sparse optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


def take_rows(state: dict[str, jax.Array], rows: jax.Array) -> dict[str, jax.Array]:
    return {k: jnp.take(v, rows, axis=0) for k, v in state.items()}


def put_rows(state: dict[str, jax.Array], rows: jax.Array, values: dict[str, jax.Array]) -> dict:
    """``state[k][rows] = values[k]``; out-of-range rows (padding) are dropped."""
    return {k: v.at[rows].set(values[k], mode="drop") for k, v in state.items()}


def sum_duplicate_rows(rows: jax.Array, grads: jax.Array, num_rows: int):
    """Combines gradients of equal row ids (``-1`` = padding): (unique rows, summed grads).

    Returns rows int32[n] (``num_rows`` marks unused slots, so scatters drop them) and grads.
    """
    n = rows.shape[0]
    key = jnp.where(rows >= 0, rows, num_rows)
    uniq, inv = jnp.unique(key, size=n, fill_value=num_rows, return_inverse=True)
    summed = jax.ops.segment_sum(grads, inv.reshape(-1), num_segments=n)
    return uniq.astype(jnp.int32), summed


def sparse_apply(optimizer: SparseOptimizer, table: jax.Array, state: dict[str, jax.Array],
                 rows: jax.Array, grads: jax.Array, step: jax.Array):
    """Applies ``optimizer`` to ``table[rows]`` (rows distinct, ``len(table)`` = unused slot)."""
    safe = jnp.minimum(rows, table.shape[0] - 1)
    new_rows, new_state = optimizer.apply(table[safe], grads.astype(jnp.float32),
                                          take_rows(state, safe), step)
    # Materialise the new rows before the scatters so XLA updates the (donated) table in place
    # instead of copying it (it otherwise fuses the row reads into the scatter's operand).
    new_rows, new_state = jax.lax.optimization_barrier((new_rows, new_state))
    table = table.at[rows].set(new_rows.astype(table.dtype), mode="drop")
    return table, put_rows(state, rows, new_state)


def dense_update(optimizer: SparseOptimizer, table: jax.Array, state: dict[str, jax.Array],
                 dense_grad: jax.Array, touched: jax.Array, step: jax.Array):
    """Reference: the optimizer on the full table's dense gradient, kept where ``touched``."""
    new_rows, new_state = optimizer.apply(table, dense_grad, state, step)

    def keep(new, old):
        return jnp.where(touched.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)

    return keep(new_rows, table), {k: keep(new_state[k], state[k]) for k in state}
