"""Low-precision parameters with float32 optimizer state (Micikevicius et al., 2018, "Mixed
Precision Training"): the model holds bf16 weights, the optimizer keeps an f32 master copy and
f32 moments, so updates far below bf16's resolution still accumulate.

``f32_master(tx)`` wraps any optax transformation: ``init`` upcasts the params into the master
copy and initialises ``tx`` on it; ``update`` upcasts the gradients, runs ``tx`` on the master,
and returns the updates that move each low-precision param exactly onto the new master rounded
to its dtype (``optax.apply_updates(params, updates) == cast(master, params.dtype)``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class F32MasterState(NamedTuple):
    """master: f32 copy of the params; inner: the wrapped transformation's (f32) state."""

    master: Any
    inner: Any


def _f32(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def f32_master(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on an f32 master copy of (e.g. bf16) params; see the module docstring."""

    def init(params):
        master = _f32(params)
        return F32MasterState(master, tx.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("f32_master needs params in update(grads, state, params)")
        updates, inner = tx.update(_f32(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # p + (round(m) - p) in f32 is exact (both are low-precision values), so applying
        # these updates lands each param on round(m) bit for bit.
        out = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(jnp.float32)
                           - p.astype(jnp.float32), master, params)
        return out, F32MasterState(master, inner)

    return optax.GradientTransformation(init, update)
