"""Embedding bag: gather rows of a table and sum (or average) them per bag.

``out[b] = sum_l table[ids[b, l]]`` over the valid (``>= 0``) ids of bag b, divided by their
count for ``mode="mean"`` (an empty bag gives zeros). Bags are padded ``int32[B, L]`` rows with
``-1`` padding; this is the segment-sum layout with segment id = row (``segment_ids = b``).
``embedding_bag_reference`` below defines the semantics in plain jnp.

Forward kernel: a grid over (bag blocks, column blocks); each program holds its column slice of
the table and loops over its bags and their ids with dynamic row reads, accumulating in f32.
Backward kernel (the table gradient, a scatter-add): a grid over column blocks only, so every
program owns its slice of the gradient and adds the bag cotangents row by row in a fixed order
(no races, deterministic). The ids get no gradient. On CPU the kernel runs only with
``interpret=True``; the default CPU path (``jaxflow.embeddings.pooling``) is the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MODES = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class EmbeddingBagBlockSizes:
    """Bags per program (block_b) and table columns per program (block_d)."""

    block_b: int = 8
    block_d: int = 128

    @classmethod
    def get_default(cls) -> "EmbeddingBagBlockSizes":
        return cls()


def embedding_bag_reference(table: jax.Array, ids: jax.Array, mode: str = "sum") -> jax.Array:
    """table [V, D], ids int32[B, L] (-1 = padding) -> [B, D] bag sums / means (pure jnp)."""
    valid = ids >= 0
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0).astype(jnp.float32)
    out = jnp.sum(jnp.where(valid[..., None], rows, 0.0), axis=1)
    if mode == "mean":
        out = out / jnp.maximum(jnp.sum(valid, axis=1), 1)[:, None].astype(jnp.float32)
    return out.astype(table.dtype)


def _bag_weights(ids: jax.Array, mode: str) -> jax.Array:
    """f32[B, 1]: 1 for sum, 1/count for mean."""
    if mode == "sum":
        return jnp.ones((ids.shape[0], 1), jnp.float32)
    return 1.0 / jnp.maximum(jnp.sum(ids >= 0, axis=1), 1)[:, None].astype(jnp.float32)


def _fwd_kernel(ids_ref, w_ref, table_ref, out_ref, *, bag_len: int):
    block_b, block_d = out_ref.shape

    def bag(b, _):
        def item(l, acc):
            i = ids_ref[b, l]
            row = table_ref[pl.ds(jnp.maximum(i, 0), 1), :].astype(jnp.float32)
            return acc + jnp.where(i >= 0, row, 0.0)

        acc = jax.lax.fori_loop(0, bag_len, item, jnp.zeros((1, block_d), jnp.float32))
        out_ref[pl.ds(b, 1), :] = (acc * w_ref[b, 0]).astype(out_ref.dtype)
        return 0

    jax.lax.fori_loop(0, block_b, bag, 0)


def _bwd_kernel(ids_ref, g_ref, out_ref, *, n_bags: int, bag_len: int):
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def bag(b, _):
        g = g_ref[pl.ds(b, 1), :].astype(jnp.float32)

        def item(l, _):
            i = ids_ref[b, l]
            safe = jnp.maximum(i, 0)
            cur = out_ref[pl.ds(safe, 1), :].astype(jnp.float32)
            out_ref[pl.ds(safe, 1), :] = jnp.where(i >= 0, cur + g, cur).astype(out_ref.dtype)
            return 0

        return jax.lax.fori_loop(0, bag_len, item, 0)

    jax.lax.fori_loop(0, n_bags, bag, 0)


def _pad_to(x, axis, multiple, value=0):
    size = x.shape[axis]
    pad = -size % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _forward(table, ids, weights, bs: EmbeddingBagBlockSizes, interpret: bool):
    n_bags, bag_len = ids.shape
    vocab, dim = table.shape
    block_d = min(bs.block_d, dim)
    block_b = min(bs.block_b, n_bags)
    ids_p = _pad_to(ids, 0, block_b, -1)
    w_p = _pad_to(weights, 0, block_b)
    table_p = _pad_to(table, 1, block_d)
    grid = (ids_p.shape[0] // block_b, table_p.shape[1] // block_d)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel, bag_len=bag_len),
        grid=grid,
        in_specs=[pl.BlockSpec((block_b, bag_len), lambda i, j: (i, 0)),
                  pl.BlockSpec((block_b, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((vocab, block_d), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_b, block_d), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((ids_p.shape[0], table_p.shape[1]), table.dtype),
        interpret=interpret,
        name="embedding_bag_fwd",
    )(ids_p, w_p, table_p)
    return out[:n_bags, :dim]


def _table_grad(ids, g, vocab, bs: EmbeddingBagBlockSizes, interpret: bool):
    n_bags, bag_len = ids.shape
    dim = g.shape[1]
    block_d = min(bs.block_d, dim)
    g_p = _pad_to(g, 1, block_d)
    out = pl.pallas_call(
        functools.partial(_bwd_kernel, n_bags=n_bags, bag_len=bag_len),
        grid=(g_p.shape[1] // block_d,),
        in_specs=[pl.BlockSpec((n_bags, bag_len), lambda j: (0, 0)),
                  pl.BlockSpec((n_bags, block_d), lambda j: (0, j))],
        out_specs=pl.BlockSpec((vocab, block_d), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((vocab, g_p.shape[1]), jnp.float32),
        interpret=interpret,
        name="embedding_bag_bwd",
    )(ids, g_p)
    return out[:, :dim]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _embedding_bag(table, ids, mode, bs, interpret):
    return _forward(table, ids, _bag_weights(ids, mode), bs, interpret)


def _embedding_bag_fwd(table, ids, mode, bs, interpret):
    # A zero-width array carries the table's vocab size and dtype (residuals must be arrays).
    return _embedding_bag(table, ids, mode, bs, interpret), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _embedding_bag_bwd(mode, bs, interpret, res, g):
    ids, like = res
    g = g.astype(jnp.float32) * _bag_weights(ids, mode)
    return _table_grad(ids, g, like.shape[0], bs, interpret).astype(like.dtype), None


_embedding_bag.defvjp(_embedding_bag_fwd, _embedding_bag_bwd)


@functools.partial(jax.jit, static_argnames=("mode", "block_sizes", "interpret"))
def embedding_bag(table: jax.Array, ids: jax.Array, *, mode: str = "sum",
                  block_sizes: EmbeddingBagBlockSizes | None = None,
                  interpret: bool = False) -> jax.Array:
    """Pallas version of ``embedding_bag_reference``: table [V, D], ids int32[B, L] -> [B, D].

    Differentiable in ``table`` (the gradient is the Pallas scatter-add kernel).
    """
    if table.ndim != 2:
        raise ValueError(f"table must be [V, D], got shape {table.shape}")
    if ids.ndim != 2:
        raise ValueError(f"ids must be int32[B, L] bags (-1 = padding), got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}; valid: {', '.join(_MODES)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        return jnp.zeros((ids.shape[0], table.shape[1]), table.dtype)
    bs = block_sizes or EmbeddingBagBlockSizes.get_default()
    return _embedding_bag(table, ids.astype(jnp.int32), mode, bs, interpret)
