"""Decode attention over a paged KV cache, by backend.

``paged_attention(q, k_pages, v_pages, lengths, page_table)`` attends one new query token per
row to that row's cached keys/values, which live in fixed-size pages of a shared pool:

  q           [B, H, D]        the decode token of each row (RoPE applied)
  k_pages     [KVH, P, S, D]   the pool: P pages of S tokens per K/V head (H = KVH * groups)
  v_pages     [KVH, P, S, D]
  lengths     [B] int32        valid tokens of each row, the current one included
  page_table  [B, pages_per_seq] int32   row b's token t lives in page page_table[b, t // S]
                               at offset t % S; entries past the row's last page are ignored (any int32)

The pool layout is the one the upstream decode kernels take
(``jax.experimental.pallas.ops.tpu.paged_attention``, ``...gpu.paged_attention``).

Backend "xla" gathers each row's pages with ``jnp.take`` into a contiguous [B, L, KVH, D]
cache (L = pages_per_seq * S), masks positions >= length and calls
:func:`jaxflow.models.attention.dot_product_attention` on it: the static sampler's arithmetic
(``Attention.decode``), so a paged engine can match it bit for bit on CPU. Bit for bit needs
the same cache length too: XLA:CPU's f32 reductions over a longer axis (masked zeros included)
may round differently, so pass ``kv_len`` = the static cache's length (P + max_new_tokens) to
reproduce the static sampler exactly; the gathered cache is cut or zero-padded to it (slots
past a row's length are masked, so only the reduction's shape changes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflow.models.attention import dot_product_attention

__all__ = ["paged_attention", "xla_paged_attention", "gather_pages"]


def _check(q, k_pages, v_pages, lengths, page_table) -> None:
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_attention needs q [B, H, D] and k_pages, v_pages [KVH, P, S, D] "
                         f"(same shape); got q {q.shape}, k_pages {k_pages.shape}, "
                         f"v_pages {v_pages.shape}")
    b, h, d = q.shape
    kvh = k_pages.shape[0]
    if k_pages.shape[3] != d or h % kvh:
        raise ValueError(f"paged_attention: k_pages {k_pages.shape} must be [KVH, P, S, D={d}] "
                         f"with KVH dividing H={h}")
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
    if kv_len <= n:
        return x[:, :kv_len]
    return jnp.pad(x, [(0, 0), (0, kv_len - n), (0, 0), (0, 0)])


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
    k = _fit(gather_pages(k_pages, page_table), kv_len)
    v = _fit(gather_pages(v_pages, page_table), kv_len)
    valid = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    return dot_product_attention(q[:, None], k, v, valid[:, None, :])[:, 0]


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_table: jax.Array, *, backend: str = "auto", interpret: bool = False,
                    kv_len: int | None = None) -> jax.Array:
    """Decode attention of one token per row over a paged KV pool (see the module docstring).

    Args:
      q: [B, H, D] queries (RoPE applied).
      k_pages: [KVH, P, S, D] key pool, KVH divides H.
      v_pages: [KVH, P, S, D] value pool.
      lengths: [B] int32 valid tokens per row, the current one included.
      page_table: [B, pages_per_seq] int32.
      backend: "auto" or "xla".
      interpret: run a Pallas kernel in interpret mode (ignored by "xla").
      kv_len: "xla" only: attend over a contiguous cache of this many slots (>= max(lengths);
        default pages_per_seq * S), for bit-identity with a static cache of that length.

    Returns:
      [B, H, D] in q.dtype.
    """
    _check(q, k_pages, v_pages, lengths, page_table)
    if backend not in ("auto", "xla"):
        raise ValueError(f"paged attention backend {backend!r}; valid: auto, xla")
    return xla_paged_attention(q, k_pages, v_pages, lengths, page_table, kv_len=kv_len,
                               interpret=interpret)
