"""Stage "pooling": per-id embeddings from the deduplicated rows, pooled per bag or not.

After dedup a device holds one row per distinct key (``unique_emb [C, D]``) and each id's slot
(``inverse``, -1 = padding). Pooling a bag is then an embedding bag over the unique rows:
gather + segment-sum, the Pallas kernel's op. The XLA reference is the default. ``AUTO`` uses
the kernel on GPU/TPU only where its forward and gradient build for these shapes (compiled
alone first, verdict cached per shape, ``pallas_kernels.dispatch``; f32 / bf16 tables of any
dim; another dtype is refused before building), else XLA with one warning; ``PALLAS`` is
the same off CPU and interpret mode on CPU; ``PALLAS_FORCED`` raises ``KernelUnavailable``
where the kernel does not build (levanter's attention backend pattern).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxflow.embeddings.spec import Pooling
from pallas_kernels import dispatch
from pallas_kernels.embedding_bag import (
    embedding_bag,
    embedding_bag_reference,
    unsupported_reason,
)


class PoolingBackend(str, enum.Enum):
    """How bags are pooled: ``xla``, ``auto`` (the Pallas kernel where it builds, else XLA), ``pallas`` (interpret
    mode on CPU) or ``pallas_forced`` (no fallback)."""
    XLA = "xla"
    AUTO = "auto"  # the kernel on GPU/TPU where it builds for these shapes, else XLA
    PALLAS = "pallas"  # interpret mode on CPU; off CPU like auto
    PALLAS_FORCED = "pallas_forced"  # no fallback: KernelUnavailable where it does not build


def _kernel_builds(unique_emb, inverse, mode: str, dispatch_mode: str, blocked) -> bool:
    """The dispatch verdict for the kernel's forward and table gradient at these shapes."""
    def fwd_and_grad(table, ids):
        return jax.grad(lambda t: jnp.sum(embedding_bag(t, ids, mode=mode)))(table)

    return dispatch.choose_kernel("embedding_bag", dispatch_mode, fwd_and_grad,
                                  (unique_emb, inverse), options=(mode,), blocked=blocked)


def _pool_kernel_or_xla(unique_emb, inverse, mode, backend: PoolingBackend):
    # A table dtype the kernel does not take (it takes f32 / bf16, every dim) is known
    # without building: auto uses XLA, a forced kernel raises KernelUnavailable.
    blocked = unsupported_reason(unique_emb.dtype)
    if backend is not PoolingBackend.AUTO and dispatch.backend_platform() == "cpu":
        if blocked is None:
            return embedding_bag(unique_emb, inverse, mode=mode, interpret=True)
        if backend is PoolingBackend.PALLAS_FORCED:
            raise dispatch.KernelUnavailable(dispatch.unavailable_message(
                "embedding_bag", "cpu", (unique_emb, inverse), blocked))
        return embedding_bag_reference(unique_emb, inverse, mode)
    dispatch_mode = "pallas" if backend is PoolingBackend.PALLAS_FORCED else "auto"
    if _kernel_builds(unique_emb, inverse, mode, dispatch_mode, blocked):
        return embedding_bag(unique_emb, inverse, mode=mode)
    return embedding_bag_reference(unique_emb, inverse, mode)


def pool_bags(unique_emb: jax.Array, inverse: jax.Array, pooling: str,
              backend: str = PoolingBackend.XLA.value) -> jax.Array:
    """unique_emb [C, D], inverse int32[b, L] -> [b, D] (sum / mean) or [b, L, D] (none).

    Padding (-1) contributes zeros; a mean over an empty bag is zero. ``backend``: a
    PoolingBackend value ("xla" default, "auto", "pallas", "pallas_forced").
    """
    if pooling == Pooling.NONE.value:
        valid = inverse >= 0
        rows = jnp.take(unique_emb, jnp.where(valid, inverse, 0), axis=0)
        return jnp.where(valid[..., None], rows, 0).astype(unique_emb.dtype)
    try:
        backend = PoolingBackend(backend)
    except ValueError:
        raise ValueError(f"pooling backend {backend!r}; valid: "
                         f"{', '.join(b.value for b in PoolingBackend)}") from None
    if backend == PoolingBackend.XLA:
        return embedding_bag_reference(unique_emb, inverse, pooling)
    return _pool_kernel_or_xla(unique_emb, inverse, pooling, backend)
