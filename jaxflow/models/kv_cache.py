"""Key/value cache for incremental decoding: an immutable pytree of arrays.

Two layouts of the per-layer keys / values: the default [B, S, KVH, D] (``empty_cache``,
``write_rows``), which the XLA decode attends over, and the heads-major [KVH, B, S, D']
(``empty_heads_major_cache``, ``write_heads_major``), which reshapes for free into the pages
[KVH, B * S / page, page, D'] of a paged decode kernel (:mod:`jaxflow.models.decode_kernel`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Per-layer rotated keys and values plus per-row bookkeeping.

    Attributes:
      k: tuple (one per layer) of [B, S, n_kv_heads, head_dim] keys, RoPE already applied
        (heads-major caches: [n_kv_heads, B, S, D'], D' >= head_dim, zeros past head_dim).
      v: tuple (one per layer) of values, the keys' shape.
      valid: [B, S] bool, True for slots holding a real (non-padding) token.
      index: [B] int32, next write slot of each row (= number of valid tokens so far).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        """Positions the cache holds."""
        return self.valid.shape[1]


def empty_cache(
    *, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
    dtype: jnp.dtype,
) -> KVCache:
    """All-zero cache with no valid entries and write index 0 for every row."""
    return _zeros(n_layers, (batch_size, max_len, n_kv_heads, head_dim), batch_size, max_len, dtype)


def _zeros(n_layers: int, shape: tuple[int, ...], batch_size: int, max_len: int, dtype) -> KVCache:
    """Zero k / v buffers of ``shape`` per layer, no valid entries, write index 0 per row."""
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
        valid=jnp.zeros((batch_size, max_len), bool),
        index=jnp.zeros((batch_size,), jnp.int32),
    )


def write_rows(buffer: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Writes new[b] into buffer[b] starting at slot index[b] (per-row offsets).

    Args:
      buffer: [B, S, ...] cache buffer.
      new: [B, L, ...] entries to write.
      index: [B] int32 start slots. Like lax.dynamic_update_slice, a start that would
        run past S is clamped, so callers must size the cache for all tokens they write.

    Returns:
      [B, S, ...] updated buffer.
    """

    def one(row, update, start):
        starts = (start,) + (0,) * (row.ndim - 1)
        return jax.lax.dynamic_update_slice(row, update.astype(row.dtype), starts)

    return jax.vmap(one)(buffer, new, index)


def empty_heads_major_cache(
    *, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
    dtype: jnp.dtype,
) -> KVCache:
    """All-zero heads-major cache: k / v [n_kv_heads, batch_size, max_len, head_dim] per layer
    (``head_dim`` may be a padded width), no valid entries, write index 0 for every row."""
    return _zeros(n_layers, (n_kv_heads, batch_size, max_len, head_dim), batch_size, max_len, dtype)


def write_heads_major(buffer: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Writes new[b] into a heads-major buffer's row b starting at slot index[b].

    Args:
      buffer: [KVH, B, S, D'] heads-major cache buffer.
      new: [B, L, KVH, D] entries (D <= D'; zero-padded to D').
      index: [B] int32 start slots; slots past S are dropped (size the cache for every token
        written).

    Returns:
      [KVH, B, S, D'] updated buffer.
    """
    extra = buffer.shape[-1] - new.shape[-1]
    if extra:
        new = jnp.pad(new, [(0, 0)] * (new.ndim - 1) + [(0, extra)])
    b, length = new.shape[:2]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    slots = index.astype(jnp.int32)[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    # one scatter over (row, slot) pairs: a vmapped dynamic_update_slice on axis 1 becomes a
    # scatter that XLA:GPU's transpose folding turns invalid (repeated scatter dims)
    return buffer.at[:, rows, slots].set(jnp.transpose(new, (2, 0, 1, 3)).astype(buffer.dtype),
                                         mode="drop", unique_indices=True)
