"""Cheaper pruning baselines that never update the kept weights.

- ``magnitude_prune``: score |W_ij|; unstructured masks are chosen over the whole layer.
- ``wanda_prune`` (Sun et al. 2023): score |W_ij| * ||X_j||_2, compared within each output row.
  ||X_j||^2 is proportional to H_jj of the SparseGPT Hessian, so both baselines take the same
  (weight, hessian) arguments as ``sparsegpt_prune``.
N:M patterns rank each group of M consecutive inputs of a row for both.
Shapes as in ``jaxflow.prune.sparsegpt``: weight [rows, cols], cols = input features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxflow.prune.masks import SparsityPattern, lowest_k_mask, nm_mask, parse_sparsity, prune_count


@functools.partial(jax.jit, static_argnames=("pattern", "per_row"))
def _apply(weight: jax.Array, scores: jax.Array, pattern: SparsityPattern, *, per_row: bool):
    rows, cols = weight.shape
    if pattern.is_nm:
        mask = nm_mask(scores, pattern.n, pattern.m)
    elif per_row:
        mask = lowest_k_mask(scores, prune_count(cols, pattern.fraction), axis=1)
    else:
        mask = lowest_k_mask(scores, prune_count(rows * cols, pattern.fraction))
    return jnp.where(mask, jnp.zeros((), weight.dtype), weight), mask


def magnitude_prune(weight: jax.Array, hessian: jax.Array | None, sparsity: float | str,
                    **_) -> tuple[jax.Array, jax.Array]:
    """(pruned weight, mask) keeping the largest |W| (``hessian`` is ignored)."""
    pattern = parse_sparsity(sparsity)
    return _apply(weight, jnp.abs(weight.astype(jnp.float32)), pattern, per_row=False)


def wanda_prune(weight: jax.Array, hessian: jax.Array, sparsity: float | str, **_) -> tuple[jax.Array, jax.Array]:
    """(pruned weight, mask) keeping the largest |W_ij| * sqrt(H_jj) in every output row."""
    pattern = parse_sparsity(sparsity)
    feature_norm = jnp.sqrt(jnp.maximum(jnp.diagonal(hessian).astype(jnp.float32), 0.0))
    scores = jnp.abs(weight.astype(jnp.float32)) * feature_norm[None, :]
    return _apply(weight, scores, pattern, per_row=True)
