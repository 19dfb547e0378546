"""Bit-compare + count + compaction of changed bf16 elements (SparseRL-Sync encode hot loop).

Given the bit patterns of a snapshot and of a fresh bf16 cast (uint16[n] each), returns how
many differ and, compacted into a static power-of-two ``capacity``, their flat positions and
old/new bit patterns. Static shapes keep recompiles bounded: a caller counts first, then picks
the capacity (next power of two of the count).

The kernel compacts each block of ``block`` elements with a rank one-hot (``block x block``
compare + reduce: no dynamic stores, so it maps onto TPU/GPU vector units); a small XLA gather
then concatenates the per-block results. ``diff_compact_reference`` defines the semantics.
There is no custom_vjp: the op is on integer bit patterns and has no gradient.
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


def diff_compact_reference(old_bits: jax.Array, new_bits: jax.Array, *, capacity: int):
    """Pure-jnp semantics.

    Args:
      old_bits, new_bits: uint16[n].
      capacity: static output length.
    Returns:
      count: int32[] number of differing elements (may exceed capacity).
      positions: int32[capacity] ascending positions of the first ``min(count, capacity)``
        differences, then -1.
      old, new: uint16[capacity] the bit patterns there, then 0.
    """
    changed = old_bits != new_bits
    count = jnp.sum(changed, dtype=jnp.int32)
    (pos,) = jnp.nonzero(changed, size=capacity, fill_value=0)
    valid = jnp.arange(capacity) < count
    positions = jnp.where(valid, pos.astype(jnp.int32), -1)
    old = jnp.where(valid, old_bits[pos], 0).astype(jnp.uint16)
    new = jnp.where(valid, new_bits[pos], 0).astype(jnp.uint16)
    return count, positions, old, new


def _compact_block_kernel(old_ref, new_ref, count_ref, pos_ref, old_out_ref, new_out_ref, *,
                          block: int):
    base = pl.program_id(0) * block
    old = old_ref[...].astype(jnp.int32)  # (1, block)
    new = new_ref[...].astype(jnp.int32)
    changed = (old != new).astype(jnp.int32)
    count = jnp.sum(changed)
    rank = jnp.cumsum(changed, axis=1) - 1  # output slot of each changed element
    slots = jax.lax.broadcasted_iota(jnp.int32, (block, block), 0)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (block, block), 1)
    select = ((rank == slots) & (changed == 1)).astype(jnp.int32)  # [slot, lane]
    valid = jax.lax.broadcasted_iota(jnp.int32, (1, block), 1) < count
    pos = jnp.sum(select * lanes, axis=1)[None, :] + base
    pos_ref[...] = jnp.where(valid, pos, -1)
    old_out_ref[...] = jnp.sum(select * old, axis=1)[None, :].astype(jnp.uint16)
    new_out_ref[...] = jnp.sum(select * new, axis=1)[None, :].astype(jnp.uint16)
    count_ref[...] = jnp.full((1, 1), count, jnp.int32)


@functools.partial(jax.jit, static_argnames=("capacity", "block_sizes", "interpret"))
def diff_compact(old_bits: jax.Array, new_bits: jax.Array, *, capacity: int,
                 block_sizes: BlockSizes | None = None, interpret: bool = False):
    """Pallas version of ``diff_compact_reference`` (same outputs, bit for bit)."""
    if old_bits.shape != new_bits.shape or old_bits.ndim != 1:
        raise ValueError(f"need two equal 1-D arrays, got {old_bits.shape} and {new_bits.shape}")
    if old_bits.dtype != jnp.uint16 or new_bits.dtype != jnp.uint16:
        raise ValueError(f"need uint16 bit patterns, got {old_bits.dtype} and {new_bits.dtype}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    block = (block_sizes or BlockSizes.get_default()).block
    n = old_bits.shape[0]
    n_blocks = max(1, -(-n // block))
    pad = n_blocks * block - n
    old2 = jnp.pad(old_bits, (0, pad)).reshape(n_blocks, block)
    new2 = jnp.pad(new_bits, (0, pad)).reshape(n_blocks, block)
    row = pl.BlockSpec((1, block), lambda b: (b, 0))
    counts, pos, old, new = pl.pallas_call(
        functools.partial(_compact_block_kernel, block=block),
        grid=(n_blocks,),
        in_specs=[row, row],
        out_specs=[pl.BlockSpec((1, 1), lambda b: (b, 0)), row, row, row],
        out_shape=[jax.ShapeDtypeStruct((n_blocks, 1), jnp.int32),
                   jax.ShapeDtypeStruct((n_blocks, block), jnp.int32),
                   jax.ShapeDtypeStruct((n_blocks, block), jnp.uint16),
                   jax.ShapeDtypeStruct((n_blocks, block), jnp.uint16)],
        interpret=interpret,
        name="sync_diff_compact",
    )(old2, new2)
    # Concatenate the per-block prefixes: output slot s comes from block b with
    # ends[b-1] <= s < ends[b], lane s - starts[b].
    counts = counts[:, 0]
    ends = jnp.cumsum(counts)
    starts = ends - counts
    total = ends[-1]
    slot = jnp.arange(capacity, dtype=jnp.int32)
    src_block = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), n_blocks - 1)
    lane = jnp.clip(slot - starts[src_block], 0, block - 1)
    valid = slot < total
    positions = jnp.where(valid, pos[src_block, lane], -1)
    old_out = jnp.where(valid, old[src_block, lane], 0).astype(jnp.uint16)
    new_out = jnp.where(valid, new[src_block, lane], 0).astype(jnp.uint16)
    return total, positions, old_out, new_out
