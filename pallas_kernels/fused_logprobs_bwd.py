"""Backward kernels of ``fused_logprobs``: dh and dW, recomputing the logits tile by tile.

With z = (h @ W) / T, lse the row logsumexp from the forward pass, and cotangents g_t [N]
(target log-probs) and g_k [N, K] (log-probs at given indices):

  dz[n, v] = (g_t[n] [v == t_n] + sum_k g_k[n, k] [v == idx_nk] - G_n softmax(z)[n, v]) / T,
  G_n = g_t[n] + sum_k g_k[n, k];   dh = dz @ W^T;   dW = h^T @ dz.

Two kernels as in flash-attention backward: ``dh`` owns row blocks and loops over vocab
tiles; ``dW`` owns vocab tiles and loops over row blocks. Neither holds [N, V].
Called from ``fused_logprobs._fused_bwd``; the semantics are those of
``fused_logprobs_reference``'s autodiff gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG_INF = float("-inf")


def tile_logits(h, w, col0, vocab, temperature):
    """f32 logits of one vocab tile with columns >= vocab (padding) set to -inf."""
    z = jnp.dot(h, w, preferred_element_type=jnp.float32) / temperature
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    return jnp.where(cols < vocab, z, _NEG_INF), cols


def tile_dlogits(z, cols, lse, t, g_t, kidx, g_k, temperature):
    """dz of one tile (see module docstring); kidx/g_k may be None."""
    p = jnp.exp(z - lse[:, None])
    total = g_t
    dz = jnp.where(cols == t[:, None], g_t[:, None], 0.0)
    if kidx is not None:
        total = total + jnp.sum(g_k, axis=1)
        for j in range(kidx.shape[1]):
            dz = dz + jnp.where(cols == kidx[:, j : j + 1], g_k[:, j : j + 1], 0.0)
    return (dz - total[:, None] * p) / temperature


def _dh_kernel(h_ref, w_ref, t_ref, k_ref, lse_ref, gt_ref, gk_ref, dh_ref,
               *, vocab, block_v, num_tiles, temperature, has_k):
    h = h_ref[...]
    t, lse, g_t = t_ref[...], lse_ref[...], gt_ref[...]
    kidx = k_ref[...] if has_k else None
    g_k = gk_ref[...] if has_k else None

    def body(i, acc):
        col0 = i * block_v
        w = w_ref[:, pl.ds(pl.multiple_of(col0, block_v), block_v)]
        z, cols = tile_logits(h, w, col0, vocab, temperature)
        dz = tile_dlogits(z, cols, lse, t, g_t, kidx, g_k, temperature)
        return acc + jax.lax.dot_general(
            dz.astype(w.dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = jax.lax.fori_loop(0, num_tiles, body, jnp.zeros(h.shape, jnp.float32))
    dh_ref[...] = acc.astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, t_ref, k_ref, lse_ref, gt_ref, gk_ref, dw_ref,
               *, vocab, block_n, block_v, num_row_blocks, temperature, has_k):
    w = w_ref[...]
    col0 = pl.program_id(0) * block_v

    def body(i, acc):
        rows = pl.ds(pl.multiple_of(i * block_n, block_n), block_n)
        h = h_ref[rows, :]
        kidx = k_ref[rows, :] if has_k else None
        g_k = gk_ref[rows, :] if has_k else None
        z, cols = tile_logits(h, w, col0, vocab, temperature)
        dz = tile_dlogits(z, cols, lse_ref[rows], t_ref[rows], gt_ref[rows], kidx, g_k, temperature)
        return acc + jax.lax.dot_general(
            h, dz.astype(h.dtype), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = jax.lax.fori_loop(0, num_row_blocks, body, jnp.zeros(w.shape, jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _pad_rows(x, multiple):
    pad = (-x.shape[0]) % multiple
    if pad == 0:
        return x
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))


def fused_logprobs_backward(h, w, t, kidx, lse, g_t, g_k, *, temperature, block_n, block_v,
                            interpret):
    """dh [N, d] and dW [d, V] for 2-D operands (padding handled here)."""
    n, d = h.shape
    vocab = w.shape[1]
    bn, bv = block_n, min(block_v, pl.next_power_of_2(vocab))
    has_k = kidx is not None and kidx.shape[1] > 0
    hp = _pad_rows(h, bn)
    np_ = hp.shape[0]
    wp = jnp.pad(w, [(0, 0), (0, (-vocab) % bv)])
    vp = wp.shape[1]
    tp = _pad_rows(t.astype(jnp.int32), bn)
    # Padded rows get zero cotangents, so their dz is exactly 0.
    lsep = _pad_rows(lse, bn)
    gtp = _pad_rows(g_t.astype(jnp.float32), bn)
    if has_k:
        kp, gkp = _pad_rows(kidx.astype(jnp.int32), bn), _pad_rows(g_k.astype(jnp.float32), bn)
    else:
        kp, gkp = jnp.zeros((np_, 1), jnp.int32), jnp.zeros((np_, 1), jnp.float32)
    kw = kp.shape[1]
    operands = (hp, wp, tp, kp, lsep, gtp, gkp)

    dh = pl.pallas_call(
        functools.partial(_dh_kernel, vocab=vocab, block_v=bv, num_tiles=vp // bv,
                          temperature=temperature, has_k=has_k),
        grid=(np_ // bn,),
        in_specs=[
            pl.BlockSpec((bn, d), lambda i: (i, 0)),
            pl.BlockSpec((d, vp), lambda i: (0, 0)),
            pl.BlockSpec((bn,), lambda i: (i,)),
            pl.BlockSpec((bn, kw), lambda i: (i, 0)),
            pl.BlockSpec((bn,), lambda i: (i,)),
            pl.BlockSpec((bn,), lambda i: (i,)),
            pl.BlockSpec((bn, kw), lambda i: (i, 0)),
        ],
        out_specs=pl.BlockSpec((bn, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((np_, d), h.dtype),
        interpret=interpret,
        name="fused_logprobs_bwd_dh",
    )(*operands)

    dw = pl.pallas_call(
        functools.partial(_dw_kernel, vocab=vocab, block_n=bn, block_v=bv,
                          num_row_blocks=np_ // bn, temperature=temperature, has_k=has_k),
        grid=(vp // bv,),
        in_specs=[
            pl.BlockSpec((np_, d), lambda j: (0, 0)),
            pl.BlockSpec((d, bv), lambda j: (0, j)),
            pl.BlockSpec((np_,), lambda j: (0,)),
            pl.BlockSpec((np_, kw), lambda j: (0, 0)),
            pl.BlockSpec((np_,), lambda j: (0,)),
            pl.BlockSpec((np_,), lambda j: (0,)),
            pl.BlockSpec((np_, kw), lambda j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((d, bv), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((d, vp), w.dtype),
        interpret=interpret,
        name="fused_logprobs_bwd_dw",
    )(*operands)
    return dh[:n], dw[:, :vocab]
