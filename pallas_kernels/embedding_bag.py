"""Embedding bag: gather rows of a table and sum (or average) them per bag.

``out[b] = sum_l table[ids[b, l]]`` over the valid (``>= 0``) ids of bag b, divided by their
count for ``mode="mean"`` (an empty bag gives zeros). Bags are padded ``int32[B, L]`` rows with
``-1`` padding; this is the segment-sum layout with segment id = row (``segment_ids = b``).
``embedding_bag_reference`` below defines the semantics in plain jnp.

The table never moves as a block: it stays in HBM (``memory_space=pl.ANY``) and only the
rows a bag names are fetched, accumulated in f32.

* TPU (Mosaic), forward: grid (bag blocks, column blocks); each program's ids arrive in SMEM
  (a per-program ``(block_b, L)`` SMEM block rather than one whole-array scalar prefetch:
  16,384 bags of 32 ids are 2 MiB, more than a TensorCore's SMEM), and the rows of bag b+1
  are DMA'd into one half of a double buffer while bag b is summed from the other.
* TPU, backward: the table gradient is an in-place row update of a zero f32 [V, D] buffer in
  HBM (aliased input -> output; never a VMEM block): per bag, its rows (deduplicated within
  the bag beforehand, with multiplicities) are DMA'd in, the bag's cotangent added, and DMA'd
  back. Bag blocks run sequentially ("arbitrary") so repeated ids across bags are ordered.
* GPU (Triton, chosen over Mosaic GPU: row gathers at data-dependent addresses are plain
  pointer loads in Triton, while Mosaic GPU needs 128-byte aligned TMA copies per row):
  forward programs loop over their bags and ids loading rows straight from the HBM table;
  backward scatters ``g[b]`` into the aliased f32 gradient with ``atomic_add``.

The ids get no gradient. On CPU the kernels run only with ``interpret=True``; the default CPU
path (``jaxflow.embeddings.pooling``) is the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import dispatch

_MODES = ("sum", "mean")
_PLATFORMS = ("tpu", "gpu")
_ANY = pl.BlockSpec(memory_space=pl.ANY)


@dataclasses.dataclass(frozen=True)
class EmbeddingBagBlockSizes:
    """Bags per program (block_b) and table columns per program (block_d; a multiple of 128
    on TPU unless it is the whole row, a power of two on GPU), and the kernel layout."""

    platform: str = "tpu"
    block_b: int = 32
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.platform not in _PLATFORMS:
            raise ValueError(f"platform {self.platform!r}; valid: {', '.join(_PLATFORMS)}")
        for name in ("block_b", "block_d"):
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
        """Column block for rows of width ``dim``: the whole row when it is narrower than
        block_d on TPU (a block may equal the array), a power of two >= dim on GPU."""
        if dim <= self.block_d:
            return dim if self.platform == "tpu" else max(8, 1 << (dim - 1).bit_length())
        return self.block_d


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
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# ------------------------------------------------------------------------------------ TPU


def _row_copy(table_hbm, buf, sem, ids_ref, b, l, slot, c0, block_d):
    row = jnp.maximum(ids_ref[b, l], 0)
    return pltpu.make_async_copy(table_hbm.at[pl.ds(row, 1), pl.ds(c0, block_d)],
                                 buf.at[slot, pl.ds(l, 1)], sem.at[slot, l])


def _fwd_kernel_tpu(ids_ref, table_hbm, out_ref, buf, sem, *, bag_len, block_d):
    block_b = out_ref.shape[0]
    c0 = pl.program_id(1) * block_d

    def start(b, slot):
        def one(l, _):
            _row_copy(table_hbm, buf, sem, ids_ref, b, l, slot, c0, block_d).start()
            return 0

        jax.lax.fori_loop(0, bag_len, one, 0)

    start(0, 0)

    def bag(b, _):
        slot = b % 2

        @pl.when(b + 1 < block_b)
        def _():
            start(b + 1, 1 - slot)

        def add(l, acc):
            _row_copy(table_hbm, buf, sem, ids_ref, b, l, slot, c0, block_d).wait()
            row = buf[slot, pl.ds(l, 1), :].astype(jnp.float32)
            return acc + jnp.where(ids_ref[b, l] >= 0, row, 0.0)

        acc = jax.lax.fori_loop(0, bag_len, add, jnp.zeros((1, block_d), jnp.float32))
        out_ref[pl.ds(b, 1), :] = acc.astype(out_ref.dtype)
        return 0

    jax.lax.fori_loop(0, block_b, bag, 0)


def _bwd_kernel_tpu(ids_ref, mult_ref, g_ref, grad_in, grad_hbm, buf, sem_in, sem_out, *,
                    bag_len, block_d):
    del grad_in  # aliased with grad_hbm
    block_b = g_ref.shape[0]
    c0 = pl.program_id(0) * block_d

    def copy(b, l, *, out):
        row = jnp.maximum(ids_ref[b, l], 0)
        hbm = grad_hbm.at[pl.ds(row, 1), pl.ds(c0, block_d)]
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
    n_bags, bag_len = ids.shape
    dim = table.shape[1]
    block_d = bs.columns(dim)
    table_p = _pad_to(table, 1, block_d)
    grid = (n_bags // bs.block_b, table_p.shape[1] // block_d)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel_tpu, bag_len=bag_len, block_d=block_d),
        grid=grid,
        in_specs=[pl.BlockSpec((bs.block_b, bag_len), lambda i, j: (i, 0),
                               memory_space=pltpu.SMEM),
                  _ANY],
        out_specs=pl.BlockSpec((bs.block_b, block_d), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_bags, table_p.shape[1]), jnp.float32),
        scratch_shapes=[pltpu.VMEM((2, bag_len, block_d), table.dtype),
                        pltpu.SemaphoreType.DMA((2, bag_len))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="embedding_bag_fwd",
    )(ids, table_p)
    return out[:, :dim]


def _dedupe_bags(ids):
    """Per bag: ids sorted with repeats replaced by -1, and each kept id's multiplicity."""
    s = jnp.sort(ids, axis=1)
    first = jnp.concatenate([jnp.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=1)
    first = first & (s >= 0)
    mult = jnp.sum(s[:, :, None] == s[:, None, :], axis=2).astype(jnp.float32)
    return jnp.where(first, s, -1), jnp.where(first, mult, 0.0)


def _table_grad_tpu(ids, g, vocab, bs, interpret):
    n_bags, bag_len = ids.shape
    dim = g.shape[1]
    block_d = bs.columns(dim)
    g_p = _pad_to(g, 1, block_d)
    uniq, mult = _dedupe_bags(ids)
    zeros = jnp.zeros((vocab, g_p.shape[1]), jnp.float32)
    smem = functools.partial(pl.BlockSpec, (bs.block_b, bag_len), lambda j, i: (i, 0),
                             memory_space=pltpu.SMEM)
    out = pl.pallas_call(
        functools.partial(_bwd_kernel_tpu, bag_len=bag_len, block_d=block_d),
        grid=(g_p.shape[1] // block_d, n_bags // bs.block_b),
        in_specs=[smem(), smem(),
                  pl.BlockSpec((bs.block_b, block_d), lambda j, i: (i, j)),
                  _ANY],
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
        scratch_shapes=[pltpu.VMEM((bag_len, block_d), jnp.float32),
                        pltpu.SemaphoreType.DMA((bag_len,)),
                        pltpu.SemaphoreType.DMA((bag_len,))],
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="embedding_bag_bwd",
    )(uniq, mult, g_p, zeros)
    return out[:, :dim]


# ------------------------------------------------------------------------------------ GPU


def _fwd_kernel_gpu(ids_ref, table_ref, out_ref, *, bag_len, block_d):
    block_b = out_ref.shape[0]
    cs = pl.ds(pl.program_id(1) * block_d, block_d)

    def bag(b, _):
        def item(l, acc):
            i = ids_ref[b, l]
            row = table_ref[pl.ds(jnp.maximum(i, 0), 1), cs].astype(jnp.float32)
            return acc + jnp.where(i >= 0, row, 0.0)

        acc = jax.lax.fori_loop(0, bag_len, item, jnp.zeros((1, block_d), jnp.float32))
        out_ref[pl.ds(b, 1), :] = acc
        return 0

    jax.lax.fori_loop(0, block_b, bag, 0)


def _bwd_kernel_gpu(ids_ref, g_ref, grad_in, grad_ref, *, bag_len, block_d):
    from jax.experimental.pallas import triton as pltriton

    del grad_in  # aliased with grad_ref
    block_b = g_ref.shape[0]
    cs = pl.ds(pl.program_id(1) * block_d, block_d)

    def bag(b, _):
        g = g_ref[pl.ds(b, 1), :]

        def item(l, _):
            i = ids_ref[b, l]
            pltriton.atomic_add(grad_ref, (pl.ds(jnp.maximum(i, 0), 1), cs),
                                jnp.where(i >= 0, g, 0.0))
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
    table_p = _pad_to(table, 1, block_d)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel_gpu, bag_len=bag_len, block_d=block_d),
        grid=(n_bags // bs.block_b, table_p.shape[1] // block_d),
        in_specs=[pl.BlockSpec((bs.block_b, bag_len), lambda i, j: (i, 0)), _ANY],
        out_specs=pl.BlockSpec((bs.block_b, block_d), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_bags, table_p.shape[1]), jnp.float32),
        compiler_params=_gpu_params(bs),
        interpret=interpret,
        name="embedding_bag_fwd",
    )(ids, table_p)
    return out[:, :dim]


def _table_grad_gpu(ids, g, vocab, bs, interpret):
    n_bags, bag_len = ids.shape
    dim = g.shape[1]
    block_d = bs.columns(dim)
    g_p = _pad_to(g, 1, block_d)
    zeros = jnp.zeros((vocab, g_p.shape[1]), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_bwd_kernel_gpu, bag_len=bag_len, block_d=block_d),
        grid=(n_bags // bs.block_b, g_p.shape[1] // block_d),
        in_specs=[pl.BlockSpec((bs.block_b, bag_len), lambda i, j: (i, 0)),
                  pl.BlockSpec((bs.block_b, block_d), lambda i, j: (i, j)),
                  _ANY],
        out_specs=_ANY,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
        input_output_aliases={2: 0},
        compiler_params=_gpu_params(bs),
        interpret=interpret,
        name="embedding_bag_bwd",
    )(ids, g_p, zeros)
    return out[:, :dim]


# ------------------------------------------------------------------------------- wrapper


def _pad_bags(ids, bs):
    """Bags padded to a multiple of block_b, and on GPU the bag length to a power of two
    (Triton blocks), all with -1. (TPU ids live in SMEM, which has no (8, 128) tiling.)"""
    bag_len = ids.shape[1]
    if bs.platform == "gpu":
        ids = _pad_to(ids, 1, 1 << max(0, bag_len - 1).bit_length(), -1)
    return _pad_to(ids, 0, bs.block_b, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _embedding_bag(table, ids, mode, bs, interpret):
    n_bags = ids.shape[0]
    ids_p = _pad_bags(ids, bs)
    forward = _forward_gpu if bs.platform == "gpu" else _forward_tpu
    sums = forward(table, ids_p, bs, interpret)[:n_bags]
    return (sums * _bag_weights(ids, mode)).astype(table.dtype)


def _embedding_bag_fwd(table, ids, mode, bs, interpret):
    # A zero-width array carries the table's vocab size and dtype (residuals must be arrays).
    out = _embedding_bag(table, ids, mode, bs, interpret)
    return out, (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _embedding_bag_bwd(mode, bs, interpret, res, g):
    ids, like = res
    g = g.astype(jnp.float32) * _bag_weights(ids, mode)
    ids_p = _pad_bags(ids, bs)
    g = _pad_to(g, 0, bs.block_b)
    grad = _table_grad_gpu if bs.platform == "gpu" else _table_grad_tpu
    return grad(ids_p, g, like.shape[0], bs, interpret).astype(like.dtype), None


_embedding_bag.defvjp(_embedding_bag_fwd, _embedding_bag_bwd)


@functools.partial(jax.jit, static_argnames=("mode", "block_sizes", "interpret"))
def embedding_bag(table: jax.Array, ids: jax.Array, *, mode: str = "sum",
                  block_sizes: EmbeddingBagBlockSizes | None = None,
                  interpret: bool = False) -> jax.Array:
    """Pallas version of ``embedding_bag_reference``: table [V, D], ids int32[B, L] -> [B, D].

    Differentiable in ``table`` (the gradient is the Pallas in-place row update / scatter).
    ``block_sizes`` also picks the kernel layout (its ``platform``).
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
