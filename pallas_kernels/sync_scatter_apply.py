"""Scatter-apply of synced bf16 bit patterns (SparseRL-Sync receiver hot loop).

``dst[positions] = values`` on uint16 bit patterns: an integer scatter, so NaN payloads and
signed zeros land exactly (a bf16 scatter may canonicalise NaNs). Positions are ascending with
-1 padding (the layout ``sync_diff_compact`` produces).

The kernel walks ``dst`` in blocks; a cheap XLA gather first cuts each block's window of
updates out of the sorted position list (at most ``block`` per block, as positions are
distinct), and the kernel merges it with a ``block x block`` one-hot compare + reduce.
``dst`` is aliased to the output. ``scatter_apply_reference`` defines the semantics. No
custom_vjp: integer bit patterns have no gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block: int = 256

    @classmethod
    def get_default(cls) -> "BlockSizes":
        return cls()


def scatter_apply_reference(dst_bits: jax.Array, positions: jax.Array, values: jax.Array):
    """uint16[n] dst with ``dst[p] = v`` for every pair with p >= 0 (pure jnp)."""
    n = dst_bits.shape[0]
    safe = jnp.where(positions >= 0, positions, n)  # out of bounds -> dropped
    return dst_bits.at[safe].set(values, mode="drop")


def _scatter_block_kernel(dst_ref, pos_ref, val_ref, out_ref, *, block: int):
    base = pl.program_id(0) * block
    local = pos_ref[...] - base  # (1, block): window positions relative to this block
    lanes = jax.lax.broadcasted_iota(jnp.int32, (block, block), 0)
    select = (local == lanes).astype(jnp.int32)  # [lane, update]
    hit = jnp.sum(select, axis=1)[None, :] > 0
    value = jnp.sum(select * val_ref[...].astype(jnp.int32), axis=1)[None, :]
    out_ref[...] = jnp.where(hit, value.astype(jnp.uint16), dst_ref[...])


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"), donate_argnums=(0,))
def scatter_apply(dst_bits: jax.Array, positions: jax.Array, values: jax.Array, *,
                  block_sizes: BlockSizes | None = None, interpret: bool = False):
    """Pallas version of ``scatter_apply_reference`` (positions must be ascending, -1 last)."""
    if dst_bits.ndim != 1 or dst_bits.dtype != jnp.uint16:
        raise ValueError(f"dst must be uint16[n], got {dst_bits.dtype}{dst_bits.shape}")
    if positions.shape != values.shape or positions.ndim != 1:
        raise ValueError(f"positions {positions.shape} and values {values.shape} must be equal 1-D")
    if positions.dtype != jnp.int32 or values.dtype != jnp.uint16:
        raise ValueError(f"need int32 positions and uint16 values, got {positions.dtype}, "
                         f"{values.dtype}")
    block = (block_sizes or BlockSizes.get_default()).block
    n = dst_bits.shape[0]
    n_blocks = max(1, -(-n // block))
    pad = n_blocks * block - n
    # Padding (-1) sorts first; push it past every real position so the list stays ascending.
    key = jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max)
    starts = jnp.searchsorted(key, jnp.arange(n_blocks + 1, dtype=jnp.int32) * block)
    take = starts[:-1, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
    inside = take < starts[1:, None]
    take = jnp.minimum(take, positions.shape[0] - 1)
    window_pos = jnp.where(inside, positions[take], -1)
    window_val = jnp.where(inside, values[take], 0).astype(jnp.uint16)
    row = pl.BlockSpec((1, block), lambda b: (b, 0))
    out = pl.pallas_call(
        functools.partial(_scatter_block_kernel, block=block),
        grid=(n_blocks,),
        in_specs=[row, row, row],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct((n_blocks, block), jnp.uint16),
        input_output_aliases={0: 0},
        interpret=interpret,
        name="sync_scatter_apply",
    )(jnp.pad(dst_bits, (0, pad)).reshape(n_blocks, block), window_pos, window_val)
    return out.reshape(-1)[:n]
