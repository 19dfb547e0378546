"""Embedding bag: gather rows of a table and sum (or average) them per bag.

``out[b] = sum_l table[ids[b, l]]`` over the valid (``>= 0``) ids of bag b, divided by their
count for ``mode="mean"`` (an empty bag gives zeros). Bags are padded ``int32[B, L]`` rows with
``-1`` padding; this is the segment-sum layout with segment id = row (``segment_ids = b``).
``embedding_bag_reference`` below defines the semantics in plain jnp.

The table never moves as a block: it stays in HBM (``memory_space=pl.ANY``) and only the
rows a bag names are fetched, accumulated in f32. Tables are float32 or bfloat16
(``unsupported_reason`` names why another dtype is not taken; the pooling dispatch then uses
XLA). Every embedding dim is supported, none padded:

* TPU (Mosaic), forward: grid (bag blocks, column blocks); each program's ids arrive in SMEM
  (a per-program SMEM block, not a whole-array scalar prefetch: 16,384 bags of 32 ids are
  2 MiB, more than SMEM); bag b+1's rows are DMA'd into one half of a double buffer while
  bag b is summed from the other. A DMA
  moves whole rows: Mosaic refuses a column slice at a dynamic offset that is not a multiple
  of 128 lanes, so the columns are split into ``block_d`` blocks only when ``block_d`` is a
  multiple of 128 that divides the dim (256, 512, ...); otherwise (16, 32, 64, 96, 100, 136,
  ...) a program takes the whole row. f32 rows are DMA'd one by one; bf16 rows are packed in
  8-row tiles in HBM (a single-row DMA at a dynamic row does not compile), so the aligned
  8-row window holding the row is DMA'd and the row selected in VMEM (8x the bytes moved; a
  bf16 table whose row count is not a multiple of 8 is padded, a copy). A bag longer than
  ``block_l`` ids is tiled over (a third, "arbitrary" grid dimension of chunks accumulating
  into the resident output block): buffers and DMA semaphores are sized to the chunk.
* TPU, backward: the table gradient is an in-place row update of a zero f32 [V, D] buffer in
  HBM (aliased input -> output; never a VMEM block): per bag, its rows (deduplicated within
  the bag beforehand, with multiplicities) are DMA'd in, the bag's cotangent added, and DMA'd
  back. Bag blocks run sequentially ("arbitrary") so repeated ids across bags are ordered;
  a long bag is walked in ``block_l``-id chunks the same way (its ids are deduplicated over
  the whole bag first, so chunks never share a row).
* GPU (Triton, chosen over Mosaic GPU: row gathers at data-dependent addresses are plain
  pointer loads in Triton, while Mosaic GPU needs 128-byte aligned TMA copies per row):
  forward programs loop over their bags and ids loading rows straight from the HBM table;
  backward scatters ``g[b]`` into the aliased f32 gradient with ``atomic_add``. A column
  block is a power of two; the lanes past the dim are masked (loads and atomics), so the
  table is never padded.

XLA on TPU stores a 2-D array whose last dim is not a multiple of 128 column-major, a Pallas
call takes it row-major: such a table passed as a jit argument is transposed first (an HBM
temp of about V x roundup(D, 128) x 4 bytes); ``jaxflow.embeddings`` pools the deduplicated
rows its lookup wrote, already in the kernel's layout.

The ids get no gradient. On CPU the kernels run only with ``interpret=True``; the default CPU
path (``jaxflow.embeddings.pooling``) is the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import dispatch

_MODES = ("sum", "mean")
_PLATFORMS = ("tpu", "gpu")
_DTYPES = ("float32", "bfloat16")
_ANY = pl.BlockSpec(memory_space=pl.ANY)
LANES = 128
BF16_ROW_WINDOW = 8  # rows per aligned DMA window of a 16-bit table on TPU
MAX_BLOCK_L = 256  # ids per TPU program chunk: 2 x 256 DMA semaphores are Mosaic's 2 KiB


@dataclasses.dataclass(frozen=True)
class EmbeddingBagBlockSizes:
    """Bags per program (block_b), table columns per program (block_d: on TPU used only
    when it is a multiple of 128 dividing the dim, else a program takes the whole row; on GPU
    a power of two, the lanes past the dim masked), TPU ids per program (block_l <= 256: a
    longer bag is tiled over in chunks), and the kernel layout."""

    platform: str = "tpu"
    block_b: int = 32
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 1
    block_l: int = 128

    def __post_init__(self):
        if self.platform not in _PLATFORMS:
            raise ValueError(f"platform {self.platform!r}; valid: {', '.join(_PLATFORMS)}")
        if self.block_l > MAX_BLOCK_L:
            raise ValueError(f"block_l={self.block_l!r}; valid: a power of two in [8, "
                             f"{MAX_BLOCK_L}] (two chunks' DMA semaphores fit 2 KiB)")
        for name in ("block_b", "block_d", "block_l"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 8 or v & (v - 1):
                raise ValueError(f"{name}={v!r}; must be a power of two >= 8")

    @classmethod
    def get_default(cls, platform: str | None = None) -> EmbeddingBagBlockSizes:
        """platform "tpu", "gpu" or None (``dispatch.backend_platform()``; CPU gets the TPU
        layout, which interpret mode runs)."""
        if platform is None:
            platform = "gpu" if dispatch.backend_platform() == "gpu" else "tpu"
        if platform == "gpu":
            return cls(platform="gpu", block_b=16, block_d=128, num_warps=4, num_stages=1)
        return cls(platform="tpu", block_b=32, block_d=128)

    def columns(self, dim: int) -> int:
        """Column block for rows of width ``dim``. TPU: ``block_d`` when it is a multiple of
        128 that divides a wider dim, else the whole row (a block may equal the array). GPU:
        the power of two >= dim, at most ``block_d`` (the tail lanes are masked)."""
        if self.platform == "tpu":
            split = self.block_d % LANES == 0 and dim > self.block_d and dim % self.block_d == 0
            return self.block_d if split else dim
        return min(self.block_d, max(8, 1 << (dim - 1).bit_length()))

    def chunk(self, bag_len: int) -> int:
        """TPU ids per program: the whole bag up to ``block_l`` ids, else ``block_l``."""
        return bag_len if bag_len <= self.block_l else self.block_l


def unsupported_reason(table_dtype) -> str | None:
    """Why the kernel does not take tables of ``table_dtype`` (None: it does; every dim is
    supported). The pooling dispatch passes this as ``blocked``."""
    name = jnp.dtype(table_dtype).name
    if name not in _DTYPES:
        return f"embedding_bag takes {' or '.join(_DTYPES)} tables, not {name}"
    return None


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


def _pad_to(x, axis, multiple, value=0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, widths, constant_values=value) if widths[axis][1] else x


def _cost(ids, dim, row_bytes, *, backward):
    """CostEstimate of one call: every id slot's row read (and written back, backward), one
    add (backward: a multiply-add) per element, plus the ids and the [B, D] f32 block."""
    n_ids = int(np.prod(ids.shape))
    per_row = 2 if backward else 1
    return pl.CostEstimate(
        flops=per_row * n_ids * dim, transcendentals=0,
        bytes_accessed=per_row * n_ids * row_bytes + n_ids * 4 * (2 if backward else 1)
        + ids.shape[0] * dim * 4)


# TPU

def _row_window(dtype) -> int:
    """Rows per DMA on TPU: 1 for 32-bit tables, an aligned 8-row window for 16-bit ones."""
    return 1 if jnp.dtype(dtype).itemsize == 4 else BF16_ROW_WINDOW


def _tpu_cols(j, block_d, dim):
    """Index of a program's columns: the whole row, or a 128-aligned dynamic block."""
    if block_d == dim:
        return slice(None)
    return pl.ds(pl.multiple_of(j * block_d, LANES), block_d)


def _row_copy(table_hbm, buf, sem, ids_ref, b, l, slot, cols, window):
    row = jnp.maximum(ids_ref[b, l], 0)
    if window == 1:
        src, dst = table_hbm.at[pl.ds(row, 1), cols], buf.at[slot, pl.ds(l, 1)]
    else:
        start = pl.multiple_of(row & ~(window - 1), window)
        src, dst = table_hbm.at[pl.ds(start, window), cols], buf.at[slot, l]
    return pltpu.make_async_copy(src, dst, sem.at[slot, l])


def _read_row(buf, ids_ref, b, l, slot, window):
    """The f32 [1, block_d] row of id (b, l) from its DMA buffer slot."""
    if window == 1:
        return buf[slot, pl.ds(l, 1), :].astype(jnp.float32)
    rows = buf[slot, l].astype(jnp.float32)  # the aligned window [window, block_d]
    at = jnp.maximum(ids_ref[b, l], 0) & (window - 1)  # row >= 0, window a power of 2
    pick = jax.lax.broadcasted_iota(jnp.int32, rows.shape, 0) == at
    return jnp.sum(jnp.where(pick, rows, 0.0), axis=0, keepdims=True)


def _fwd_kernel_tpu(ids_ref, table_hbm, out_ref, buf, sem, *, bag_len, dim, window, chunks):
    block_b, block_d = out_ref.shape
    cols = _tpu_cols(pl.program_id(1), block_d, dim)
    first_chunk = pl.program_id(2) == 0  # read here: not inside the loops (interpret mode)

    def start(b, slot):
        def one(l, _):
            _row_copy(table_hbm, buf, sem, ids_ref, b, l, slot, cols, window).start()
            return 0

        jax.lax.fori_loop(0, bag_len, one, 0)

    start(0, 0)

    def bag(b, _):
        slot = b % 2

        @pl.when(b + 1 < block_b)
        def _():
            start(b + 1, 1 - slot)

        def add(l, acc):
            _row_copy(table_hbm, buf, sem, ids_ref, b, l, slot, cols, window).wait()
            row = _read_row(buf, ids_ref, b, l, slot, window)
            return acc + jnp.where(ids_ref[b, l] >= 0, row, 0.0)

        acc = jax.lax.fori_loop(0, bag_len, add, jnp.zeros((1, block_d), jnp.float32))
        if chunks > 1:  # the output block stays resident over the bag's chunks
            acc += jnp.where(first_chunk, 0.0, out_ref[pl.ds(b, 1), :])
        out_ref[pl.ds(b, 1), :] = acc.astype(out_ref.dtype)
        return 0

    jax.lax.fori_loop(0, block_b, bag, 0)


def _bwd_kernel_tpu(ids_ref, mult_ref, g_ref, grad_in, grad_hbm, buf, sem_in, sem_out, *,
                    bag_len, dim):
    del grad_in  # aliased with grad_hbm
    block_b, block_d = g_ref.shape
    cols = _tpu_cols(pl.program_id(0), block_d, dim)

    def copy(b, l, *, out):
        row = jnp.maximum(ids_ref[b, l], 0)
        hbm = grad_hbm.at[pl.ds(row, 1), cols]
        vmem = buf.at[pl.ds(l, 1)]
        if out:
            return pltpu.make_async_copy(vmem, hbm, sem_out.at[l])
        return pltpu.make_async_copy(hbm, vmem, sem_in.at[l])

    def bag(b, _):
        # Ids are distinct within a bag (deduplicated, multiplicities in mult), so the bag's
        # row reads and writes may overlap each other; the next bag waits for the writes.
        def each(body):
            def one(l, _):
                pl.when(ids_ref[b, l] >= 0)(lambda: body(l))
                return 0

            jax.lax.fori_loop(0, bag_len, one, 0)

        each(lambda l: copy(b, l, out=False).start())
        g = g_ref[pl.ds(b, 1), :]

        def update(l):
            copy(b, l, out=False).wait()
            buf[pl.ds(l, 1), :] = buf[pl.ds(l, 1), :] + mult_ref[b, l] * g
            copy(b, l, out=True).start()

        each(update)
        each(lambda l: copy(b, l, out=True).wait())
        return 0

    jax.lax.fori_loop(0, block_b, bag, 0)


def _forward_tpu(table, ids, bs, interpret):
    chunk = bs.chunk(ids.shape[1])
    ids = _pad_to(ids, 1, chunk, -1)
    n_bags, bag_len = ids.shape
    chunks = bag_len // chunk
    dim = table.shape[1]
    block_d = bs.columns(dim)
    window = _row_window(table.dtype)
    table = _pad_to(table, 0, window)  # a copy only for a 16-bit table of V % 8 != 0 rows
    buf = (2, chunk, block_d) if window == 1 else (2, chunk, window, block_d)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel_tpu, bag_len=chunk, dim=dim, window=window,
                          chunks=chunks),
        grid=(n_bags // bs.block_b, dim // block_d, chunks),
        in_specs=[pl.BlockSpec((bs.block_b, chunk), lambda i, j, c: (i, c),
                               memory_space=pltpu.SMEM),
                  _ANY],
        out_specs=pl.BlockSpec((bs.block_b, block_d), lambda i, j, c: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_bags, dim), jnp.float32),
        scratch_shapes=[pltpu.VMEM(buf, table.dtype), pltpu.SemaphoreType.DMA((2, chunk))],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(ids, dim, window * dim * table.dtype.itemsize, backward=False),
        interpret=interpret,
        name="embedding_bag_fwd",
    )(ids, table)
    return out


def _dedupe_bags(ids):
    """Per bag: ids sorted with repeats replaced by -1, and each kept id's multiplicity."""
    s = jnp.sort(ids, axis=1)
    first = jnp.concatenate([jnp.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=1)
    first = first & (s >= 0)
    # sorted: an id's count is where its run ends minus where it starts (no [L, L] compare)
    ends = jax.vmap(lambda row: jnp.searchsorted(row, row, side="right"))(s)
    mult = (ends - jnp.arange(s.shape[1])[None, :]).astype(jnp.float32)
    return jnp.where(first, s, -1), jnp.where(first, mult, 0.0)


def _table_grad_tpu(ids, g, vocab, bs, interpret):
    chunk = bs.chunk(ids.shape[1])
    uniq, mult = _dedupe_bags(ids)  # over the whole bag: its chunks never share a row
    uniq, mult = _pad_to(uniq, 1, chunk, -1), _pad_to(mult, 1, chunk)
    n_bags, bag_len = uniq.shape
    dim = g.shape[1]
    block_d = bs.columns(dim)
    zeros = jnp.zeros((vocab, dim), jnp.float32)
    smem = functools.partial(pl.BlockSpec, (bs.block_b, chunk), lambda j, i, c: (i, c),
                             memory_space=pltpu.SMEM)
    return pl.pallas_call(
        functools.partial(_bwd_kernel_tpu, bag_len=chunk, dim=dim),
        grid=(dim // block_d, n_bags // bs.block_b, bag_len // chunk),
        in_specs=[smem(), smem(),
                  pl.BlockSpec((bs.block_b, block_d), lambda j, i, c: (i, j)),
                  _ANY],
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
        scratch_shapes=[pltpu.VMEM((chunk, block_d), jnp.float32),
                        pltpu.SemaphoreType.DMA((chunk,)),
                        pltpu.SemaphoreType.DMA((chunk,))],
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=_cost(ids, dim, dim * 4, backward=True),
        interpret=interpret,
        name="embedding_bag_bwd",
    )(uniq, mult, g, zeros)


# GPU

def _gpu_cols(block_d, dim):
    """A program's column block and the mask of its lanes inside the dim ([1, block_d])."""
    c0 = pl.program_id(1) * block_d
    lanes = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
    return pl.ds(c0, block_d), lanes < dim


def _fwd_kernel_gpu(ids_ref, table_ref, out_ref, *, bag_len, dim):
    from jax.experimental.pallas import triton as pltriton

    block_b, block_d = out_ref.shape
    cs, inside = _gpu_cols(block_d, dim)

    def bag(b, _):
        def item(l, acc):
            i = ids_ref[b, l]
            row = pltriton.load(table_ref.at[pl.ds(jnp.maximum(i, 0), 1), cs],
                                mask=inside & (i >= 0), other=0.0)
            return acc + row.astype(jnp.float32)

        acc = jax.lax.fori_loop(0, bag_len, item, jnp.zeros((1, block_d), jnp.float32))
        out_ref[pl.ds(b, 1), :] = acc
        return 0

    jax.lax.fori_loop(0, block_b, bag, 0)


def _bwd_kernel_gpu(ids_ref, g_ref, grad_in, grad_ref, *, bag_len, dim, interpret):
    from jax.experimental.pallas import triton as pltriton

    del grad_in  # aliased with grad_ref
    block_b, block_d = g_ref.shape
    cs, inside = _gpu_cols(block_d, dim)

    def bag(b, _):
        g = g_ref[pl.ds(b, 1), :]

        def item(l, _):
            i = ids_ref[b, l]
            at, mask = (pl.ds(jnp.maximum(i, 0), 1), cs), inside & (i >= 0)
            if interpret:  # programs run one at a time there, and masked atomics have no
                # interpreter rule: the same masked read-modify-write as a load and a store
                old = pltriton.load(grad_ref.at[at], mask=mask, other=0.0)
                pltriton.store(grad_ref.at[at], old + g, mask=mask)
            else:
                pltriton.atomic_add(grad_ref, at, g, mask=mask)
            return 0

        return jax.lax.fori_loop(0, bag_len, item, 0)

    jax.lax.fori_loop(0, block_b, bag, 0)


def _gpu_params(bs):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)


def _forward_gpu(table, ids, bs, interpret):
    n_bags, bag_len = ids.shape
    dim = table.shape[1]
    block_d = bs.columns(dim)
    n_cols = -(-dim // block_d)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel_gpu, bag_len=bag_len, dim=dim),
        grid=(n_bags // bs.block_b, n_cols),
        in_specs=[pl.BlockSpec((bs.block_b, bag_len), lambda i, j: (i, 0)), _ANY],
        out_specs=pl.BlockSpec((bs.block_b, block_d), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_bags, n_cols * block_d), jnp.float32),
        compiler_params=_gpu_params(bs),
        cost_estimate=_cost(ids, dim, dim * table.dtype.itemsize, backward=False),
        interpret=interpret,
        name="embedding_bag_fwd",
    )(ids, table)
    return out[:, :dim]


def _table_grad_gpu(ids, g, vocab, bs, interpret):
    n_bags, bag_len = ids.shape
    dim = g.shape[1]
    block_d = bs.columns(dim)
    g_p = _pad_to(g, 1, block_d)  # [B, D] cotangent, small; the gradient is not padded
    zeros = jnp.zeros((vocab, dim), jnp.float32)
    return pl.pallas_call(
        functools.partial(_bwd_kernel_gpu, bag_len=bag_len, dim=dim, interpret=bool(interpret)),
        grid=(n_bags // bs.block_b, g_p.shape[1] // block_d),
        in_specs=[pl.BlockSpec((bs.block_b, bag_len), lambda i, j: (i, 0)),
                  pl.BlockSpec((bs.block_b, block_d), lambda i, j: (i, j)),
                  _ANY],
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
        input_output_aliases={2: 0},
        compiler_params=_gpu_params(bs),
        cost_estimate=_cost(ids, dim, dim * 4, backward=True),
        interpret=interpret,
        name="embedding_bag_bwd",
    )(ids, g_p, zeros)


# wrapper

def _pad_bags(ids, bs):
    """Bags padded to a multiple of block_b, and on GPU the bag length to a power of two
    (Triton blocks), all with -1. (TPU ids live in SMEM, which has no (8, 128) tiling.)"""
    bag_len = ids.shape[1]
    if bs.platform == "gpu":
        ids = _pad_to(ids, 1, 1 << max(0, bag_len - 1).bit_length(), -1)
    return _pad_to(ids, 0, bs.block_b, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _embedding_bag(table, ids, mode, bs, interpret):
    forward = _forward_gpu if bs.platform == "gpu" else _forward_tpu
    sums = forward(table, _pad_bags(ids, bs), bs, interpret)[:ids.shape[0]]
    return (sums * _bag_weights(ids, mode)).astype(table.dtype)


def _embedding_bag_fwd(table, ids, mode, bs, interpret):
    # A zero-width array carries the table's vocab size and dtype (residuals must be arrays).
    out = _embedding_bag(table, ids, mode, bs, interpret)
    return out, (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _embedding_bag_bwd(mode, bs, interpret, res, g):
    ids, like = res
    g = _pad_to(g.astype(jnp.float32) * _bag_weights(ids, mode), 0, bs.block_b)
    grad = _table_grad_gpu if bs.platform == "gpu" else _table_grad_tpu
    return grad(_pad_bags(ids, bs), g, like.shape[0], bs, interpret).astype(like.dtype), None


_embedding_bag.defvjp(_embedding_bag_fwd, _embedding_bag_bwd)


@functools.partial(jax.jit, static_argnames=("mode", "block_sizes", "interpret"))
def embedding_bag(table: jax.Array, ids: jax.Array, *, mode: str = "sum",
                  block_sizes: EmbeddingBagBlockSizes | None = None,
                  interpret: bool = False) -> jax.Array:
    """Pallas version of ``embedding_bag_reference``: table [V, D], ids int32[B, L] -> [B, D].

    table: float32 or bfloat16 [V, D], any D; ids: integer [B, L], -1 = padding. Returns
    [B, D] in the table's dtype. Differentiable in ``table`` (the gradient is the Pallas
    in-place row update / scatter, f32 then cast). ``block_sizes`` also picks the kernel
    layout (its ``platform``).
    """
    if table.ndim != 2:
        raise ValueError(f"table must be [V, D], got shape {table.shape}")
    if ids.ndim != 2:
        raise ValueError(f"ids must be int32[B, L] bags (-1 = padding), got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}; valid: {', '.join(_MODES)}")
    if reason := unsupported_reason(table.dtype):
        raise ValueError(reason + " (use embedding_bag_reference)")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        return jnp.zeros((ids.shape[0], table.shape[1]), table.dtype)
    bs = block_sizes or EmbeddingBagBlockSizes.get_default()
    return _embedding_bag(table, ids.astype(jnp.int32), mode, bs, interpret)
