"""One train state for every trainer: params, optimizer state, step and a slot for the rest.

``TrainState`` is a frozen dataclass registered as a JAX pytree (``params``, ``opt_state``,
``step`` and ``extra`` are children; the optax transformation ``tx`` is static metadata), so it
jits, donates, checkpoints (orbax saves it like a dict of its four fields) and travels through
``shard_map`` like any pytree. ``extra`` holds what a system keeps beside its optimizer: the
sharded embedding tables of a recommender, a MARL agent's pending gradient sum, an RL
reference copy. It is ``{}`` (no leaves) when unused.

Why not ``flax.training.train_state.TrainState``: it is linen's (it carries an ``apply_fn``
and has no slot for per-system state), and jaxflow's models are nnx modules split into a
graphdef and pure-dict params. optax's own helpers do the work: ``tx.init`` / ``tx.update`` /
``optax.apply_updates``, and ``optax.tree_map_params`` to shard the moments like the params.

Shapes: ``params`` any pytree of arrays; ``opt_state`` ``tx.init(params)``; ``step`` int32 [].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class TrainState:
    """``params``, ``opt_state = tx.init(params)``, ``step`` int32 [] and ``extra`` (a pytree).

    Build with :meth:`create` (arrays, placed in their shardings) or :meth:`abstract`
    (``jax.ShapeDtypeStruct`` leaves, nothing allocated); update with :meth:`apply_gradients`
    and :meth:`replace`.
    """

    params: Any
    opt_state: Any
    step: Any
    extra: Any
    tx: optax.GradientTransformation

    # ----------------------------------------------------------------------- construction
    @classmethod
    def create(cls, tx: optax.GradientTransformation, params: Any, shardings: Any = None, *,
               extra: Any = None, step: int = 0) -> "TrainState":
        """A fresh state around ``params``.

        ``shardings``: the params' shardings (a pytree of ``NamedSharding`` like ``params``), or
        None to leave placement to ``params`` (the optimizer state follows them). With
        shardings, the optimizer state is created directly in :func:`opt_state_shardings`.
        """
        extra = {} if extra is None else extra
        if shardings is None:
            return cls(params, tx.init(params), jnp.asarray(step, jnp.int32), extra, tx)
        sh = cls.shardings(tx, params, shardings)
        params = jax.device_put(params, sh.params)
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
        return cls(params, opt_state, jax.device_put(jnp.asarray(step, jnp.int32), sh.step), extra, tx)

    @classmethod
    def shardings(cls, tx: optax.GradientTransformation, params: Any, param_shardings: Any, *,
                  extra: Any = None) -> "TrainState":
        """The state's shardings, as a ``TrainState`` of ``NamedSharding`` leaves (what
        ``jax.jit(in_shardings=, out_shardings=)`` take). ``params`` may be abstract.
        ``extra``: the extra slot's shardings (default: no extra state)."""
        mesh = jax.tree.leaves(param_shardings)[0].mesh
        replicated = NamedSharding(mesh, PartitionSpec())
        return cls(param_shardings, opt_state_shardings(tx, params, param_shardings),
                   replicated, {} if extra is None else extra, tx)

    @classmethod
    def abstract(cls, tx: optax.GradientTransformation, params: Any, param_shardings: Any = None,
                 *, extra: Any = None) -> "TrainState":
        """``jax.ShapeDtypeStruct`` leaves carrying their shardings: a compile-only or
        ``Checkpointer.restore`` target; nothing is allocated."""
        extra = {} if extra is None else extra
        shape = jax.eval_shape(lambda p, e: cls(p, tx.init(p), jnp.zeros((), jnp.int32), e, tx),
                               params, extra)
        if param_shardings is None:
            return shape
        sh = cls.shardings(tx, params, param_shardings,
                           extra=jax.tree.map(lambda a: getattr(a, "sharding", None), extra))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shape, sh)

    # ----------------------------------------------------------------------- update
    def apply_gradients(self, grads: Any, **changes) -> "TrainState":
        """One optimizer step: ``tx.update`` (with params), ``optax.apply_updates``, step + 1.

        ``changes`` replace other fields at the same time (e.g. ``extra=``)."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return dataclasses.replace(self, params=optax.apply_updates(self.params, updates),
                                   opt_state=opt_state, step=self.step + 1, **changes)

    def replace(self, **changes) -> "TrainState":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


class _Static:
    """``tx`` as the pytree's static data: equal / hashed as ``tx``, printed as a fixed string,
    so a treedef's text (``jaxflow.sync.tree_digest`` hashes it) is the same in every process
    rather than carrying the transformation's function addresses."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Static) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return "tx"


_FIELDS = ("params", "opt_state", "step", "extra")
_KEYS = tuple(jax.tree_util.GetAttrKey(f) for f in _FIELDS)


def _flatten_with_keys(state: TrainState):
    return tuple(zip(_KEYS, (getattr(state, f) for f in _FIELDS))), _Static(state.tx)


def _flatten(state: TrainState):
    return tuple(getattr(state, f) for f in _FIELDS), _Static(state.tx)


def _unflatten(static: _Static, children) -> TrainState:
    params, opt_state, step, extra = children
    return TrainState(params, opt_state, step, extra, static.value)


jax.tree_util.register_pytree_with_keys(TrainState, _flatten_with_keys, _unflatten, _flatten)


def opt_state_shardings(tx: optax.GradientTransformation, params: Any, param_shardings: Any) -> Any:
    """Shardings of ``tx.init(params)``: each moment sharded like the param it mirrors
    (``optax.tree_map_params``), every other leaf (counts, schedules) replicated.

    ``params`` may be concrete or abstract; nothing is allocated."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731  (optax.masked / multi_transform)
    return optax.tree_map_params(tx, lambda p, s: p if masked(p) else s, abstract_opt, param_shardings,
                                 transform_non_params=lambda _: replicated, is_leaf=masked)
