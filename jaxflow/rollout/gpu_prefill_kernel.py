"""A Pallas (Triton) GPU kernel for the engine's prefill attention: each row's chunk of queries
against that row's keys, read page by page through the page table inside the kernel.

``gpu_prefill_attention(q, k_pages, v_pages, page_table, start, n_valid)`` computes
:func:`jaxflow.rollout.prefill_attention.xla_prefill_attention` (the reference) on every real
query: row r feeds the chunk ``q[r, :n_valid[r]]`` at positions ``start[r] + i``, each query
attending to the row's keys at slots <= its position, slot t living in page
``page_table[r, t // S]`` at offset ``t % S``. Padding queries (``i >= n_valid[r]``) give zeros,
and the key blocks only they would read are never loaded:

  q           [R, C, H, D]       the chunk's queries (RoPE applied), H = KVH * G
  k_pages     [KVH, P, S, D']    the pools; D' = D or a padded width (zeros past D)
  v_pages     [KVH, P, S, D']
  page_table  [R, W] int32       entries are clipped to [0, P)
  start, n_valid  [R] int32

The grid is (R, KVH, C / block_c): one program takes ``block_c`` consecutive queries of one row
and the G query heads that share one K/V head (GQA folded into the rows of the product:
``block_q = block_c * G`` rows, each K/V block loaded once per group), and loops over blocks of
``pages_per_block`` pages (``block_k`` = pages_per_block * S keys) up to the last key its last
real query sees: the causal bound of a prefill at offset ``start[r]`` (upstream's
``pallas.ops.gpu.attention.mha`` has no such offset, hence a kernel of its own, structured as
that one: online softmax in f32, unnormalised accumulator scaled once at the end). Logits
``q.k * D^-0.5`` and the softmax are f32; probabilities are cast to the value dtype for P.V
with f32 accumulation; f32 inputs multiply at full precision (no TF32).

Triton needs every in-kernel array power-of-2 sized: C is padded to a multiple of block_c, G to
a power of 2 (zero queries, cut off after), the table to a multiple of pages_per_block (page 0,
never read: the loop stops at the last real key), and a pool whose D' is not a power of 2 is
padded (a copy; D 64 and 128 pools, padded or not, go as they are). S must be a power of 2
(:func:`kernel_problem` says why not otherwise).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["GpuPrefillBlockSizes", "gpu_prefill_attention", "kernel_problem"]

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - m) is 0, not NaN
MIN_DOT = 16  # Triton's smallest dot operand side


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class GpuPrefillBlockSizes:
    """Tiles of :func:`gpu_prefill_attention` (powers of 2, >= 16).

    block_q: query rows per program (chunk queries x the G heads of one K/V head);
    block_k: keys per loop step (rounded up to whole pages: at least one page);
    num_warps, num_stages: Triton's launch and software-pipelining settings."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not _pow2(value) or value < MIN_DOT:
                raise ValueError(f"GpuPrefillBlockSizes.{name}={value}; valid: a power of 2 "
                                 f">= {MIN_DOT}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"GpuPrefillBlockSizes num_warps={self.num_warps}, num_stages="
                             f"{self.num_stages}; valid: num_warps in 1, 2, 4, 8, 16 and "
                             "num_stages >= 1")

    @classmethod
    def get_default(cls, head_dim: int = 128, dtype=jnp.bfloat16) -> GpuPrefillBlockSizes:
        """H100 / H200 tiles (227 KiB of shared memory per block): 128 query rows x 64 keys
        with 8 warps for 2-byte inputs at head_dim > 64; 64 x 64 with 4 warps otherwise (f32
        tiles are twice the bytes)."""
        if jnp.dtype(dtype).itemsize <= 2 and head_dim > 64:
            return cls(block_q=128, block_k=64, num_warps=8, num_stages=2)
        return cls(block_q=64, block_k=64, num_warps=4, num_stages=2)


def kernel_problem(q_shape, pool_shape) -> str | None:
    """Why the kernel cannot take these shapes (q [R, C, H, D], pool [KVH, P, S, D']), or None."""
    (_, _, h, d), (kvh, _, s, width) = q_shape, pool_shape
    if not _pow2(s):
        return f"page size {s} is not a power of 2 (Triton loads whole pages)"
    if h % kvh:
        return f"KVH={kvh} does not divide H={h}"
    if width < d:
        return f"pool head_dim {width} < q head_dim {d}"
    return None


def _prefill_kernel(start_ref, n_valid_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *,
                    block_c: int, groups: int, pages_per_block: int, sm_scale: float,
                    precision):
    """One (row, K/V head, query block) program. Refs: start / n_valid [1], table [W'],
    q / o [block_c, G, D'], k / v [P, S, D'] (this K/V head's pool)."""
    from jax.experimental.pallas import triton as plgpu  # imported on use: CPU jobs never load Triton
    block_q, width = block_c * groups, q_ref.shape[-1]
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    first = pl.program_id(2) * block_c  # the block's first chunk query
    start, n_valid = start_ref[0], n_valid_ref[0]
    query = first + lax.div(jnp.arange(block_q, dtype=jnp.int32), jnp.int32(groups))
    position = start + query  # [block_q]
    end = jnp.minimum(first + block_c, n_valid)  # past the block's last real query
    # keys 0 .. start + end - 1 (none when the block is all padding), within the table
    n_blocks = jnp.where(end > first, lax.div(start + end - 1, jnp.int32(block_k)) + 1, 0)
    n_blocks = jnp.minimum(n_blocks, table_ref.shape[0] // pages_per_block)
    q = q_ref[...].reshape(block_q, width)

    def body(kb, carry):
        acc, m_prev, l_prev = carry
        pages = table_ref[pl.ds(kb * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(block_k, width)
        v = v_ref[pages].reshape(block_k, width)
        logits = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale
        slot = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        logits = jnp.where(slot[None, :] <= position[:, None], logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = correction * l_prev + jnp.sum(p, axis=1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return correction[:, None] * acc + pv, m_next, l_next

    init = (jnp.zeros((block_q, width), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, _, l_sum = lax.fori_loop(0, n_blocks, body, init)
    real = (query < n_valid) & (l_sum > 0)
    out = jnp.where(real[:, None], acc / jnp.where(real, l_sum, 1.0)[:, None], 0.0)
    o_ref[...] = out.reshape(block_c, groups, width).astype(o_ref.dtype)


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, extra)
    return jnp.pad(x, pads, constant_values=value)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def gpu_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                          page_table: jax.Array, start: jax.Array, n_valid: jax.Array, *,
                          block_sizes: GpuPrefillBlockSizes | None = None,
                          interpret: bool = False) -> jax.Array:
    """Causal prefill attention over the paged pool, pages read in the kernel (module docstring).

    Args:
      q: [R, C, H, D] queries; k_pages, v_pages: [KVH, P, S, D'] pools (D' >= D, zeros past
        D), KVH divides H, S a power of 2.
      page_table: [R, W] int; start, n_valid: [R] int (row r's queries at start + i).
      block_sizes: tiles (default ``GpuPrefillBlockSizes.get_default(D', q.dtype)``).
      interpret: run in Pallas interpret mode (any platform).

    Returns:
      [R, C, H, D] in q.dtype; queries past n_valid[r] are zeros.
    """
    ranks_ok = (q.ndim, k_pages.ndim, page_table.ndim, start.ndim, n_valid.ndim) == (4, 4, 2, 1, 1)
    problem = kernel_problem(q.shape, k_pages.shape) if ranks_ok else None
    if (not ranks_ok or problem or v_pages.shape != k_pages.shape
            or {page_table.shape[0], start.shape[0], n_valid.shape[0]} != {q.shape[0]}):
        raise ValueError(f"gpu_prefill_attention: q {q.shape}, k_pages {k_pages.shape}, "
                         f"v_pages {v_pages.shape}, page_table {page_table.shape}, start "
                         f"{start.shape}, n_valid {n_valid.shape}: " + (problem or (
                             "need q [R, C, H, D], equal pools [KVH, P, S, D'], page_table "
                             "[R, W], start and n_valid [R]")))
    r, c, h, d = q.shape
    kvh, _, s, width = k_pages.shape
    blocks = block_sizes or GpuPrefillBlockSizes.get_default(width, q.dtype)
    lanes = max(MIN_DOT, _next_pow2(width))
    groups = _next_pow2(h // kvh)
    block_c = max(1, blocks.block_q // groups)
    if block_c * groups < MIN_DOT:
        block_c = MIN_DOT // groups
    per_block = max(1, blocks.block_k // s)
    c_pad = -(-c // block_c) * block_c
    w_pad = -(-page_table.shape[1] // per_block) * per_block
    # q as [R, C', KVH, G', D'']: a free reshape; the pads are copies only where a size is off
    qg = q.reshape(r, c, kvh, h // kvh, d)
    qg = _pad_axis(_pad_axis(_pad_axis(qg, 1, c_pad), 3, groups), 4, lanes)
    k_pages, v_pages = _pad_axis(k_pages, 3, lanes), _pad_axis(v_pages, 3, lanes)
    table = _pad_axis(jnp.clip(page_table.astype(jnp.int32), 0, k_pages.shape[1] - 1), 1, w_pad)
    from jax.experimental.pallas import triton as plgpu  # imported on use, as above

    f32 = jnp.dtype(q.dtype) == jnp.float32 or jnp.dtype(k_pages.dtype) == jnp.float32
    kernel = functools.partial(_prefill_kernel, block_c=block_c, groups=groups,
                               pages_per_block=per_block, sm_scale=d ** -0.5,
                               precision=lax.Precision.HIGHEST if f32 else None)
    pool_spec = pl.BlockSpec((None,) + k_pages.shape[1:], lambda i, g, j: (g, 0, 0, 0))
    q_spec = pl.BlockSpec((None, block_c, None, groups, lanes), lambda i, g, j: (i, j, g, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(r, kvh, c_pad // block_c),
        in_specs=[pl.BlockSpec((1,), lambda i, g, j: (i,)),
                  pl.BlockSpec((1,), lambda i, g, j: (i,)),
                  pl.BlockSpec((None, w_pad), lambda i, g, j: (i, 0)),
                  q_spec, pool_spec, pool_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="gpu_prefill_attention",
    )(start.astype(jnp.int32), n_valid.astype(jnp.int32), table, qg, k_pages, v_pages)
    return out[:, :c, :, :h // kvh, :d].reshape(r, c, h, d)
