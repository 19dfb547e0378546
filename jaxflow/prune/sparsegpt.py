"""SparseGPT (Frantar & Alistarh 2023) for one linear layer, in JAX.

Conventions follow the paper and the PyTorch implementations: ``weight`` is [rows, cols] with
one column per INPUT feature (y = weight @ x), and the layer Hessian is
H = (2 / n) * sum_t x_t x_t^T over calibration tokens, [cols, cols], accumulated in float32.

Algorithm (``sparsegpt_prune``):
  1. Dead inputs (H_ii == 0) get H_ii = 1 and zero weights.
  2. Damping: H += damp * mean(diag H) * I; U = upper Cholesky factor of H^-1 (U^T U = H^-1).
     A failed factorisation (H not positive definite: non-finite or non-positive pivots) is
     retried with ``damp_growth`` times more damping; every retry is announced with a
     ``CholeskyRetryWarning`` and a log line. After ``max_retries`` it raises.
  3. Columns in blocks of ``block_size``. Unstructured: the block's mask is chosen once over all
     rows from w^2 / U_ii^2 (exactly ``round(size * fraction)`` lowest scores pruned). N:M: at
     every column i with i % M == 0, the N lowest-scoring of the next M columns of each row.
  4. Per column: q = masked w; err = (w - q) / U_ii; the rest of the block -= err * U[i, i:].
     Lazy batch update after the block: later columns -= Err @ U[block, later].

``hessian_init`` / ``hessian_update`` are the running average of step 1's H over batches.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxflow.prune.masks import SparsityPattern, lowest_k_mask, parse_sparsity, prune_count

logger = logging.getLogger(__name__)


class CholeskyRetryWarning(RuntimeWarning):
    """The damped Hessian was not positive definite; SparseGPT retried with more damping."""


class HessianState(NamedTuple):
    """Running average H = (2 / count) * sum x x^T: ``h`` [d, d] float32, ``count`` scalar."""

    h: jax.Array
    count: jax.Array


def hessian_init(dim: int) -> HessianState:
    """An empty Hessian accumulator: float32[dim, dim] zeros and a zero sample count."""
    return HessianState(jnp.zeros((dim, dim), jnp.float32), jnp.zeros((), jnp.float32))


@jax.jit
def hessian_update(state: HessianState, x: jax.Array, valid: jax.Array | None = None) -> HessianState:
    """Adds calibration activations to the running Hessian.

    Args:
      state: from ``hessian_init`` or a previous update.
      x: [..., d] layer inputs (any leading shape; cast to float32).
      valid: [...] bool/0-1, False for tokens to ignore (padding). Default all valid.
    """
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    w = jnp.ones((x.shape[0],), jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
    added = w.sum()
    total = state.count + added
    scale = jnp.where(total > 0, state.count / jnp.maximum(total, 1.0), 0.0)
    xw = x * w[:, None]
    outer = jnp.einsum("ti,tj->ij", xw, x, precision=jax.lax.Precision.HIGHEST)
    h = state.h * scale + (2.0 / jnp.maximum(total, 1.0)) * outer
    return HessianState(h, total)


def hessian_from_inputs(x: jax.Array) -> jax.Array:
    """H = (2 / n) X^T X for inputs ``x`` [n, d] (one batch)."""
    return hessian_update(hessian_init(x.shape[-1]), x).h


@jax.jit
def _prepare(weight: jax.Array, hessian: jax.Array):
    """Dead inputs: H_ii := 1 and their weights := 0."""
    diag = jnp.diagonal(hessian)
    dead = diag == 0
    hessian = hessian + jnp.diag(dead.astype(hessian.dtype))
    weight = jnp.where(dead[None, :], 0.0, weight)
    return weight, hessian


@jax.jit
def _inverse_cholesky_upper(hessian: jax.Array, damp: jax.Array):
    """(U upper with U^T U = (H + damp * mean(diag H) I)^-1, ok flag)."""
    d = hessian.shape[0]
    eye = jnp.eye(d, dtype=jnp.float32)
    damped = hessian + damp * jnp.mean(jnp.diagonal(hessian)) * eye
    lower = jnp.linalg.cholesky(damped)
    inverse = jax.scipy.linalg.cho_solve((lower, True), eye)
    inverse = 0.5 * (inverse + inverse.T)
    upper = jnp.linalg.cholesky(inverse).T
    pivots = jnp.concatenate([jnp.diagonal(lower), jnp.diagonal(upper)])
    ok = jnp.all(jnp.isfinite(upper)) & jnp.all(pivots > 0)
    return upper, ok


def inverse_cholesky_upper(hessian: jax.Array, *, damp: float = 0.01, damp_growth: float = 10.0,
                           max_retries: int = 6, name: str = "layer") -> tuple[jax.Array, float]:
    """Upper Cholesky factor of the damped inverse Hessian, retrying with more damping.

    Returns (U [d, d], the damping fraction that worked). Each retry emits a
    ``CholeskyRetryWarning`` naming ``name`` and both damping values; raises
    ``numpy.linalg.LinAlgError`` when ``max_retries`` retries all fail.
    """
    import numpy as np

    current = float(damp)
    for attempt in range(max_retries + 1):
        upper, ok = _inverse_cholesky_upper(hessian, jnp.float32(current))
        if bool(ok):
            return upper, current
        if attempt == max_retries:
            break
        nxt = max(current * damp_growth, 1e-2)
        message = (f"SparseGPT {name}: Hessian not positive definite with damping {current:g} "
                   f"x mean(diag H); retrying with {nxt:g} (attempt {attempt + 1}/{max_retries})")
        logger.warning(message)
        warnings.warn(message, CholeskyRetryWarning, stacklevel=2)
        current = nxt
    raise np.linalg.LinAlgError(
        f"SparseGPT {name}: Cholesky of the damped Hessian failed up to damping {current:g}; "
        "use more calibration samples or a larger damp")


@functools.partial(jax.jit, static_argnames=("pattern", "block_size"))
def _obs_prune(weight: jax.Array, upper: jax.Array, *, pattern: SparsityPattern, block_size: int):
    """Blocked OBS pruning with lazy batch updates; returns (pruned weight, mask)."""
    rows, cols = weight.shape
    masks = []
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        count = i2 - i1
        w1 = weight[:, i1:i2]
        u1 = upper[i1:i2, i1:i2]
        d1 = jnp.diagonal(u1)
        if pattern.is_nm:
            mask1 = jnp.zeros((rows, count), bool)
        else:
            mask1 = lowest_k_mask(w1**2 / d1[None, :] ** 2, prune_count(rows * count, pattern.fraction))

        def column(i, carry):
            w1, q1, err1, mask1 = carry
            if pattern.is_nm:
                def choose(mask1):
                    group = jax.lax.dynamic_slice(w1, (0, i), (rows, pattern.m))
                    dg = jax.lax.dynamic_slice(d1, (i,), (pattern.m,))
                    new = lowest_k_mask(group**2 / dg[None, :] ** 2, pattern.n, axis=1)
                    return jax.lax.dynamic_update_slice(mask1, new, (0, i))

                mask1 = jax.lax.cond(i % pattern.m == 0, choose, lambda m: m, mask1)
            w = jax.lax.dynamic_index_in_dim(w1, i, axis=1, keepdims=False)
            pruned = jax.lax.dynamic_index_in_dim(mask1, i, axis=1, keepdims=False)
            q = jnp.where(pruned, 0.0, w)
            u_row = jax.lax.dynamic_index_in_dim(u1, i, axis=0, keepdims=False)
            err = (w - q) / u_row[i]
            # u_row is zero left of i (U is upper triangular): only columns >= i change.
            w1 = w1 - err[:, None] * u_row[None, :]
            q1 = jax.lax.dynamic_update_index_in_dim(q1, q, i, axis=1)
            err1 = jax.lax.dynamic_update_index_in_dim(err1, err, i, axis=1)
            return w1, q1, err1, mask1

        zeros = jnp.zeros_like(w1)
        _, q1, err1, mask1 = jax.lax.fori_loop(0, count, column, (w1, zeros, zeros, mask1))
        weight = weight.at[:, i1:i2].set(q1)
        if i2 < cols:
            weight = weight.at[:, i2:].add(
                -jnp.matmul(err1, upper[i1:i2, i2:], precision=jax.lax.Precision.HIGHEST))
        masks.append(mask1)
    return weight, jnp.concatenate(masks, axis=1)


def sparsegpt_prune(weight: jax.Array, hessian: jax.Array, sparsity: float | str | SparsityPattern, *,
                    block_size: int = 128, damp: float = 0.01, damp_growth: float = 10.0,
                    max_retries: int = 6, name: str = "layer") -> tuple[jax.Array, jax.Array]:
    """Prunes one linear layer with SparseGPT.

    Args:
      weight: [rows, cols] (cols = input features; y = weight @ x).
      hessian: [cols, cols] = (2/n) X^T X of the layer's calibration inputs (``hessian_update``).
      sparsity: fraction in (0, 1) (unstructured) or "N:M" such as "2:4".
      block_size: columns per lazy-update block (a multiple of M for N:M).
      damp: diagonal damping as a fraction of mean(diag H); see ``inverse_cholesky_upper``
        for the announced retries.
      name: used in warnings and errors.

    Returns:
      (pruned weight [rows, cols] in weight's dtype, mask [rows, cols] bool, True = pruned).
    """
    pattern = parse_sparsity(sparsity)
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"SparseGPT {name}: hessian shape {hessian.shape} does not match weight "
                         f"{weight.shape} (expected ({cols}, {cols}))")
    if pattern.is_nm and (block_size % pattern.m or cols % pattern.m):
        raise ValueError(f"SparseGPT {name}: N:M={pattern} needs block_size ({block_size}) and "
                         f"the input dimension ({cols}) to be multiples of {pattern.m}")
    dtype = weight.dtype
    w, h = _prepare(weight.astype(jnp.float32), hessian.astype(jnp.float32))
    upper, _ = inverse_cholesky_upper(h, damp=damp, damp_growth=damp_growth,
                                      max_retries=max_retries, name=name)
    pruned, mask = _obs_prune(w, upper, pattern=pattern, block_size=min(block_size, cols))
    return pruned.astype(dtype), mask


def reconstruction_error(weight: jax.Array, pruned: jax.Array, x: jax.Array) -> float:
    """||W X - W_pruned X||_F^2 / ||W X||_F^2 for inputs ``x`` [n, cols] (float64 on host)."""
    import numpy as np

    w = np.asarray(weight, np.float64)
    p = np.asarray(pruned, np.float64)
    xs = np.asarray(x, np.float64).reshape(-1, w.shape[1])
    dense = xs @ w.T
    return float(np.sum((dense - xs @ p.T) ** 2) / np.sum(dense**2))
