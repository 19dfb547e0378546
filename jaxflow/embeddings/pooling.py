"""Stage "pooling": per-id embeddings from the deduplicated rows, pooled per bag or not.

After dedup a device holds one row per distinct key (``unique_emb [C, D]``) and each id's slot
(``inverse``, -1 = padding). Pooling a bag is then an embedding bag over the unique rows:
gather + segment-sum, the Pallas kernel's op. The XLA reference is the default; the Pallas
kernel is opt-in (``PoolingBackend.PALLAS``) and falls back to XLA with a warning when it
cannot run, unless forced (levanter's attention backend pattern).
"""

from __future__ import annotations

import enum
import warnings

import jax
import jax.numpy as jnp

from jaxflow.embeddings.spec import Pooling
from pallas_kernels.embedding_bag import embedding_bag, embedding_bag_reference


class PoolingBackend(str, enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"  # interpret mode off GPU/TPU
    PALLAS_FORCED = "pallas_forced"  # no fallback: errors propagate


def _try_pallas(unique_emb, inverse, mode, forced: bool):
    interpret = jax.default_backend() == "cpu"
    try:
        return embedding_bag(unique_emb, inverse, mode=mode, interpret=interpret)
    except Exception as e:  # noqa: BLE001 - fall back to XLA unless the user forced the kernel
        if forced:
            raise
        warnings.warn(f"Pallas embedding_bag failed ({type(e).__name__}: {e}); using XLA reference")
        return embedding_bag_reference(unique_emb, inverse, mode)


def pool_bags(unique_emb: jax.Array, inverse: jax.Array, pooling: str,
              backend: str = PoolingBackend.XLA.value) -> jax.Array:
    """unique_emb [C, D], inverse int32[b, L] -> [b, D] (sum / mean) or [b, L, D] (none).

    Padding (-1) contributes zeros; a mean over an empty bag is zero.
    """
    if pooling == Pooling.NONE.value:
        valid = inverse >= 0
        rows = jnp.take(unique_emb, jnp.where(valid, inverse, 0), axis=0)
        return jnp.where(valid[..., None], rows, 0).astype(unique_emb.dtype)
    backend = PoolingBackend(backend)
    if backend == PoolingBackend.XLA:
        return embedding_bag_reference(unique_emb, inverse, pooling)
    return _try_pallas(unique_emb, inverse, pooling, backend == PoolingBackend.PALLAS_FORCED)
