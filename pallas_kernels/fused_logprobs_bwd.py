"""Backward kernels of ``fused_logprobs``: dh and dW, recomputing the logits tile by tile.

With z = (h @ W) / T, lse the row logsumexp from the forward pass and g [N, L] the cotangents
of the log-probs at the padded id columns (column 0 = the target, then the given top-K ids,
then padding ids -1 that never match):

  dz[n, v] = (sum_k g[n, k] [v == ids[n, k]] - G_n softmax(z)[n, v]) / T,
  G_n = sum_k g[n, k];   dh = dz @ W^T;   dW = h^T @ dz.

TPU (Mosaic): ``dh`` on a grid (row blocks, vocab tiles), vocab sequential, accumulating in
its f32 output block (resident in VMEM while the vocab axis runs); ``dW`` on a grid (vocab
tiles, row blocks), rows sequential, streaming h blocks into its resident f32 [d, block_v]
output block. Both are cast to the parameter dtype outside the kernel (an f32 output block
instead of an f32 scratch plus a bf16 output block is what lets d = 8192 fit 16 MiB).

GPU (Triton): programs are independent (no sequential grid axis), so each ``dh`` program owns
a row block and loops over vocab tiles in the kernel, each ``dW`` program owns a vocab tile
and loops over row blocks; the hidden dim is walked in ``block_d`` chunks and the f32 result
is accumulated in place in the program's own output block (global memory, one owner, so no
races), since a [block_n, d] f32 accumulator does not fit a GPU block's registers at d 4096.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG_INF = float("-inf")
_ANY = pl.BlockSpec(memory_space=pl.ANY)


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def mask_logits(z, col0, vocab, temperature):
    """f32 logits of one vocab tile scaled by 1/T, columns >= vocab (padding) set to -inf."""
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    return jnp.where(cols < vocab, z / temperature, _NEG_INF), cols


def scatter_ids(cols, g_of, id_of, num_ids, *, unroll):
    """sum_k g[:, k] [cols == ids[:, k]] over the first num_ids columns, [bn, bv] f32.

    ``g_of(k)`` / ``id_of(k)`` return column k as [bn, 1] (a static slice on TPU, a ref load
    on GPU, where value slices do not lower); ``unroll`` as in ``gather_ids``.
    """
    def one(k, acc):
        return acc + jnp.where(cols == id_of(k), g_of(k), 0.0)

    acc = jnp.zeros(cols.shape, jnp.float32)
    if unroll:
        for k in range(num_ids):
            acc = one(k, acc)
        return acc
    return jax.lax.fori_loop(0, num_ids, one, acc)


def tile_dlogits(z, cols, lse, gsum, scattered, temperature):
    """dz of one tile: (scatter(g) - G softmax(z)) / T, with z already scaled by 1/T."""
    return (scattered - gsum * jnp.exp(z - lse)) / temperature


# ------------------------------------------------------------------------------------ TPU


def _dh_kernel_tpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dh_ref, *,
                   vocab, block_v, temperature, num_ids):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

    w = w_ref[...]
    z, cols = mask_logits(_dot(h_ref[...], w), j * block_v, vocab, temperature)
    ids, g = ids_ref[...], g_ref[...]
    scattered = scatter_ids(cols, lambda k: g[:, k:k + 1], lambda k: ids[:, k:k + 1], num_ids,
                             unroll=True)
    gsum = jnp.sum(g, axis=1, keepdims=True)
    dz = tile_dlogits(z, cols, lse_ref[:, 0:1], gsum, scattered, temperature)
    dh_ref[...] += _dot(dz.astype(w.dtype), w, trans_b=True)


def _dw_kernel_tpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dw_ref, *,
                   vocab, block_v, temperature, num_ids):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    h = h_ref[...]
    z, cols = mask_logits(_dot(h, w_ref[...]), j * block_v, vocab, temperature)
    ids, g = ids_ref[...], g_ref[...]
    scattered = scatter_ids(cols, lambda k: g[:, k:k + 1], lambda k: ids[:, k:k + 1], num_ids,
                             unroll=True)
    gsum = jnp.sum(g, axis=1, keepdims=True)
    dz = tile_dlogits(z, cols, lse_ref[:, 0:1], gsum, scattered, temperature)
    dw_ref[...] += _dot(h, dz.astype(h.dtype), trans_a=True)


def _backward_tpu(hp, wp, ids, lse, g, *, vocab, temperature, num_ids, blocks, interpret):
    np_, d = hp.shape
    vp = wp.shape[1]
    lanes, stat = ids.shape[1], lse.shape[1]
    bn, bv = blocks.block_n, blocks.block_v
    common = dict(vocab=vocab, temperature=temperature, num_ids=num_ids)
    dh = pl.pallas_call(
        functools.partial(_dh_kernel_tpu, block_v=bv, **common),
        grid=(np_ // bn, vp // bv),
        in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((d, bv), lambda i, j: (0, j)),
                  pl.BlockSpec((bn, lanes), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, stat), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, lanes), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((np_, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=blocks.vmem_limit_bytes),
        interpret=interpret,
        name="fused_logprobs_bwd_dh",
    )(hp, wp, ids, lse, g)
    bn2, bv2 = blocks.block_n_dw, blocks.block_v_dw
    dw = pl.pallas_call(
        functools.partial(_dw_kernel_tpu, block_v=bv2, **common),
        grid=(vp // bv2, np_ // bn2),
        in_specs=[pl.BlockSpec((bn2, d), lambda j, i: (i, 0)),
                  pl.BlockSpec((d, bv2), lambda j, i: (0, j)),
                  pl.BlockSpec((bn2, lanes), lambda j, i: (i, 0)),
                  pl.BlockSpec((bn2, stat), lambda j, i: (i, 0)),
                  pl.BlockSpec((bn2, lanes), lambda j, i: (i, 0))],
        out_specs=pl.BlockSpec((d, bv2), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct((d, vp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=blocks.vmem_limit_bytes),
        interpret=interpret,
        name="fused_logprobs_bwd_dw",
    )(hp, wp, ids, lse, g)
    return dh.astype(hp.dtype), dw.astype(wp.dtype)


# ------------------------------------------------------------------------------------ GPU


def chunked_logits(h_rows, w_cols, num_chunks, block_d):
    """sum over hidden chunks c of h[:, c] @ W[c, :] (f32), loading one chunk at a time.

    h_rows(c) -> [bn, block_d], w_cols(c) -> [block_d, bv]."""
    def body(c, acc):
        return acc + _dot(h_rows(c), w_cols(c))

    first = _dot(h_rows(0), w_cols(0))
    return jax.lax.fori_loop(1, num_chunks, body, first)


def _dh_kernel_gpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dh_ref, *, vocab, block_v, block_d,
                   num_tiles, num_chunks, temperature, num_ids):
    bn = ids_ref.shape[0]
    rs = pl.ds(pl.program_id(0) * bn, bn)  # h and dh are whole arrays (pl.ANY pointers)

    def zero(c, _):
        dh_ref[rs, pl.ds(c * block_d, block_d)] = jnp.zeros((bn, block_d), jnp.float32)
        return 0

    jax.lax.fori_loop(0, num_chunks, zero, 0)
    lse = lse_ref[...]
    gsum = jnp.sum(g_ref[...], axis=1, keepdims=True)

    def tile(j, _):
        col0 = j * block_v
        cols_ds = pl.ds(col0, block_v)
        z = chunked_logits(lambda c: h_ref[rs, pl.ds(c * block_d, block_d)],
                           lambda c: w_ref[pl.ds(c * block_d, block_d), cols_ds],
                           num_chunks, block_d)
        z, cols = mask_logits(z, col0, vocab, temperature)
        scattered = scatter_ids(cols, lambda k: g_ref[:, pl.ds(k, 1)],
                                lambda k: ids_ref[:, pl.ds(k, 1)], num_ids,
                                unroll=False)
        dz = tile_dlogits(z, cols, lse, gsum, scattered, temperature).astype(w_ref.dtype)

        def update(c, _):
            chunk = pl.ds(c * block_d, block_d)
            dh_ref[rs, chunk] = dh_ref[rs, chunk] + _dot(dz, w_ref[chunk, cols_ds], trans_b=True)
            return 0

        return jax.lax.fori_loop(0, num_chunks, update, 0)

    jax.lax.fori_loop(0, num_tiles, tile, 0)


def _dw_kernel_gpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dw_ref, *, vocab, block_n, block_v,
                   block_d, num_row_blocks, num_chunks, temperature, num_ids):
    j = pl.program_id(0)
    col0 = j * block_v
    cs = pl.ds(col0, block_v)  # W and dW are whole arrays (pl.ANY pointers)

    def zero(c, _):
        dw_ref[pl.ds(c * block_d, block_d), cs] = jnp.zeros((block_d, block_v), jnp.float32)
        return 0

    jax.lax.fori_loop(0, num_chunks, zero, 0)

    def rows(r, _):
        rs = pl.ds(r * block_n, block_n)
        z = chunked_logits(lambda c: h_ref[rs, pl.ds(c * block_d, block_d)],
                           lambda c: w_ref[pl.ds(c * block_d, block_d), cs],
                           num_chunks, block_d)
        z, cols = mask_logits(z, col0, vocab, temperature)
        scattered = scatter_ids(cols, lambda k: g_ref[rs, pl.ds(k, 1)],
                                lambda k: ids_ref[rs, pl.ds(k, 1)], num_ids,
                                unroll=False)
        gsum = jnp.sum(g_ref[rs, :], axis=1, keepdims=True)
        dz = tile_dlogits(z, cols, lse_ref[rs, :], gsum, scattered, temperature)
        dz = dz.astype(h_ref.dtype)

        def update(c, _):
            chunk = pl.ds(c * block_d, block_d)
            dw_ref[chunk, cs] = dw_ref[chunk, cs] + _dot(h_ref[rs, chunk], dz, trans_a=True)
            return 0

        return jax.lax.fori_loop(0, num_chunks, update, 0)

    jax.lax.fori_loop(0, num_row_blocks, rows, 0)


def _backward_gpu(hp, wp, ids, lse, g, *, vocab, temperature, num_ids, blocks, interpret):
    from jax.experimental.pallas import triton as pltriton

    np_, dp = hp.shape
    vp = wp.shape[1]
    lanes, stat = ids.shape[1], lse.shape[1]
    bn, bv, bd = blocks.block_n, blocks.block_v, blocks.block_d
    params = pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    common = dict(vocab=vocab, temperature=temperature, num_ids=num_ids, block_d=bd,
                  num_chunks=dp // bd)
    dh = pl.pallas_call(
        functools.partial(_dh_kernel_gpu, block_v=bv, num_tiles=vp // bv, **common),
        grid=(np_ // bn,),
        in_specs=[_ANY, _ANY,
                  pl.BlockSpec((bn, lanes), lambda i: (i, 0)),
                  pl.BlockSpec((bn, stat), lambda i: (i, 0)),
                  pl.BlockSpec((bn, lanes), lambda i: (i, 0))],
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct((np_, dp), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="fused_logprobs_bwd_dh",
    )(hp, wp, ids, lse, g)
    bn2, bv2 = blocks.block_n_dw, blocks.block_v_dw
    dw = pl.pallas_call(
        functools.partial(_dw_kernel_gpu, block_n=bn2, block_v=bv2, num_row_blocks=np_ // bn2,
                          **common),
        grid=(vp // bv2,),
        in_specs=[_ANY] * 5,
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct((dp, vp), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="fused_logprobs_bwd_dw",
    )(hp, wp, ids, lse, g)
    return dh.astype(hp.dtype), dw.astype(wp.dtype)


def fused_logprobs_backward(hp, wp, ids, lse, g, *, vocab, temperature, num_ids, blocks,
                            interpret):
    """dh [Np, d'] and dW [d', Vp] on padded operands (rows, vocab and, on GPU, d padded).

    ids / g: int32 / f32 [Np, L] id columns and their cotangents; lse: f32 [Np, S]."""
    fn = _backward_gpu if blocks.platform == "gpu" else _backward_tpu
    return fn(hp, wp, ids, lse, g, vocab=vocab, temperature=temperature, num_ids=num_ids,
              blocks=blocks, interpret=interpret)
