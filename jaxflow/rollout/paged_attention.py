"""Attention over a paged KV cache, by backend: decode (one token per row) and ragged batches.

``paged_attention(q, k_pages, v_pages, lengths, page_table)`` attends one new query token per
row to that row's cached keys/values, which live in fixed-size pages of a shared pool:

  q           [B, H, D]        the decode token of each row (RoPE applied)
  k_pages     [KVH, P, S, D]   the pool: P pages of S tokens per K/V head (H = KVH * groups);
                               D may also be ``padded_head_dim(D)``, zeros past q's D
  v_pages     [KVH, P, S, D]
  lengths     [B] int32        valid tokens of each row, the current one included
  page_table  [B, pages_per_seq] int32   row b's token t lives in page page_table[b, t // S]
                               at offset t % S; entries past the row's last page are ignored
                               (any int32: the kernels read them clipped to [0, P))

The pool layout is the one the upstream decode kernels take. Backends (``PAGED_BACKENDS``):

  xla   gathers each row's pages with ``jnp.take`` into a contiguous [B, L, KVH, D] cache
        (L = pages_per_seq * S), masks positions >= length and calls
        :func:`jaxflow.models.attention.dot_product_attention`: the static sampler's arithmetic
        (``Attention.decode``), so a paged engine can match it bit for bit on CPU. Bit for bit
        needs the same cache length too: XLA:CPU's f32 reductions over a longer axis (masked
        zeros included) may round differently, so pass ``kv_len`` = the static cache's length
        (P + max_new_tokens); the gathered cache is cut or zero-padded to it.
  tpu   ``jax.experimental.pallas.ops.tpu.paged_attention`` (Mosaic TPU decode kernel: per row
        and K/V head, DMAs ``pages_per_compute_block`` pages at a time, online softmax in f32).
        Its blocks' lane dimension is head_dim, which Mosaic needs a multiple of 128: a head_dim
        of 64 (1B-class models) runs in the padded layout, q and the pools zero-padded to 128
        lanes (zeros add exactly 0 to q.k, and P.V's padded lanes are sliced off). A pool
        stored padded (D' = ``padded_head_dim(D)``, zeros past D: the engine's, by
        :func:`jaxflow.rollout.pages.pool_head_dim`) costs nothing more; an unpadded one is
        padded per call (a copy of the pool at twice its width).
  gpu   ``jax.experimental.pallas.ops.gpu.paged_attention`` (Triton: split-K over the page
        table, ``k_splits`` partial softmaxes combined in XLA).
  auto  per platform: CPU -> xla; TPU -> tpu; GPU -> gpu, each only where it builds for these
        shapes (``pallas_kernels.dispatch.choose_kernel``; else one warning, then xla).

Both kernels take unscaled logits: q is scaled by D^-0.5 in f32 and cast back before the call
(as ``attention_backends.splash_attention`` does). Rows of length 0 (free slots) give zeros in
every backend (the tpu kernel skips them; its wrapper sets them to zero). The TPU decode kernel
rounds K and V to bf16 after loading them (upstream's ``_maybe_dequantize``): with f32 pools its
results are those of bf16 K/V. ``interpret=True`` runs a kernel in Pallas interpret mode on any
platform (tpu: ``pltpu.force_tpu_interpret_mode``), without a verdict.

Under a mesh context (``jax.set_mesh``) the kernels run in a ``shard_map``: query and K/V
heads over the "model" axis where it divides both (tensor parallelism: each device holds the
pool of its own K/V heads), rows and pages replicated (page ids index the whole pool). The TPU
page table is scalar-prefetched into SMEM, so the decode kernel takes rows in groups of at most
``TPU_SMEM_TABLE`` bytes of table.

``ragged_paged_attention(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)`` is the mixed
prefill + decode form (chunked prefill): a ragged batch of query tokens, sequence i owning
tokens cu_q_lens[i]:cu_q_lens[i+1], the last q_len of its kv_lens[i] tokens (causal). Its pool
is the combined layout of the upstream TPU kernel, ``kv_pages`` [P, S, 2*KVH, D] with K at even
and V at odd heads (:func:`combine_kv_pages` / :func:`split_kv_pages` convert). Backends: xla
(a per-token gather: O(T * L) memory, a reference for tests and small batches) and tpu
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, the kernel behind tpu-inference;
its page table, scalar-prefetched into SMEM, must fit ``TPU_SMEM_TABLE``: 256 sequences of 32k
tokens need pages of >= 64 tokens, else auto falls back to xla with a warning; head_dim 64 in
the padded layout, as decode).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxflow.models.attention import dot_product_attention
from jaxflow.models.attention_backends import HEAD_AXIS
from pallas_kernels import dispatch

__all__ = ["PAGED_BACKENDS", "RAGGED_BACKENDS", "choose_paged_backend", "choose_ragged_backend",
           "combine_kv_pages", "gather_pages", "gpu_paged_attention", "padded_head_dim",
           "paged_attention", "ragged_paged_attention", "resolve_paged_backend", "split_kv_pages",
           "tpu_paged_attention", "tpu_ragged_paged_attention", "xla_paged_attention",
           "xla_ragged_paged_attention"]

PAGED_BACKENDS = ("auto", "xla", "tpu", "gpu")
RAGGED_BACKENDS = ("auto", "xla", "tpu")
KERNEL_NAMES = {"tpu": "tpu_paged_attention", "gpu": "gpu_paged_attention"}
TPU_BLOCK_TOKENS = 512  # tokens per DMA'd block of the TPU decode kernel (per K/V head)
GPU_BLOCK_TOKENS = 64  # tokens per Triton block (block_k = pages_per_compute_block * S)
GPU_K_SPLITS = 16  # partitions of the page table the GPU kernel softmaxes separately (at most)
GPU_BLOCK_H = 16  # query heads per Triton program (the kernel's minimum; groups are padded)
TPU_SMEM_TABLE = 512 * 2**10  # bytes of page table per TPU kernel call (scalar-prefetched into
# SMEM, 1 MiB on v5e / v5p / v6e with the other prefetched scalars)
RAGGED_KV_BUFFER = 8 * 2**20  # bytes of one of the ragged kernel's two K/V VMEM buffers (at most)
RAGGED_VMEM_LIMIT = 32 * 2**20  # its scoped VMEM limit (VMEM per core: 64 MiB v5p, 128 v5e/v6e)
TPU_LANES = 128  # Mosaic's lane width: the decode kernel's head_dim must be a multiple of it


def padded_head_dim(head_dim: int) -> int:
    """The head_dim of the padded layout the TPU decode kernel takes: the next multiple of 128
    (64 -> 128; 128 stays 128)."""
    return -(-int(head_dim) // TPU_LANES) * TPU_LANES


def _platform_name(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda") else platform


def resolve_paged_backend(name: str, platform: str, *, valid=PAGED_BACKENDS) -> str:
    """Validates a backend name for ``platform`` ("cpu", "gpu" / "cuda", "tpu").

    Returns "xla", "tpu", "gpu", or "auto" on GPU / TPU; "auto" elsewhere resolves to "xla".
    Raises ValueError for an unknown name or a kernel named off its platform."""
    if name not in valid:
        raise ValueError(f"paged attention backend {name!r}; valid: {', '.join(valid)}")
    platform = _platform_name(platform)
    if name == "auto":
        return "auto" if platform in ("tpu", "gpu") and platform in valid else "xla"
    if name in ("tpu", "gpu") and name != platform:
        here = ("auto", "xla") + ((platform,) if platform in valid else ())
        raise ValueError(f"paged attention backend {name!r} runs on {name} only, but the JAX "
                         f"backend is {platform!r}; valid here: {', '.join(here)}")
    return name


def _check(q, k_pages, v_pages, lengths, page_table) -> None:
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_attention needs q [B, H, D] and k_pages, v_pages [KVH, P, S, D] "
                         f"(same shape); got q {q.shape}, k_pages {k_pages.shape}, "
                         f"v_pages {v_pages.shape}")
    b, h, d = q.shape
    kvh = k_pages.shape[0]
    if k_pages.shape[3] not in (d, padded_head_dim(d)) or h % kvh:
        raise ValueError(f"paged_attention: k_pages {k_pages.shape} must be [KVH, P, S, D={d}] "
                         f"(or D={padded_head_dim(d)}, the padded layout) with KVH dividing H={h}")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"paged_attention: lengths must be int [B={b}]; got "
                         f"{lengths.dtype}{list(lengths.shape)}")
    if (page_table.ndim != 2 or page_table.shape[0] != b
            or not jnp.issubdtype(page_table.dtype, jnp.integer)):
        raise ValueError(f"paged_attention: page_table must be int [B={b}, pages_per_seq]; got "
                         f"{page_table.dtype}{list(page_table.shape)}")


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each row's pages as a contiguous cache.

    Args:
      pages: [KVH, P, S, D] pool.
      page_table: [B, pages_per_seq] int32 page ids.

    Returns:
      [B, pages_per_seq * S, KVH, D]: token t of row b at [b, t] (the static cache's layout).
    """
    kvh, _, s, d = pages.shape
    b, n = page_table.shape
    # mode="clip": an unused table entry out of range reads some page (masked out later) instead
    # of jnp.take's default NaN fill, which would poison the masked products (0 * NaN).
    rows = jnp.take(pages, page_table.astype(jnp.int32), axis=1, mode="clip")  # [KVH, B, n, S, D]
    return jnp.transpose(rows.reshape(kvh, b, n * s, d), (1, 2, 0, 3))


def _fit(x: jax.Array, kv_len: int) -> jax.Array:
    n = x.shape[1]
    return x[:, :kv_len] if kv_len <= n else jnp.pad(x, [(0, 0), (0, kv_len - n)] + [(0, 0)] * (x.ndim - 2))


def xla_paged_attention(q, k_pages, v_pages, lengths, page_table, *, kv_len: int | None = None,
                        interpret: bool = False) -> jax.Array:
    """The reference: gather the pages, then masked attention (``interpret`` is ignored).

    Same arithmetic as ``dot_product_attention`` on a contiguous [B, kv_len, KVH, D] cache
    holding the same tokens at the same slots (f32 logits scaled by D^-0.5, f32 softmax,
    probabilities cast to the value dtype); ``kv_len`` defaults to pages_per_seq * S. Returns
    [B, H, D] in q.dtype; a row of length 0 returns zeros."""
    del interpret
    n = page_table.shape[1] * k_pages.shape[2]
    kv_len = n if kv_len is None else int(kv_len)
    d = q.shape[-1]  # a padded pool's lanes past d are cut (a slice XLA fuses into the gather)
    k = _fit(gather_pages(k_pages[..., :d], page_table), kv_len)
    v = _fit(gather_pages(v_pages[..., :d], page_table), kv_len)
    valid = jnp.arange(kv_len, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    return dot_product_attention(q[:, None], k, v, valid[:, None, :])[:, 0]


def _scaled(q: jax.Array) -> jax.Array:
    return (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)


def _pad_lanes(x: jax.Array, width: int) -> jax.Array:
    """``x`` zero-padded on its last axis to ``width`` (no-op when it already has it)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _largest_divisor(n: int, at_most: int) -> int:
    return max(c for c in range(1, max(1, min(n, at_most)) + 1) if n % c == 0)


def _tpu_interpret(interpret: bool):
    if not interpret:
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode()


def tpu_paged_attention(q, k_pages, v_pages, lengths, page_table, *, interpret: bool = False
                        ) -> jax.Array:
    """Upstream Mosaic TPU decode kernel: [B, H, D]. ``pages_per_compute_block``: the largest
    divisor of pages_per_seq with at most ``TPU_BLOCK_TOKENS`` tokens. The kernel prefetches
    its whole page table into SMEM, so rows go through it in groups of at most
    ``TPU_SMEM_TABLE`` bytes of table (256 sequences at 32k tokens in pages of 16 are 2 MiB).
    A head_dim that is not a multiple of 128 runs in the padded layout (module docstring)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    b, pps = page_table.shape
    d, width = q.shape[-1], padded_head_dim(q.shape[-1])
    block = _largest_divisor(pps, max(1, TPU_BLOCK_TOKENS // k_pages.shape[2]))
    table = jnp.clip(page_table.astype(jnp.int32), 0, k_pages.shape[1] - 1)
    # scaled by the true D^-0.5 before the zero lanes are added
    q, lengths = _pad_lanes(_scaled(q), width), lengths.astype(jnp.int32)
    k_pages, v_pages = _pad_lanes(k_pages, width), _pad_lanes(v_pages, width)
    rows = max(1, TPU_SMEM_TABLE // (4 * pps))
    outs = []
    with _tpu_interpret(interpret):
        for r in range(0, b, rows):
            outs.append(kernel(q[r:r + rows], k_pages, v_pages, lengths[r:r + rows],
                               table[r:r + rows], pages_per_compute_block=block))
    out = (jnp.concatenate(outs) if len(outs) > 1 else outs[0])[..., :d]
    # the kernel skips the K/V of rows of length 0 (free slots): their output is set to xla's
    # zeros here rather than taken from a row the kernel did not compute
    return jnp.where(lengths[:, None, None] > 0, out, 0).astype(q.dtype)


def _gpu_blocks(pages_per_seq: int, page_size: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for the GPU kernel: both divide the table."""
    splits = _largest_divisor(pages_per_seq, GPU_K_SPLITS)
    per_split = pages_per_seq // splits
    return splits, _largest_divisor(per_split, max(1, GPU_BLOCK_TOKENS // page_size))


def gpu_paged_attention(q, k_pages, v_pages, lengths, page_table, *, interpret: bool = False
                        ) -> jax.Array:
    """Upstream Pallas (Triton) GPU decode kernel: [B, H, D]. The page table is split into
    ``k_splits`` partitions (the largest divisor of pages_per_seq <= ``GPU_K_SPLITS``), read
    ``pages_per_compute_block`` pages (about ``GPU_BLOCK_TOKENS`` tokens) at a time."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel

    splits, block = _gpu_blocks(page_table.shape[1], k_pages.shape[2])
    table = jnp.clip(page_table.astype(jnp.int32), 0, k_pages.shape[1] - 1)
    d = q.shape[-1]  # a padded pool: q gets its zero lanes (cheap), the output loses them
    out = kernel(_pad_lanes(_scaled(q), k_pages.shape[-1]), k_pages, v_pages, table,
                 lengths.astype(jnp.int32), block_h=GPU_BLOCK_H, pages_per_compute_block=block,
                 k_splits=splits, interpret=interpret)
    return out[..., :d].astype(q.dtype)


_CALLS = {"xla": xla_paged_attention, "tpu": tpu_paged_attention, "gpu": gpu_paged_attention}


def _on_mesh(call, head_dims: tuple[int | None, ...], out_dim: int, *, combined: bool = False):
    """``call`` as a trace under a mesh context runs it: in a ``shard_map`` with heads over
    ``HEAD_AXIS`` (where it divides the query and K/V heads: each device attends with its own
    heads, where tensor-parallel projections put them) and everything else replicated (page ids
    index the whole pool, so rows cannot be split without splitting the pool). head_dims: the
    head dimension of each argument (None: replicated); out_dim: the output's; combined: the
    second argument is the combined [P, S, 2*KVH, D] pool (K/V pairs stay together)."""
    context, mesh = dispatch.partition_context()
    if context != "mesh":
        return call

    def sharded(*args):
        tp = mesh.shape.get(HEAD_AXIS, 1)
        heads = [a.shape[d] for a, d in zip(args, head_dims) if d is not None]
        if combined:  # [P, S, 2*KVH, D]: a device must hold whole (K, V) pairs
            heads.append(args[1].shape[2] // 2)
        axis = HEAD_AXIS if tp > 1 and all(h % tp == 0 for h in heads) else None

        def spec(ndim, dim):
            return P(*[axis if i == dim else None for i in range(ndim)])

        specs = tuple(spec(a.ndim, d) for a, d in zip(args, head_dims))
        out_spec = spec(args[0].ndim, out_dim)
        explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
        if explicit:  # shard_map wants explicitly sharded inputs laid out as its in_specs
            args = tuple(jax.reshard(a, sp) for a, sp in zip(args, specs))
        return jax.shard_map(call, in_specs=specs, out_specs=out_spec, check_vma=False)(*args)

    return sharded


DECODE_HEAD_DIMS = (1, 0, 0, None, None)  # q [B, H, D], pools [KVH, ...], lengths, table
RAGGED_HEAD_DIMS = (1, 2, None, None, None, None)  # q [T, H, D], kv_pages [P, S, 2*KVH, D]


def _kernel_call(name: str, interpret: bool):
    call = functools.partial(_CALLS[name], interpret=interpret)
    return call if name == "xla" else _on_mesh(call, DECODE_HEAD_DIMS, 1)


def choose_paged_backend(q, k_pages, v_pages, lengths, page_table, *, backend: str = "auto"
                         ) -> str:
    """The backend ``paged_attention`` runs for these arguments here: "xla", "tpu" or "gpu".

    A named kernel is checked (ValueError off its platform, ``KernelUnavailable`` where it does
    not build); "auto" takes the platform's kernel where it builds, else warns once -> "xla"."""
    _check(q, k_pages, v_pages, lengths, page_table)
    platform = _platform_name(dispatch.backend_platform())
    resolved = resolve_paged_backend(backend, platform)
    if resolved == "xla":
        return "xla"
    name = platform if resolved == "auto" else resolved
    args = tuple(jax.ShapeDtypeStruct(jnp.shape(a), a.dtype)
                 for a in (q, k_pages, v_pages, lengths, page_table))
    blocked = dispatch.auto_partition_problem(platform) if name == "tpu" else None
    context, mesh = dispatch.partition_context()
    options = (context, None if mesh is None else tuple(mesh.shape.items()))
    use = dispatch.choose_kernel(KERNEL_NAMES[name], "auto" if resolved == "auto" else "pallas",
                                 _kernel_call(name, False), args, options=options,
                                 blocked=blocked)
    return name if use else "xla"


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_table: jax.Array, *, backend: str = "auto", interpret: bool = False,
                    kv_len: int | None = None) -> jax.Array:
    """Decode attention of one token per row over a paged KV pool (see the module docstring).

    Args:
      q: [B, H, D] queries (RoPE applied).
      k_pages: [KVH, P, S, D] key pool, KVH divides H (or [KVH, P, S, padded_head_dim(D)],
        zeros past D: the padded layout).
      v_pages: value pool, k_pages' shape.
      lengths: [B] int32 valid tokens per row, the current one included.
      page_table: [B, pages_per_seq] int32.
      backend: one of ``PAGED_BACKENDS``.
      interpret: with backend "tpu" or "gpu", run that kernel in Pallas interpret mode, on any
        platform and without a build verdict (xla ignores it).
      kv_len: xla only: attend over a contiguous cache of this many slots (>= max(lengths);
        default pages_per_seq * S), for bit-identity with a static cache of that length.

    Returns:
      [B, H, D] in q.dtype.
    """
    if interpret and backend in ("tpu", "gpu"):
        _check(q, k_pages, v_pages, lengths, page_table)
        return _kernel_call(backend, True)(q, k_pages, v_pages, lengths, page_table)
    name = choose_paged_backend(q, k_pages, v_pages, lengths, page_table, backend=backend)
    if name == "xla":
        return xla_paged_attention(q, k_pages, v_pages, lengths, page_table, kv_len=kv_len)
    return _kernel_call(name, False)(q, k_pages, v_pages, lengths, page_table)


# -- ragged batches (chunked prefill + decode), the upstream TPU kernel's combined layout -------


def combine_kv_pages(k_pages: jax.Array, v_pages: jax.Array) -> jax.Array:
    """[KVH, P, S, D] key and value pools -> the combined [P, S, 2*KVH, D] pool (K at head 2h,
    V at 2h+1) of ``ragged_paged_attention``."""
    kvh, p, s, d = k_pages.shape
    kv = jnp.stack([k_pages, v_pages], axis=1)  # [KVH, 2, P, S, D]
    return jnp.transpose(kv, (2, 3, 0, 1, 4)).reshape(p, s, 2 * kvh, d)


def split_kv_pages(kv_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The combined [P, S, 2*KVH, D] pool -> ([KVH, P, S, D] keys, [KVH, P, S, D] values)."""
    k = jnp.transpose(kv_pages[:, :, 0::2], (2, 0, 1, 3))
    v = jnp.transpose(kv_pages[:, :, 1::2], (2, 0, 1, 3))
    return k, v


def _check_ragged(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs) -> None:
    d = q.shape[-1] if q.ndim == 3 else "?"
    if (q.ndim != 3 or kv_pages.ndim != 4 or kv_pages.shape[2] % 2
            or kv_pages.shape[3] not in (d, padded_head_dim(d))):
        raise ValueError(f"ragged_paged_attention needs q [T, H, D] and kv_pages [P, S, 2*KVH, "
                         f"D={d}] (or D={padded_head_dim(d) if q.ndim == 3 else '?'}, the padded "
                         f"layout); got q {q.shape}, kv_pages {kv_pages.shape}")
    if q.shape[1] % (kv_pages.shape[2] // 2):
        raise ValueError(f"ragged_paged_attention: KVH={kv_pages.shape[2] // 2} must divide "
                         f"H={q.shape[1]}")
    n = page_table.shape[0] if page_table.ndim == 2 else -1
    for name, a, shape in (("kv_lens", kv_lens, (n,)), ("cu_q_lens", cu_q_lens, (n + 1,)),
                           ("num_seqs", num_seqs, (1,)), ("page_table", page_table, None)):
        if (shape is not None and a.shape != shape) or a.dtype != jnp.int32 or n < 0:
            raise ValueError(f"ragged_paged_attention: {name} must be int32 "
                             f"{list(shape) if shape else '[N, pages_per_seq]'} (N = page_table "
                             f"rows); got {a.dtype}{list(a.shape)}")


def xla_ragged_paged_attention(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, *,
                               interpret: bool = False) -> jax.Array:
    """The reference for ragged batches: each query token gathers its sequence's pages and
    attends causally (``dot_product_attention``'s arithmetic); [T, H, D]. Tokens past
    cu_q_lens[num_seqs] give zeros. Memory O(T * pages_per_seq * S)."""
    del interpret
    t = q.shape[0]
    tok = jnp.arange(t, dtype=jnp.int32)
    n = page_table.shape[0]
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right").astype(jnp.int32) - 1, 0, n - 1)
    real = (tok < cu_q_lens[num_seqs[0]]) & (seq < num_seqs[0])
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])  # the token's slot in its sequence
    k_pages, v_pages = split_kv_pages(kv_pages[..., :q.shape[-1]])  # a padded pool: cut
    k = gather_pages(k_pages, page_table[seq])  # [T, L, KVH, D]
    v = gather_pages(v_pages, page_table[seq])
    slots = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    mask = (slots <= pos[:, None]) & real[:, None]
    return dot_product_attention(q[:, None], k, v, mask[:, None, :])[:, 0]


def _ragged_blocks(q, kv_pages, pages_per_seq: int) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block): upstream's tuned table for the target
    chip where it has the key, else its default (128, 32); K/V pages per block capped so one
    of the two VMEM buffers holds at most ``RAGGED_KV_BUFFER`` bytes."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rk
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tb

    t, h, d = q.shape
    _, s, combined, _ = kv_pages.shape
    qh, kvh = rk.get_min_heads_per_blk(h, combined, q.dtype, kv_pages.dtype)
    key = tb.simplify_key((q.dtype, kv_pages.dtype, qh, kvh // 2, d, s, t, pages_per_seq))
    device = " ".join(dispatch.target().device_kind.split()[:2])
    bkv, bq = tb.TUNED_BLOCK_SIZES.get(device, {}).get(key, (128, 32))
    per_page = s * kvh * d * jnp.dtype(kv_pages.dtype).itemsize
    bkv = max(1, min(bkv, pages_per_seq, RAGGED_KV_BUFFER // per_page))
    return bkv, max(1, min(bq, t))


def tpu_ragged_paged_attention(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, *,
                               interpret: bool = False) -> jax.Array:
    """Upstream Mosaic TPU ragged paged attention (softmax scale D^-0.5): [T, H, D]; head_dim 64
    in the padded layout (q and an unpadded pool zero-padded to 128 lanes, the output cut)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    d, width = q.shape[-1], padded_head_dim(q.shape[-1])
    q, kv_pages = _pad_lanes(q, width), _pad_lanes(kv_pages, width)
    bkv, bq = _ragged_blocks(q, kv_pages, page_table.shape[1])
    table = jnp.clip(page_table, 0, kv_pages.shape[0] - 1)
    with _tpu_interpret(interpret):
        out = ragged_paged_attention(q, kv_pages, kv_lens, table, cu_q_lens, num_seqs,
                                     sm_scale=d ** -0.5, num_kv_pages_per_block=bkv,
                                     num_queries_per_block=bq, vmem_limit_bytes=RAGGED_VMEM_LIMIT)
    return out[..., :d]


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                           page_table: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                           backend: str = "auto", interpret: bool = False) -> jax.Array:
    """Causal attention of a ragged batch of query tokens over a combined paged KV pool.

    Args:
      q: [T, H, D] query tokens of all sequences, concatenated (RoPE applied); T may exceed
        the real tokens (padding at the end).
      kv_pages: [P, S, 2*KVH, D] combined pool (``combine_kv_pages``), the new tokens' K/V
        already written (or [..., padded_head_dim(D)], zeros past D: the padded layout).
      kv_lens: [N] int32 tokens of each sequence in the pool, its new ones included.
      page_table: [N, pages_per_seq] int32.
      cu_q_lens: [N + 1] int32: sequence i's queries are q[cu_q_lens[i]:cu_q_lens[i+1]], its
        last q_len tokens (q_len <= kv_lens[i]).
      num_seqs: [1] int32, the sequences in use (the first num_seqs rows).
      backend: one of ``RAGGED_BACKENDS`` (auto: tpu on TPU where it builds, else xla).
      interpret: with backend "tpu", run the kernel in TPU interpret mode (any platform).

    Returns:
      [T, H, D] in q.dtype; rows past the real tokens are meaningless (zeros in xla).
    """
    _check_ragged(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)
    args = (q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)
    if interpret and backend == "tpu":
        return _on_mesh(functools.partial(tpu_ragged_paged_attention, interpret=True),
                        RAGGED_HEAD_DIMS, 1, combined=True)(*args)
    if choose_ragged_backend(*args, backend=backend) == "xla":
        return xla_ragged_paged_attention(*args)
    return _on_mesh(tpu_ragged_paged_attention, RAGGED_HEAD_DIMS, 1, combined=True)(*args)


def choose_ragged_backend(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, *,
                          backend: str = "auto") -> str:
    """The backend ``ragged_paged_attention`` runs for these arguments (arrays or
    ShapeDtypeStructs) here: "tpu" where the kernel builds (named: ``KernelUnavailable`` where
    not; auto: one warning), else "xla"."""
    _check_ragged(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)
    args = (q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)
    platform = _platform_name(dispatch.backend_platform())
    resolved = resolve_paged_backend(backend, platform, valid=RAGGED_BACKENDS)
    if resolved == "xla":
        return "xla"
    shapes = tuple(jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in args)
    table_bytes = 4 * math.prod(page_table.shape)
    too_big = (f"its page table ({table_bytes} bytes) is prefetched into SMEM, at most "
               f"{TPU_SMEM_TABLE}: use larger pages or fewer sequences per call"
               if table_bytes > TPU_SMEM_TABLE else None)
    kernel = _on_mesh(tpu_ragged_paged_attention, RAGGED_HEAD_DIMS, 1, combined=True)
    context, mesh = dispatch.partition_context()
    options = (context, None if mesh is None else tuple(mesh.shape.items()))
    use = dispatch.choose_kernel("tpu_ragged_paged_attention",
                                 "auto" if resolved == "auto" else "pallas", kernel, shapes,
                                 options=options,
                                 blocked=too_big or dispatch.auto_partition_problem(platform))
    return "tpu" if use else "xla"
