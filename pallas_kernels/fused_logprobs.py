"""Fused LM-head log-probs: log-softmax gathers without materialising [N, V] logits.

Given hidden states h [N, d], the LM head W [d, V] and a temperature T, the logits are
``z = (h @ W) / T`` (f32 accumulation). The op returns

  target_logp   [N]     log_softmax(z)[n, targets[n]]
  topk_logp     [N, K]  log_softmax(z)[n, topk_indices[n, k]]      (given indices)
  own_topk_logp [N, K'] the K' largest log-probs of each row, descending  (no gradient)
  own_topk_idx  [N, K'] their vocabulary indices (int32; ties: lower index first)

``fused_logprobs_reference`` below materialises the logits and defines the semantics.

``fused_logprobs`` is the Pallas kernel. The target and the given top-K ids travel as one
lane-dense id matrix [N, L] (column 0 the target, then the K given ids, then -1 padding;
L = K + 1 rounded up to 128 on TPU, to a power of two on GPU), and the kernel returns the
log-probs at those columns, [N, L], plus the row logsumexp (kept for the backward pass).

* TPU (Mosaic): grid (row blocks, vocab tiles), the vocab axis last and sequential
  ("arbitrary"). The online logsumexp (running max and sum) lives in VMEM scratch and the
  gathered logits in the resident output block, initialised at the first vocab tile and
  finished (minus the logsumexp) at the last.
* GPU (Triton, chosen over Mosaic GPU because the kernel is a plain blocked matmul with
  reductions that Triton lowers directly, while Mosaic GPU needs warpgroup/TMA-level code
  and has no lowering for the iota/compare gathers used here): Triton programs are
  independent, so each program owns a row block and loops over vocab tiles in the kernel,
  accumulating each logit tile over ``block_d`` chunks of the hidden dim (a 16-row bf16
  block of h at d = 8192 is already 256 KiB, more than a block's shared memory).

The head is not padded: the vocab grid (TPU) or loop (GPU) runs cdiv(V, block_v) tiles and
the ragged last tile is masked (logits of columns >= V are -inf; masked loads on GPU), so a
per-shard vocabulary such as 151,936 / 4 needs no multiple of the block. Only the rows are
padded to the row block (a no-op when N is a multiple of it, as at production sizes) and,
on GPU, the hidden dim when d is not a multiple of 16. On TPU a V that is not a multiple of
128 still costs a copy, made by XLA, not here: it lays such a [d, V] parameter out column-
major and relays it out for the kernel (0.29 GiB at d 4,096, V 37,984), so make per-shard
vocabularies multiples of 128 where the params are made. Block sizes
and TPU VMEM limits per chip: ``fused_logprobs_blocks``. Compiled range (deviceless compiles
for v5e, v5p, v6e, H100 and H200, forward and backward): N = 8,192 rows, d 4,096 and 8,192,
bf16 and f32, V up to 262,144 (per-shard V such as 151,936 / 4 included), up to 127 given
top-K ids; beyond that the TPU blocks are not compiler-checked (see that module).

The distribution's own top-K' is computed outside the kernel, by a second XLA pass over
vocab tiles that uses the kernel's logsumexp (a running ``lax.top_k`` merge; an in-kernel
top-k would need K' rounds of max selection per tile). The backward kernels are in
``fused_logprobs_bwd.py``. On CPU the kernel only runs with ``interpret=True``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import fused_logprobs_bwd
from pallas_kernels.fused_logprobs_blocks import FusedLogprobsBlockSizes
from pallas_kernels.fused_logprobs_bwd import chunked_logits, cost_estimate, gpu_cols, mask_logits

__all__ = ["FusedLogprobsBlockSizes", "FusedLogprobsOutput", "fused_logprobs",
           "fused_logprobs_reference", "fused_logprobs_rows"]

_NEG_INF = float("-inf")


class FusedLogprobsOutput(NamedTuple):
    """Outputs of the fused log-prob ops; absent parts are None."""

    target_logp: jax.Array  # [N] f32
    topk_logp: jax.Array | None  # [N, K] f32 at the given indices
    own_topk_logp: jax.Array | None  # [N, K'] f32, descending (stop-gradient)
    own_topk_indices: jax.Array | None  # [N, K'] int32


def validate_inputs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None,
    own_topk: int,
    temperature: float,
) -> None:
    """Raises ValueError / TypeError naming the bad value (shared by every backend)."""
    if hidden.ndim < 2:
        raise ValueError(f"hidden must be [..., d], got shape {hidden.shape}")
    if head.ndim != 2:
        raise ValueError(f"head must be [d, V], got shape {head.shape}")
    if hidden.shape[-1] != head.shape[0]:
        raise ValueError(
            f"hidden's last dim {hidden.shape[-1]} must equal head's first dim {head.shape[0]} "
            f"(hidden {hidden.shape}, head {head.shape})"
        )
    for name, x in (("hidden", hidden), ("head", head)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    if hidden.dtype != head.dtype:
        raise TypeError(f"hidden dtype {hidden.dtype} differs from head dtype {head.dtype}; cast one")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {targets.shape} must equal hidden's leading shape {hidden.shape[:-1]}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if topk_indices is not None:
        if topk_indices.ndim != hidden.ndim or topk_indices.shape[:-1] != hidden.shape[:-1]:
            raise ValueError(
                f"topk_indices shape {topk_indices.shape} must be {hidden.shape[:-1]} + (K,)"
            )
        if not jnp.issubdtype(topk_indices.dtype, jnp.integer):
            raise TypeError(f"topk_indices must be integer, got dtype {topk_indices.dtype}")
    vocab = head.shape[1]
    if not isinstance(own_topk, int) or own_topk < 0 or own_topk > vocab:
        raise ValueError(f"own_topk must be an int in [0, V={vocab}], got {own_topk!r}")
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def fused_logprobs_reference(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    own_topk: int = 0,
    temperature: float = 1.0,
) -> FusedLogprobsOutput:
    """Pure-jnp semantics (materialises [N, V] logits). Shapes as in the module docstring."""
    validate_inputs(hidden, head, targets, topk_indices, own_topk, temperature)
    logits = jnp.dot(hidden, head, preferred_element_type=jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    topk_logp = None
    if topk_indices is not None:
        topk_logp = jnp.take_along_axis(logp, topk_indices.astype(jnp.int32), axis=-1)
    own_vals = own_idx = None
    if own_topk:
        own_vals, own_idx = jax.lax.top_k(jax.lax.stop_gradient(logp), own_topk)
        own_idx = own_idx.astype(jnp.int32)
    return FusedLogprobsOutput(target_logp, topk_logp, own_vals, own_idx)



# ------------------------------------------------------------------------------- kernels


def gather_ids(z, cols, id_of, num_ids, lanes, *, unroll):
    """[bn, lanes] f32: z[n, ids[n, k]] in column k for ids inside this tile, else 0.

    ``id_of(k)`` returns id column k as [bn, 1]; ``unroll`` (TPU, where it is a static value
    slice) unrolls the loop over ids, else (GPU, a ref load at a dynamic lane) a fori_loop."""
    kpos = jax.lax.broadcasted_iota(jnp.int32, (z.shape[0], lanes), 1)

    def one(k, acc):
        val = jnp.sum(jnp.where(cols == id_of(k), z, 0.0), axis=1, keepdims=True)
        return jnp.where(kpos == k, val, acc)

    acc = jnp.zeros((z.shape[0], lanes), jnp.float32)
    if unroll:
        for k in range(num_ids):
            acc = one(k, acc)
        return acc
    return jax.lax.fori_loop(0, num_ids, one, acc)


def _fwd_kernel_tpu(h_ref, w_ref, ids_ref, lse_ref, logp_ref, m_ref, s_ref, *,
                    vocab, block_v, temperature, num_ids):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _NEG_INF, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        logp_ref[...] = jnp.zeros(logp_ref.shape, jnp.float32)

    z = jax.lax.dot_general(h_ref[...], w_ref[...], (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    z, cols = mask_logits(z, j * block_v, vocab, temperature)
    m_prev = m_ref[...]  # [bn, 128], every lane holds the row's value
    m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
    s_ref[...] = (s_ref[...] * jnp.exp(m_prev - m_new)
                  + jnp.sum(jnp.exp(z - m_new[:, 0:1]), axis=1, keepdims=True))
    m_ref[...] = m_new
    ids = ids_ref[...]
    logp_ref[...] += gather_ids(z, cols, lambda k: ids[:, k:k + 1], num_ids, ids.shape[1],
                              unroll=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse = m_ref[...] + jnp.log(s_ref[...])
        lse_ref[...] = lse
        logp_ref[...] = logp_ref[...] - lse[:, 0:1]


def _fwd_kernel_gpu(h_ref, w_ref, ids_ref, lse_ref, logp_ref, *, vocab, block_v, block_d,
                    num_tiles, num_chunks, temperature, num_ids):
    bn, lanes = logp_ref.shape
    rs = pl.ds(pl.program_id(0) * bn, bn)  # h and W are whole arrays (pl.ANY pointers)

    def tile(j, carry):
        m, s, acc = carry
        col0 = j * block_v
        z = chunked_logits(
            lambda c: h_ref[rs, pl.ds(c * block_d, block_d)],
            lambda c: gpu_cols(w_ref, pl.ds(c * block_d, block_d), col0, block_v, vocab),
            num_chunks, block_d)
        z, cols = mask_logits(z, col0, vocab, temperature)
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new), axis=1, keepdims=True)
        acc = acc + gather_ids(z, cols, lambda k: ids_ref[:, pl.ds(k, 1)], num_ids, lanes,
                                   unroll=False)
        return m_new, s, acc

    init = (jnp.full((bn, 1), _NEG_INF, jnp.float32), jnp.zeros((bn, 1), jnp.float32),
            jnp.zeros((bn, lanes), jnp.float32))
    m, s, acc = jax.lax.fori_loop(0, num_tiles, tile, init)
    lse = m + jnp.log(s)
    lse_ref[...] = lse
    logp_ref[...] = acc - lse


def _forward_call(hp, w, ids, *, vocab, temperature, num_ids, blocks, interpret):
    """lse [Np, S] and log-probs at the id columns [Np, L] from row-padded h and ids and the
    unpadded head w [d, V] (the last vocab tile is ragged and masked)."""
    np_, dp = hp.shape
    lanes, stat = ids.shape[1], blocks.stat_lanes
    bn, bv = blocks.block_n, blocks.block_v
    s, tiles = hp.dtype.itemsize, pl.cdiv(vocab, bv)
    small = np_ * (2 * lanes + stat) * 4  # ids in; lse, log-probs out
    out_shape = (jax.ShapeDtypeStruct((np_, stat), jnp.float32),
                 jax.ShapeDtypeStruct((np_, lanes), jnp.float32))
    if blocks.platform == "tpu":
        return pl.pallas_call(
            functools.partial(_fwd_kernel_tpu, vocab=vocab, block_v=bv, temperature=temperature,
                              num_ids=num_ids),
            grid=(np_ // bn, tiles),
            in_specs=[pl.BlockSpec((bn, dp), lambda i, j: (i, 0)),
                      pl.BlockSpec((dp, bv), lambda i, j: (0, j)),
                      pl.BlockSpec((bn, lanes), lambda i, j: (i, 0))],
            out_specs=[pl.BlockSpec((bn, stat), lambda i, j: (i, 0)),
                       pl.BlockSpec((bn, lanes), lambda i, j: (i, 0))],
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((bn, stat), jnp.float32),
                            pltpu.VMEM((bn, stat), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                                 vmem_limit_bytes=blocks.vmem_limit_bytes),
            cost_estimate=cost_estimate(  # W once per row block, h and ids once
                rows=np_, d=dp, vocab=vocab, matmuls=1,
                bytes_accessed=(np_ // bn) * dp * vocab * s + np_ * dp * s + small),
            interpret=interpret,
            name="fused_logprobs_fwd",
        )(hp, w, ids)
    from jax.experimental.pallas import triton as pltriton

    bd = blocks.block_d
    return pl.pallas_call(
        functools.partial(_fwd_kernel_gpu, vocab=vocab, block_v=bv, block_d=bd,
                          num_tiles=tiles, num_chunks=dp // bd, temperature=temperature,
                          num_ids=num_ids),
        grid=(np_ // bn,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((bn, lanes), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bn, stat), lambda i: (i, 0)),
                   pl.BlockSpec((bn, lanes), lambda i: (i, 0))],
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                num_stages=blocks.num_stages),
        cost_estimate=cost_estimate(  # each program reads all of W and its h rows per tile
            rows=np_, d=dp, vocab=vocab, matmuls=1,
            bytes_accessed=(np_ // bn) * dp * vocab * s + tiles * np_ * dp * s + small),
        interpret=interpret,
        name="fused_logprobs_fwd",
    )(hp, w, ids)


def _pad_axis(x, axis, multiple, value=0):
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _own_topk(h, w, lse, k, temperature, tile=2048):
    """The K' largest log-probs per row and their ids: an XLA pass over vocab tiles of W
    with a running ``lax.top_k`` merge (ties: lower index first), minus the kernel's lse.
    A scan over the full tiles, then one step on the remainder tile (W is not padded)."""
    n, vocab = h.shape[0], w.shape[1]
    tile = min(tile, vocab)
    num, rem = divmod(vocab, tile)

    def merge(carry, w_tile, col0):
        vals, idx = carry
        z = jnp.dot(h, w_tile, preferred_element_type=jnp.float32) / temperature
        v, i = jax.lax.top_k(z, min(k, w_tile.shape[1]))
        cat_v = jnp.concatenate([vals, v], axis=1)
        cat_i = jnp.concatenate([idx, i.astype(jnp.int32) + col0], axis=1)
        vals, pos = jax.lax.top_k(cat_v, k)
        return vals, jnp.take_along_axis(cat_i, pos, axis=1)

    def body(carry, j):
        col0 = j * tile
        return merge(carry, jax.lax.dynamic_slice_in_dim(w, col0, tile, axis=1), col0), None

    init = (jnp.full((n, k), _NEG_INF, jnp.float32), jnp.zeros((n, k), jnp.int32))
    carry, _ = jax.lax.scan(body, init, jnp.arange(num, dtype=jnp.int32))
    if rem:
        carry = merge(carry, w[:, num * tile:], num * tile)
    vals, idx = carry
    return vals - lse[:, None], idx


def _prepare(h, w, ids, blocks):
    """Pads rows and id columns to the kernels' blocks; W only on GPU when d is not a
    multiple of block_d (``clamp`` makes block_d divide d whenever 16 does)."""
    num_rows = max(blocks.block_n, blocks.block_n_dw)
    hp, wp = _pad_axis(h, 0, num_rows), w
    if blocks.platform == "gpu" and h.shape[1] % blocks.block_d:
        hp, wp = _pad_axis(hp, 1, blocks.block_d), _pad_axis(w, 0, blocks.block_d)
    lanes = blocks.id_lanes(ids.shape[1])
    ids = _pad_axis(_pad_axis(ids, 1, lanes, -1), 0, num_rows, -1)
    return hp, wp, ids


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_ids(h, w, ids, temperature, blocks, interpret):
    return _fused_ids_fwd(h, w, ids, temperature, blocks, interpret)[0]


def _fused_ids_fwd(h, w, ids, temperature, blocks, interpret):
    n, num_ids = ids.shape
    hp, wp, idp = _prepare(h, w, ids, blocks)
    lse, logp = _forward_call(hp, wp, idp, vocab=w.shape[1], temperature=temperature,
                              num_ids=num_ids, blocks=blocks, interpret=interpret)
    return (logp[:n, :num_ids], lse[:n, 0]), (hp, wp, idp, lse, h.shape, w.shape)


def _fused_ids_bwd(temperature, blocks, interpret, res, cts):
    hp, wp, idp, lse, h_shape, w_shape = res
    g, _ = cts  # the logsumexp output is internal (own top-K is stop-gradient)
    n, num_ids = g.shape
    gp = jnp.zeros(idp.shape, jnp.float32).at[:n, :num_ids].set(g.astype(jnp.float32))
    dh, dw = fused_logprobs_bwd.fused_logprobs_backward(
        hp, wp, idp, lse, gp, vocab=w_shape[1], temperature=temperature, num_ids=num_ids,
        blocks=blocks, interpret=interpret)
    zero_ids = jnp.zeros((n, num_ids), jax.dtypes.float0)
    return dh[:h_shape[0], :h_shape[1]], dw[:w_shape[0]], zero_ids


_fused_ids.defvjp(_fused_ids_fwd, _fused_ids_bwd)


def flatten_rows(hidden: jax.Array, targets: jax.Array, topk_indices: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None, tuple[int, ...]]:
    """Any leading shape -> rows: (h [N, d], targets [N] int32, topk_indices [N, K] int32 |
    None, the leading shape). Every backend's public wrapper uses this and
    :func:`unflatten_rows`; the row functions below assume validated inputs."""
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(jnp.int32)
    k = None
    if topk_indices is not None:
        k = topk_indices.reshape(h.shape[0], topk_indices.shape[-1]).astype(jnp.int32)
    return h, t, k, lead


def unflatten_rows(out: FusedLogprobsOutput, lead: tuple[int, ...]) -> FusedLogprobsOutput:
    """Row outputs ([N], [N, K]) back to the leading shape ([...], [..., K])."""
    return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), out)


@functools.partial(
    jax.jit, static_argnames=("own_topk", "temperature", "block_sizes", "interpret")
)
def fused_logprobs_rows(h: jax.Array, head: jax.Array, targets: jax.Array,
                        topk_indices: jax.Array | None = None, *, own_topk: int = 0,
                        temperature: float = 1.0,
                        block_sizes: FusedLogprobsBlockSizes | None = None,
                        interpret: bool = False) -> FusedLogprobsOutput:
    """The kernel on rows (h [N, d], targets [N] int32, topk_indices [N, K] int32 | None),
    inputs already validated; outputs [N] / [N, K]."""
    n, d = h.shape
    cols = [targets.reshape(n, 1)]
    if topk_indices is not None:
        cols.append(topk_indices)
    ids = jnp.concatenate(cols, axis=1)
    blocks = block_sizes or FusedLogprobsBlockSizes.get_default(
        d=d, dtype=h.dtype, num_ids=ids.shape[1])
    blocks = blocks.clamp(n, head.shape[1], d)
    logp, lse = _fused_ids(h, head, ids, float(temperature), blocks, interpret)
    own_v = own_i = None
    if own_topk:
        own_v, own_i = _own_topk(jax.lax.stop_gradient(h), jax.lax.stop_gradient(head),
                                 jax.lax.stop_gradient(lse), own_topk, float(temperature))
    return FusedLogprobsOutput(logp[:, 0], logp[:, 1:] if topk_indices is not None else None,
                               own_v, own_i)


def fused_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    own_topk: int = 0,
    temperature: float = 1.0,
    block_sizes: FusedLogprobsBlockSizes | None = None,
    interpret: bool = False,
) -> FusedLogprobsOutput:
    """Pallas fused log-probs. hidden [..., d], head [d, V], targets [...] int,
    topk_indices [..., K] int or None; outputs shaped [...] / [..., K] (see module docstring).

    Differentiable in hidden and head (target_logp and topk_logp); own top-K is stop-gradient.
    ``block_sizes`` picks the kernel layout too (its ``platform``); default
    ``FusedLogprobsBlockSizes.get_default()`` for this backend, d and dtype (on TPU the
    blocks and VMEM limit that compile on every chip; pass ``get_default(chip=...)``'s
    blocks for one chip's)."""
    validate_inputs(hidden, head, targets, topk_indices, own_topk, temperature)
    h, t, k, lead = flatten_rows(hidden, targets, topk_indices)
    out = fused_logprobs_rows(h, head, t, k, own_topk=own_topk, temperature=float(temperature),
                              block_sizes=block_sizes, interpret=interpret)
    return unflatten_rows(out, lead)


# --------------------------------------------------------------- measuring the table (libtpu)


def kernel_vmem_need(chip: str, kernel: str, blocks: FusedLogprobsBlockSizes, *, d: int,
                     dtype, num_ids: int = 101, start_mib: float = 16.0, rows: int | None = None,
                     vocab: int | None = None) -> float | None:
    """MiB of scoped VMEM the compiler needs for one kernel ("fwd", "dh", "dw") on a TPU chip,
    from deviceless compiles (needs libtpu, see ../shared/reference/accelerators.md), or None
    when it exceeds the core's VMEM: ``targets.min_vmem_limit`` from ``start_mib`` in 1/4 MiB
    steps (each refused compile says by how much its allocations overran the limit). The grid
    is small by default (2 row blocks, a ragged vocab of 2.5 tiles), which sets most kernels'
    need; ``rows`` and ``vocab`` give another (production) grid."""
    from pallas_kernels import targets as chips  # (``targets`` is an argument name here)

    bn = max(blocks.block_n, blocks.block_n_dw)
    bv = blocks.block_v if kernel != "dw" else blocks.block_v_dw
    n, vocab, lanes = rows or 2 * bn, vocab or 2 * bv + bv // 2, blocks.id_lanes(num_ids)

    spec = jax.ShapeDtypeStruct

    args = (spec((n, d), dtype), spec((d, vocab), dtype), spec((n, lanes), jnp.int32),
            spec((n, 128), jnp.float32), spec((n, lanes), jnp.float32))

    def fn(h, w, ids, lse, g, blocks):
        kw = dict(vocab=vocab, temperature=1.0, num_ids=num_ids, blocks=blocks, interpret=False)
        if kernel == "fwd":
            return _forward_call(h, w, ids, **kw)
        return fused_logprobs_bwd.fused_logprobs_backward(h, w, ids, lse, g, **kw)[kernel == "dw"]

    mib = 2**20
    need = chips.min_vmem_limit(functools.partial(fn, blocks=blocks), args, chip,
                                lo=int(start_mib * mib), step=mib // 4)
    return None if need is None else need / mib


# python -m pallas_kernels.fused_logprobs CHIP DTYPE D BN BV BN2 BV2 [KERNELS [IDS [N V]]]
if __name__ == "__main__":
    import sys

    chip_, dt_, *nums = sys.argv[1:8]
    d_, bn_, bv_, bn2_, bv2_ = map(int, nums)
    b_ = FusedLogprobsBlockSizes(block_n=bn_, block_v=bv_, block_n_dw=bn2_, block_v_dw=bv2_)
    ids_ = int(sys.argv[9]) if len(sys.argv) > 9 else 101
    grid_ = dict(rows=int(sys.argv[10]), vocab=int(sys.argv[11])) if len(sys.argv) > 11 else {}
    for k_ in sys.argv[8].split(",") if len(sys.argv) > 8 else ["fwd", "dh", "dw"]:
        need_ = kernel_vmem_need(chip_, k_, b_, d=d_, dtype=jnp.dtype(dt_), num_ids=ids_,
                                 **grid_)
        print(chip_, dt_, d_, (bn_, bv_, bn2_, bv2_), k_, f"ids={ids_}", need_, "MiB", flush=True)
