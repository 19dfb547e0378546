"""Key/value cache for incremental decoding: an immutable pytree of arrays."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Per-layer rotated keys and values plus per-row bookkeeping.

    Attributes:
      k: tuple (one per layer) of [B, S, n_kv_heads, head_dim] keys, RoPE already applied.
      v: tuple (one per layer) of [B, S, n_kv_heads, head_dim] values.
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
    shape = (batch_size, max_len, n_kv_heads, head_dim)
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
