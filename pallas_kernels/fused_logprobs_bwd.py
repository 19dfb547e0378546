"""Backward kernels of ``fused_logprobs``: dh and dW, recomputing the logits tile by tile.

With z = (h @ W) / T, lse the row logsumexp from the forward pass and g [N, L] the cotangents
of the log-probs at the padded id columns (column 0 = the target, then the given top-K ids,
then padding ids -1 that never match):

    dz[n, v] = (sum_k g[n, k] [v == ids[n, k]] - G_n softmax(z)[n, v]) / T,
    G_n = sum_k g[n, k];   dh = dz @ W^T;   dW = h^T @ dz.

TPU (Mosaic): ``dh`` on a grid (row blocks, vocab tiles), vocab sequential, accumulating in
f32 while the vocab axis runs; ``dW`` on a grid (vocab tiles, row blocks), rows sequential,
streaming h blocks into a resident f32 [d, block_v] accumulator. For f32 parameters the
accumulator is the output block itself; for bf16 it is a VMEM scratch written to the bf16
output block at the last step (the same VMEM: one f32 scratch + a double-buffered bf16 block
= a double-buffered f32 block), so no f32 [d, V] copy of dW is made in HBM.

The head is not padded: the vocab grid is cdiv(V, block_v) and the last tile is ragged. Its
columns >= V hold whatever the buffer held (NaN in interpret mode): their logits are set to
-inf, so their dz is 0, and dh masks the W tile's columns >= V to 0 before dz @ W^T
(0 * NaN would poison dh); dW's out-of-range columns fall outside the array and are dropped.

GPU (Triton): programs are independent (no sequential grid axis), so each ``dh`` program owns
a row block and loops over vocab tiles in the kernel, each ``dW`` program owns a vocab tile
and loops over row blocks; the hidden dim is walked in ``block_d`` chunks and the f32 result
is accumulated in place in the program's own output block (global memory, one owner, so no
races), since a [block_n, d] f32 accumulator does not fit a GPU block's registers at d 4096.
The ragged last vocab tile is read with masked loads (0 beyond V) and written with masked
stores.

Every ``pallas_call`` carries a ``pl.CostEstimate`` (``cost_estimate``): 2 N d V flops per
matmul, N V exps, and the bytes its blocks move from HBM, re-reads included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG_INF = float("-inf")
_ANY = pl.BlockSpec(memory_space=pl.ANY)


def cost_estimate(*, rows, d, vocab, matmuls, bytes_accessed) -> pl.CostEstimate:
    """XLA's cost of one kernel: ``matmuls`` [rows, d] x [d, vocab] products (2 flops per
    multiply-add), one exp per logit, and ``bytes_accessed`` from HBM."""
    return pl.CostEstimate(flops=2 * matmuls * rows * d * vocab, transcendentals=rows * vocab,
                           bytes_accessed=int(bytes_accessed))


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def mask_logits(z, col0, vocab, temperature):
    """f32 logits of one vocab tile scaled by 1/T, columns >= vocab (padding) set to -inf."""
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    return jnp.where(cols < vocab, z / temperature, _NEG_INF), cols


def scatter_ids(cols, g_of, id_of, num_ids, *, unroll):
    """``sum_k g[:, k] [cols == ids[:, k]]`` over the first num_ids columns, [bn, bv] f32.

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


def _tile_dz(h, w, ids, g, lse, col0, *, vocab, temperature, num_ids):
    """dz [bn, bv] f32 of one TPU tile (columns >= vocab give 0)."""
    z, cols = mask_logits(_dot(h, w), col0, vocab, temperature)
    scattered = scatter_ids(cols, lambda k: g[:, k:k + 1], lambda k: ids[:, k:k + 1], num_ids,
                            unroll=True)
    gsum = jnp.sum(g, axis=1, keepdims=True)
    return tile_dlogits(z, cols, lse, gsum, scattered, temperature)


# ------------------------------------------------------------------------------------ TPU


def _dh_kernel_tpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dh_ref, *scratch,
                   vocab, block_v, temperature, num_ids):
    acc_ref = scratch[0] if scratch else dh_ref
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    w = w_ref[...]
    dz = _tile_dz(h_ref[...], w, ids_ref[...], g_ref[...], lse_ref[:, 0:1], j * block_v,
                  vocab=vocab, temperature=temperature, num_ids=num_ids)
    if vocab % block_v:  # ragged last tile: W's columns >= vocab are garbage, 0 * NaN = NaN
        wcols = j * block_v + jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
        w = jnp.where(wcols < vocab, w, jnp.zeros_like(w))
    acc_ref[...] += _dot(dz.astype(w.dtype), w, trans_b=True)
    if scratch:
        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def _dw_kernel_tpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dw_ref, *scratch,
                   vocab, block_v, temperature, num_ids):
    acc_ref = scratch[0] if scratch else dw_ref
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    h = h_ref[...]
    dz = _tile_dz(h, w_ref[...], ids_ref[...], g_ref[...], lse_ref[:, 0:1], j * block_v,
                  vocab=vocab, temperature=temperature, num_ids=num_ids)
    acc_ref[...] += _dot(h, dz.astype(h.dtype), trans_a=True)
    if scratch:
        @pl.when(i == pl.num_programs(1) - 1)
        def _():
            dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _backward_tpu(hp, w, ids, lse, g, *, vocab, temperature, num_ids, blocks, interpret):
    np_, d = hp.shape
    lanes, stat = ids.shape[1], lse.shape[1]
    s = hp.dtype.itemsize
    f32 = hp.dtype == jnp.float32  # accumulate in the output block, else in an f32 scratch
    bn, bv = blocks.block_n, blocks.block_v
    common = dict(vocab=vocab, temperature=temperature, num_ids=num_ids)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                  vmem_limit_bytes=blocks.vmem_limit_bytes)
    small = np_ * (2 * lanes + stat) * 4  # ids, g, lse
    dh = pl.pallas_call(
        functools.partial(_dh_kernel_tpu, block_v=bv, **common),
        grid=(np_ // bn, pl.cdiv(vocab, bv)),
        in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((d, bv), lambda i, j: (0, j)),
                  pl.BlockSpec((bn, lanes), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, stat), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, lanes), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((np_, d), hp.dtype),
        scratch_shapes=[] if f32 else [pltpu.VMEM((bn, d), jnp.float32)],
        compiler_params=params,
        cost_estimate=cost_estimate(  # W once per row block; h, ids, g, lse once; dh out
            rows=np_, d=d, vocab=vocab, matmuls=2,
            bytes_accessed=(np_ // bn) * d * vocab * s + 2 * np_ * d * s + small),
        interpret=interpret,
        name="fused_logprobs_bwd_dh",
    )(hp, w, ids, lse, g)
    bn2, bv2 = blocks.block_n_dw, blocks.block_v_dw
    tiles2 = pl.cdiv(vocab, bv2)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel_tpu, block_v=bv2, **common),
        grid=(tiles2, np_ // bn2),
        in_specs=[pl.BlockSpec((bn2, d), lambda j, i: (i, 0)),
                  pl.BlockSpec((d, bv2), lambda j, i: (0, j)),
                  pl.BlockSpec((bn2, lanes), lambda j, i: (i, 0)),
                  pl.BlockSpec((bn2, stat), lambda j, i: (i, 0)),
                  pl.BlockSpec((bn2, lanes), lambda j, i: (i, 0))],
        out_specs=pl.BlockSpec((d, bv2), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct((d, vocab), w.dtype),
        scratch_shapes=[] if f32 else [pltpu.VMEM((d, bv2), jnp.float32)],
        compiler_params=params,
        cost_estimate=cost_estimate(  # h, ids, g, lse once per vocab tile; W once; dW out
            rows=np_, d=d, vocab=vocab, matmuls=2,
            bytes_accessed=tiles2 * (np_ * d * s + small) + 2 * d * vocab * s),
        interpret=interpret,
        name="fused_logprobs_bwd_dw",
    )(hp, w, ids, lse, g)
    return dh, dw


# ------------------------------------------------------------------------------------ GPU


def chunked_logits(h_rows, w_cols, num_chunks, block_d):
    """sum over hidden chunks c of h[:, c] @ W[c, :] (f32), loading one chunk at a time.

    h_rows(c) -> [bn, block_d], w_cols(c) -> [block_d, bv]."""
    def body(c, acc):
        return acc + _dot(h_rows(c), w_cols(c))

    first = _dot(h_rows(0), w_cols(0))
    return jax.lax.fori_loop(1, num_chunks, body, first)


def _col_mask(shape, col0, vocab):
    return col0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1) < vocab


def gpu_cols(ref, rows, col0, width, vocab, value=None):
    """Triton load (``value`` None) or store of ``ref[rows, col0:col0 + width]``, masked to
    the columns < vocab when the vocab is ragged (loads read 0 there)."""
    from jax.experimental.pallas import triton as pltriton

    view = ref.at[rows, pl.ds(col0, width)]
    ragged = vocab % width != 0
    if value is None:
        if not ragged:
            return view[...]
        return pltriton.load(view, mask=_col_mask(view.shape, col0, vocab), other=0)
    if not ragged:
        view[...] = value
    else:
        pltriton.store(view, value, mask=_col_mask(view.shape, col0, vocab))
    return None


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

        def w_chunk(c):
            return gpu_cols(w_ref, pl.ds(c * block_d, block_d), col0, block_v, vocab)

        z = chunked_logits(lambda c: h_ref[rs, pl.ds(c * block_d, block_d)], w_chunk,
                           num_chunks, block_d)
        z, cols = mask_logits(z, col0, vocab, temperature)
        scattered = scatter_ids(cols, lambda k: g_ref[:, pl.ds(k, 1)],
                                lambda k: ids_ref[:, pl.ds(k, 1)], num_ids,
                                unroll=False)
        dz = tile_dlogits(z, cols, lse, gsum, scattered, temperature).astype(w_ref.dtype)

        def update(c, _):
            chunk = pl.ds(c * block_d, block_d)
            dh_ref[rs, chunk] = dh_ref[rs, chunk] + _dot(dz, w_chunk(c), trans_b=True)
            return 0

        return jax.lax.fori_loop(0, num_chunks, update, 0)

    jax.lax.fori_loop(0, num_tiles, tile, 0)


def _dw_kernel_gpu(h_ref, w_ref, ids_ref, lse_ref, g_ref, dw_ref, *, vocab, block_n, block_v,
                   block_d, num_row_blocks, num_chunks, temperature, num_ids):
    col0 = pl.program_id(0) * block_v  # W and dW are whole arrays (pl.ANY pointers)

    def zero(c, _):
        gpu_cols(dw_ref, pl.ds(c * block_d, block_d), col0, block_v, vocab,
                 jnp.zeros((block_d, block_v), jnp.float32))
        return 0

    jax.lax.fori_loop(0, num_chunks, zero, 0)

    def rows(r, _):
        rs = pl.ds(r * block_n, block_n)
        z = chunked_logits(
            lambda c: h_ref[rs, pl.ds(c * block_d, block_d)],
            lambda c: gpu_cols(w_ref, pl.ds(c * block_d, block_d), col0, block_v, vocab),
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
            acc = gpu_cols(dw_ref, chunk, col0, block_v, vocab)
            gpu_cols(dw_ref, chunk, col0, block_v, vocab,
                     acc + _dot(h_ref[rs, chunk], dz, trans_a=True))
            return 0

        return jax.lax.fori_loop(0, num_chunks, update, 0)

    jax.lax.fori_loop(0, num_row_blocks, rows, 0)


def _backward_gpu(hp, w, ids, lse, g, *, vocab, temperature, num_ids, blocks, interpret):
    from jax.experimental.pallas import triton as pltriton

    np_, dp = hp.shape
    lanes, stat = ids.shape[1], lse.shape[1]
    s = hp.dtype.itemsize
    bn, bv, bd = blocks.block_n, blocks.block_v, blocks.block_d
    bn2, bv2 = blocks.block_n_dw, blocks.block_v_dw
    tiles, tiles2 = pl.cdiv(vocab, bv), pl.cdiv(vocab, bv2)
    params = pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    common = dict(vocab=vocab, temperature=temperature, num_ids=num_ids, block_d=bd,
                  num_chunks=dp // bd)
    small = np_ * (2 * lanes + stat) * 4  # ids, g, lse
    # Loads per program: dh reads h and W twice per vocab tile (logits, then dz @ W^T) and
    # updates its f32 dh rows once per tile; dW the same with h and its dW columns.
    dh = pl.pallas_call(
        functools.partial(_dh_kernel_gpu, block_v=bv, num_tiles=tiles, **common),
        grid=(np_ // bn,),
        in_specs=[_ANY, _ANY,
                  pl.BlockSpec((bn, lanes), lambda i: (i, 0)),
                  pl.BlockSpec((bn, stat), lambda i: (i, 0)),
                  pl.BlockSpec((bn, lanes), lambda i: (i, 0))],
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct((np_, dp), jnp.float32),
        compiler_params=params,
        cost_estimate=cost_estimate(
            rows=np_, d=dp, vocab=vocab, matmuls=2,
            bytes_accessed=(np_ // bn) * 2 * dp * vocab * s + tiles * np_ * dp * (s + 8)
            + small),
        interpret=interpret,
        name="fused_logprobs_bwd_dh",
    )(hp, w, ids, lse, g)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel_gpu, block_n=bn2, block_v=bv2, num_row_blocks=np_ // bn2,
                          **common),
        grid=(tiles2,),
        in_specs=[_ANY] * 5,
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct((dp, vocab), jnp.float32),
        compiler_params=params,
        cost_estimate=cost_estimate(
            rows=np_, d=dp, vocab=vocab, matmuls=2,
            bytes_accessed=tiles2 * (2 * np_ * dp * s + small)
            + (np_ // bn2) * dp * vocab * (s + 8)),
        interpret=interpret,
        name="fused_logprobs_bwd_dw",
    )(hp, w, ids, lse, g)
    return dh.astype(hp.dtype), dw.astype(w.dtype)


def fused_logprobs_backward(hp, w, ids, lse, g, *, vocab, temperature, num_ids, blocks,
                            interpret):
    """dh [Np, d] and dW [d, V] (the parameters' dtype) from row-padded operands: hp [Np, d]
    (rows padded to the row blocks), the head w [d, V] itself (not padded: the last vocab tile
    is ragged), ids / g int32 / f32 [Np, L] id columns and their cotangents, lse f32 [Np, S]."""
    fn = _backward_gpu if blocks.platform == "gpu" else _backward_tpu
    return fn(hp, w, ids, lse, g, vocab=vocab, temperature=temperature, num_ids=num_ids,
              blocks=blocks, interpret=interpret)
