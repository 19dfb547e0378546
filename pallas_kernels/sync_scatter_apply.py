"""Scatter-apply of synced bf16 bit patterns (SparseRL-Sync receiver hot loop).

``dst[positions] = values`` on uint16 bit patterns: an integer scatter, so NaN payloads and
signed zeros land exactly (a bf16 scatter may canonicalise NaNs). Positions are ascending and
distinct with -1 padding (the layout ``sync_diff_compact`` produces).

The kernel walks ``dst`` as [rows, 128] in (block_rows, 128) tiles (``dst`` aliased to the
output). Because positions are sorted, the updates of tile t are the contiguous range
``[starts[t], starts[t + 1])`` of the list (a searchsorted per tile, in XLA, scalar-prefetched
on TPU). The kernel walks that range in 128-aligned chunks of 128 updates (DMA'd from HBM on
TPU, loaded from the HBM pointer on GPU) and merges each chunk with matmuls, no gathers or
dynamic stores:

  R[r, u] = (row(u) == r)   [block_rows, 128]     Lt[l, u] = (lane(u) == l)   [128, 128]
  hit = R @ Lt^T,  value = 256 * (R @ (Lt * hi(u))^T) + R @ (Lt * lo(u))^T

with the 16-bit values split into bytes so every product is exact in bf16 -> f32 (updates
outside the tile match no row). ``scatter_apply_reference`` defines the semantics.
TPU: Mosaic; GPU: Triton with explicit compiler params (Mosaic GPU fails layout inference on
the iotas and would need TMA copies of the 128-update chunks). No custom_vjp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.sync_tiles import SyncBlockSizes as BlockSizes  # noqa: F401  (public name)

LANES = 128
_LOG2_LANES = 7
_ANY = pl.BlockSpec(memory_space=pl.ANY)


def scatter_apply_reference(dst_bits: jax.Array, positions: jax.Array, values: jax.Array):
    """uint16[n] dst with ``dst[p] = v`` for every pair with p >= 0 (pure jnp)."""
    n = dst_bits.shape[0]
    safe = jnp.where(positions >= 0, positions, n)  # out of bounds -> dropped
    return dst_bits.at[safe].set(values, mode="drop")


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def merge_chunk(pos, val, base, rows, carry):
    """Adds one chunk of updates (pos, val int32[1, 128]) to (hit, hi, lo) [rows, 128] f32."""
    hit, hi, lo = carry
    local = pos - base
    inside = (pos >= 0) & (local >= 0) & (local < rows * LANES)
    # Shifts and masks, not // and %: their sign fix-up lowers through a chip query that a
    # deviceless TPU compile cannot answer ("Unsupported TPU device kind: cpu").
    row = jnp.where(inside, local >> _LOG2_LANES, -1)
    lane = jnp.where(inside, local & (LANES - 1), -1)
    r_of = (jax.lax.broadcasted_iota(jnp.int32, (rows, LANES), 0) == row).astype(jnp.bfloat16)
    l_of = jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 0) == lane
    lane_f = l_of.astype(jnp.bfloat16)
    hi_f = jnp.where(l_of, (val >> 8) & 0xFF, 0).astype(jnp.float32).astype(jnp.bfloat16)
    lo_f = jnp.where(l_of, val & 0xFF, 0).astype(jnp.float32).astype(jnp.bfloat16)
    return hit + _dot_nt(r_of, lane_f), hi + _dot_nt(r_of, hi_f), lo + _dot_nt(r_of, lo_f)


def _finish(dst, carry):
    hit, hi, lo = carry
    value = (hi.astype(jnp.int32) * 256 + lo.astype(jnp.int32))
    return jnp.where(hit > 0, value, dst.astype(jnp.int32)).astype(jnp.uint16)


def _chunk_range(start, end):
    return start >> _LOG2_LANES, (end + LANES - 1) >> _LOG2_LANES


def _kernel_tpu(starts_ref, dst_ref, pos_hbm, val_hbm, out_ref, pos_buf, val_buf, sem):
    t = pl.program_id(0)
    rows = dst_ref.shape[0]
    first, last = _chunk_range(starts_ref[t], starts_ref[t + 1])

    def chunk(c, carry):
        lanes = pl.ds(pl.multiple_of(c * LANES, LANES), LANES)
        cp = pltpu.make_async_copy(pos_hbm.at[:, lanes], pos_buf, sem.at[0])
        cv = pltpu.make_async_copy(val_hbm.at[:, lanes], val_buf, sem.at[1])
        cp.start()
        cv.start()
        cp.wait()
        cv.wait()
        return merge_chunk(pos_buf[...], val_buf[...], t * rows * LANES, rows, carry)

    zero = jnp.zeros((rows, LANES), jnp.float32)
    carry = jax.lax.fori_loop(first, last, chunk, (zero, zero, zero))
    out_ref[...] = _finish(dst_ref[...], carry)


def _kernel_gpu(starts_ref, dst_ref, pos_ref, val_ref, out_ref):
    t = pl.program_id(0)
    rows = dst_ref.shape[0]
    first, last = _chunk_range(starts_ref[t], starts_ref[t + 1])

    def chunk(c, carry):
        lanes = pl.ds(c * LANES, LANES)
        return merge_chunk(pos_ref[:, lanes], val_ref[:, lanes], t * rows * LANES, rows, carry)

    zero = jnp.zeros((rows, LANES), jnp.float32)
    carry = jax.lax.fori_loop(first, last, chunk, (zero, zero, zero))
    out_ref[...] = _finish(dst_ref[...], carry)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"), donate_argnums=(0,))
def scatter_apply(dst_bits: jax.Array, positions: jax.Array, values: jax.Array, *,
                  block_sizes: BlockSizes | None = None, interpret: bool = False):
    """Pallas version of ``scatter_apply_reference`` (positions ascending, distinct, -1 last)."""
    if dst_bits.ndim != 1 or dst_bits.dtype != jnp.uint16:
        raise ValueError(f"dst must be uint16[n], got {dst_bits.dtype}{dst_bits.shape}")
    if positions.shape != values.shape or positions.ndim != 1:
        raise ValueError(f"positions {positions.shape} and values {values.shape} must be equal 1-D")
    if positions.dtype != jnp.int32 or values.dtype != jnp.uint16:
        raise ValueError(f"need int32 positions and uint16 values, got {positions.dtype}, "
                         f"{values.dtype}")
    bs = block_sizes or BlockSizes.get_default()
    n = dst_bits.shape[0]
    per_tile = bs.block_rows * LANES
    tiles = max(1, -(-n // per_tile))
    pad = tiles * per_tile - n
    # Padding (-1) sorts first in value; push it past every real position so the list stays
    # ascending, and pad the list to whole 128-update chunks.
    key = jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max)
    starts = jnp.searchsorted(key, jnp.arange(tiles + 1, dtype=jnp.int32) * per_tile)
    starts = starts.astype(jnp.int32)
    cap_pad = (-positions.shape[0]) % LANES + LANES * (positions.shape[0] == 0)
    pos2 = jnp.pad(positions, (0, cap_pad), constant_values=-1).reshape(1, -1)
    val2 = jnp.pad(values.astype(jnp.int32), (0, cap_pad)).reshape(1, -1)
    dst2 = jnp.pad(dst_bits, (0, pad)).reshape(-1, LANES)
    tile = pl.BlockSpec((bs.block_rows, LANES), lambda t, s: (t, 0))
    out_shape = jax.ShapeDtypeStruct(dst2.shape, jnp.uint16)
    # Every tile merges its own chunks (one or two per tile boundary on top of the updates'
    # chunks), three (rows x 128) @ (128 x 128) matmuls each; dst is read and written once.
    chunks = pos2.shape[1] // LANES + tiles
    cost = pl.CostEstimate(flops=chunks * 3 * 2 * bs.block_rows * LANES * LANES,
                           transcendentals=0,
                           bytes_accessed=2 * dst2.size * 2 + 2 * pos2.size * 4 + starts.size * 4)
    if bs.platform == "tpu":
        out = pl.pallas_call(
            _kernel_tpu,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(tiles,), in_specs=[tile, _ANY, _ANY],
                out_specs=tile,
                scratch_shapes=[pltpu.VMEM((1, LANES), jnp.int32),
                                pltpu.VMEM((1, LANES), jnp.int32),
                                pltpu.SemaphoreType.DMA((2,))]),
            out_shape=out_shape,
            input_output_aliases={1: 0},
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
            cost_estimate=cost,
            interpret=interpret,
            name="sync_scatter_apply",
        )(starts, dst2, pos2, val2)
    else:
        from jax.experimental.pallas import triton as pltriton

        tile = pl.BlockSpec((bs.block_rows, LANES), lambda t: (t, 0))
        out = pl.pallas_call(
            _kernel_gpu,
            grid=(tiles,),
            in_specs=[_ANY, tile, _ANY, _ANY],
            out_specs=tile,
            out_shape=out_shape,
            input_output_aliases={1: 0},
            compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps,
                                                    num_stages=bs.num_stages),
            cost_estimate=cost,
            interpret=interpret,
            name="sync_scatter_apply",
        )(starts, dst2, pos2, val2)
    return out.reshape(-1)[:n]
