"""The static sampler's decode attention through a paged decode kernel.

The static KV cache holds row b's tokens at slots 0 .. S-1. Stored heads-major, [KVH, B, S, D']
(:func:`jaxflow.models.kv_cache.empty_heads_major_cache`), it already is a paged pool: reshaped
(free: the pages are contiguous) into [KVH, B * S / page, page, D'] with the identity page table
``page_table[b] = b * S / page + arange(S / page)``, row b's token t lies in page
``page_table[b, t // page]`` at offset ``t % page``: the layout the upstream decode kernels take.
A :class:`DecodeKernel` holds the paged attention function to call (:mod:`jaxflow.models` sits
below :mod:`jaxflow.rollout`, so the caller hands in
:func:`jaxflow.rollout.paged_attention.paged_attention`: the Mosaic TPU and Triton GPU decode
kernels, ``auto`` by platform, XLA with one warning where a kernel does not build) and builds
the cache and each layer's write + attention (``Transformer.decode(cache_attention=...)``).

Where it applies (:meth:`DecodeKernel.active`): on TPU / GPU, or with ``interpret=True``; on CPU
the sampler keeps the [B, S, KVH, D] cache and the XLA reference, bit for bit. S is the
sampler's P + max_new_tokens rounded up to whole pages (:meth:`DecodeKernel.cache_length`;
padding slots are never valid); the kernel reads each row's ``lengths`` tokens only, where the XLA decode reads and
masks all S slots every step. On TPU D' is the next multiple of 128 (Mosaic's lane width): a
head_dim of 64 is stored zero-padded once, so no step pads the pool.

The sampler's prefill, its first call over an EMPTY cache (:meth:`DecodeKernel.prefill_attention`,
chosen by :meth:`DecodeKernel.prefill_cache_attention`), writes the prompt as every call does
and attends through the LM's segment attention kernel
(:func:`jaxflow.models.attention_backends.attention`, ``auto``: splash on TPU, cuDNN for bf16
else the Triton flash ``mha`` on GPU; splash / flash in interpret mode) from the new tokens'
q, k, v directly, segment 1 on a row's real prompt tokens, 0 on its padding. Over an empty
cache a real token's XLA mask (valid slots at or before its own) is exactly that: the row's
real tokens at or before it, all in this call. Padding queries differ: the XLA reference lets
them attend to every real token of their row, the kernels to the earlier padding (the
segment reference, where a kernel falls back, to nothing). No sampled token and no attended
K/V sees them:

* the first token is drawn from the logits at slot ``len - 1``, a real token (prompt lengths
  are >= 1), and later logits come from decode steps;
* a padding slot's K/V (from layer 1 on it carries the differing output) is never attended:
  the prefill marks it invalid, and a slot turns valid only when a decode step writes a live
  token's K/V over it (``Transformer.decode`` writes at ``index``, which starts at ``len`` and
  advances by live tokens only, and marks the slot with the token's liveness);
* the other layers (norms, MLP, dense MoE, LoRA) act per token.

A capacity-dispatch MoE layer mixes tokens (padding tokens take expert slots from real
ones), so for such models the prefill keeps the XLA reference below. With ``record_routing``
the routing recorded at a prompt's padding positions (those no decode step overwrites) is the
kernel path's: the pad token's, meaningless either way.

Later multi-token calls (the static sampler makes none) attend with the XLA reference over the
cache viewed as [B, S, KVH, D] (one transpose per layer per call); one-token calls (each
decode step) go through the paged kernel. Under a mesh context (``jax.set_mesh``) the writes
and the paged kernel run in ``shard_map`` s: rows over the data axes, K/V heads over "model"
(:func:`jaxflow.models.attention_backends.shard_layout`), the cache constrained to that layout
when it is made, so no call moves cache bytes between devices (the paged dispatch's own mesh
wrapper replicates rows and pages, since a shared pool's pages may belong to any row; a write
left to XLA's partitioner gathers every data shard's new rows); the prefill's segment
attention shards itself the same way (its own ``shard_map``). The collectives of a
tensor-parallel sampler stay the ones of its XLA decode: each layer's two partial-sum
all-reduces of [rows per data shard, d_model] per step, the vocab-sharded embedding lookup's
and the sampling's per-row scalars (``tests/aot/test_sampler_decode_gate.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxflow.models.attention import cache_causal_mask, dot_product_attention
from jaxflow.models.attention_backends import attention as segment_attention
from jaxflow.models.attention_backends import shard_layout
from jaxflow.models.kv_cache import KVCache, empty_heads_major_cache, write_heads_major
from pallas_kernels import dispatch

__all__ = ["DECODE_BACKENDS", "DecodeKernel"]

DECODE_BACKENDS = ("auto", "tpu", "gpu")
KERNEL_PLATFORMS = ("tpu", "gpu")
TPU_LANES = 128  # Mosaic's lane width: the TPU decode kernel's head_dim is a multiple of it
BLOCK_TOKENS = 512  # the TPU wrapper's largest block (jaxflow.rollout.paged_attention)
#: the prefill's segment attention backend (jaxflow.models.attention_backends) per decode backend
SEGMENT_BACKENDS = {"auto": "auto", "tpu": "splash", "gpu": "flash"}


def _platform() -> str:
    platform = dispatch.backend_platform()
    return "gpu" if platform in ("gpu", "cuda") else platform


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
    """Decode attention of the static sampler through a paged decode kernel (module docstring).

    Attributes:
      attention: the paged decode attention, called as ``attention(q [B, H, D], k_pages [KVH,
        pages, page_size, D'], v_pages, lengths [B] int32, page_table [B, S / page_size] int32,
        backend=..., interpret=...) -> [B, H, D]``
        (:func:`jaxflow.rollout.paged_attention.paged_attention`).
      backend: "auto" (the platform's kernel where it builds, else XLA), "tpu" or "gpu"
        (forced: an error where it does not build).
      interpret: run the named kernel in Pallas interpret mode, on any platform (tests).
      page_size: tokens per page; the cache length is rounded up to a multiple of it.
    """

    attention: Callable
    backend: str = "auto"
    interpret: bool = False
    page_size: int = 64

    def __post_init__(self):
        if not callable(self.attention):
            raise TypeError(f"DecodeKernel.attention={self.attention!r}: must be callable "
                            "(jaxflow.rollout.paged_attention.paged_attention)")
        if self.backend not in DECODE_BACKENDS:
            raise ValueError(f"DecodeKernel.backend={self.backend!r}; valid: "
                             f"{', '.join(DECODE_BACKENDS)}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) \
                or self.page_size < 8 or self.page_size % 8:
            raise ValueError(f"DecodeKernel.page_size={self.page_size!r}: must be a multiple "
                             "of 8 (the kernels' sublanes), >= 8")
        if self.interpret and self.backend == "auto":
            raise ValueError("DecodeKernel(interpret=True) runs a named kernel: backend 'tpu' "
                             "or 'gpu', not 'auto'")

    def active(self) -> bool:
        """Whether decoding goes through the kernel here: in interpret mode, or when the JAX
        backend is TPU or GPU (a forced kernel off its platform then raises in the call)."""
        return self.interpret or _platform() in KERNEL_PLATFORMS

    def cache_length(self, n: int) -> int:
        """Slots of the heads-major cache for ``n`` tokens: ``n`` rounded up to a multiple of
        the largest chunk of 8, 4, 2 pages (at most ``BLOCK_TOKENS``) that pads it by at most
        1/8, else of one page. The TPU kernel reads blocks of pages that divide a row's pages:
        1,033 tokens in 17 pages of 64 (a prime) would be read 64 tokens at a time; in 1,152
        slots (18 pages), 384 at a time."""
        n = int(n)
        for pages in (8, 4, 2):
            chunk = pages * self.page_size
            length = -(-n // chunk) * chunk
            if chunk <= BLOCK_TOKENS and (length - n) * 8 <= n:
                return length
        return -(-n // self.page_size) * self.page_size

    def stored_head_dim(self, head_dim: int) -> int:
        """D' of the cache: the next multiple of 128 for the TPU kernel, else ``head_dim``."""
        tpu = self.backend == "tpu" or (self.backend == "auto" and _platform() == "tpu")
        return -(-int(head_dim) // TPU_LANES) * TPU_LANES if tpu else int(head_dim)

    def init_cache(self, config, batch_size: int, n_tokens: int) -> KVCache:
        """An empty heads-major cache for ``n_tokens`` per row of a model ``config``
        (:class:`jaxflow.models.TransformerConfig`): k / v [KVH, B, cache_length(n_tokens), D'],
        under a mesh context constrained to the kernel's layout (rows over the data axes,
        K/V heads over "model")."""
        cache = empty_heads_major_cache(
            n_layers=config.n_layers, batch_size=batch_size,
            max_len=self.cache_length(n_tokens), n_kv_heads=config.n_kv_heads,
            head_dim=self.stored_head_dim(config.head_dim), dtype=config.compute_dtype)
        layout = _mesh_layout(batch_size, config.n_heads, config.n_kv_heads)
        if layout is None:
            return cache
        mesh, rows, head = layout
        spec = P(head, rows, None, None)
        explicit = any(t == AxisType.Explicit for t in mesh.axis_types)

        def pin(x):
            return jax.reshard(x, spec) if explicit else jax.lax.with_sharding_constraint(x, spec)

        return cache._replace(k=tuple(map(pin, cache.k)), v=tuple(map(pin, cache.v)))

    def cache_attention(self, q, k, v, k_cache, v_cache, index, slots, key_valid):
        """One layer's write + attention over a heads-major cache
        (``Transformer.decode(cache_attention=...)``).

        Args:
          q: [B, L, H, D] queries; k, v: [B, L, KVH, D] the new tokens' keys / values.
          k_cache, v_cache: [KVH, B, S, D'] heads-major caches.
          index: [B] int32 write slots; slots: [B, L] the query tokens' slots; key_valid:
            [B, S] bool, the slots holding real tokens after this write (a prefix of each row).

        Returns:
          (out [B, L, H, D], k_cache, v_cache). L == 1 through the kernel (``lengths`` = index
          + whether the new token is valid: exactly the slots the XLA mask admits), L > 1 by
          the XLA reference.
        """
        layout = _mesh_layout(q.shape[0], q.shape[2], k.shape[2])
        if q.shape[1] != 1:
            k_cache, v_cache = _local(_write, layout, (k, v, k_cache, v_cache, index),
                                      ("tokens", "tokens", "cache", "cache", "row"),
                                      ("cache", "cache"))
            d = q.shape[-1]

            def view(cache):
                return jnp.transpose(cache[..., :d], (1, 2, 0, 3))

            mask = cache_causal_mask(slots, key_valid)
            return dot_product_attention(q, view(k_cache), view(v_cache), mask), k_cache, v_cache
        live = jnp.take_along_axis(key_valid, index[:, None], axis=1)[:, 0]
        lengths = index.astype(jnp.int32) + live.astype(jnp.int32)
        return _local(self._step, layout, (q, k, v, k_cache, v_cache, index, lengths),
                      ("tokens", "tokens", "tokens", "cache", "cache", "row", "row"),
                      ("tokens", "cache", "cache"))

    def prefill_attention(self, q, k, v, k_cache, v_cache, index, slots, key_valid):
        """One layer's write + attention of a call over an EMPTY cache (the sampler's prefill;
        ``Transformer.decode(cache_attention=...)``, arguments as :meth:`cache_attention`):
        the cache written as there, the attention causal self-attention among the new tokens
        through the segment attention kernel (module docstring), segment ids [B, L] = whether
        each new token is valid (``key_valid`` at ``slots``).

        Only correct when no slot was valid before this call (every row's ``index`` 0, as
        after :meth:`init_cache`): earlier cache entries are not attended.

        Returns:
          (out [B, L, H, D], k_cache, v_cache): real tokens' rows as the XLA reference's up to
          the kernel's rounding; padding tokens' rows finite but different (never read: module
          docstring).
        """
        layout = _mesh_layout(q.shape[0], q.shape[2], k.shape[2])
        k_cache, v_cache = _local(_write, layout, (k, v, k_cache, v_cache, index),
                                  ("tokens", "tokens", "cache", "cache", "row"),
                                  ("cache", "cache"))
        segment_ids = jnp.take_along_axis(key_valid, slots, axis=1).astype(jnp.int32)
        out = segment_attention(q, k, v, segment_ids, backend=SEGMENT_BACKENDS[self.backend],
                                interpret=self.interpret)
        return out.astype(q.dtype), k_cache, v_cache

    def prefill_cache_attention(self, config) -> Callable:
        """The ``cache_attention`` of a sampler's first call over an empty cache for a model
        ``config`` (:class:`jaxflow.models.TransformerConfig`): :meth:`prefill_attention`,
        or :meth:`cache_attention` (the XLA reference for L > 1) where a capacity-dispatch
        MoE layer lets padding tokens change real tokens' outputs (module docstring)."""
        if config.n_experts > 0 and config.moe_impl == "dispatch":
            return self.cache_attention
        return self.prefill_attention

    def _step(self, q, k, v, k_cache, v_cache, index, lengths):
        """Write the token and attend through the paged kernel (arrays: local shards)."""
        k_cache, v_cache = _write(k, v, k_cache, v_cache, index)
        kvh, b, s, width = k_cache.shape
        per_row = s // self.page_size
        table = (jnp.arange(b, dtype=jnp.int32)[:, None] * per_row
                 + jnp.arange(per_row, dtype=jnp.int32)[None, :])
        pages = (b * per_row, self.page_size, width)
        out = self.attention(q[:, 0], k_cache.reshape(kvh, *pages), v_cache.reshape(kvh, *pages),
                             lengths, table, backend=self.backend, interpret=self.interpret)
        return out[:, None].astype(q.dtype), k_cache, v_cache


def _mesh_layout(batch: int, heads: int, kv_heads: int):
    """(mesh, row axes or None, head axis or None) of the kernel's shard_map under a mesh
    context (:func:`shard_layout`; rows replicated where the row axes do not divide ``batch``),
    else None."""
    context, mesh = dispatch.partition_context()
    if context != "mesh":
        return None
    row_axes, head = shard_layout(mesh, heads, kv_heads)
    rows = row_axes if row_axes and batch % math.prod(mesh.shape[a] for a in row_axes) == 0 \
        else None
    return mesh, rows, head


def _write(k, v, k_cache, v_cache, index):
    return write_heads_major(k_cache, k, index), write_heads_major(v_cache, v, index)


def _local(fn, layout, args, kinds, out_kinds):
    """``fn(*args)``, under a mesh layout (:func:`_mesh_layout`) in a ``shard_map`` where each
    device holds its rows and K/V heads: kinds name each argument's / output's layout ("tokens"
    [B, L, heads, D], "cache" [KVH, B, S, D'], "row" [B]). A scatter of the new tokens left to
    XLA's partitioner gathers the rows of every data shard instead."""
    if layout is None:
        return fn(*args)
    mesh, rows, head = layout
    specs = {"tokens": P(rows, None, head, None), "cache": P(head, rows, None, None),
             "row": P(rows)}
    in_specs = tuple(specs[k] for k in kinds)
    if any(t == AxisType.Explicit for t in mesh.axis_types):  # shard_map wants its specs
        args = tuple(jax.reshard(a, s) for a, s in zip(args, in_specs))
    return jax.shard_map(fn, in_specs=in_specs, out_specs=tuple(specs[k] for k in out_kinds),
                         check_vma=False)(*args)
