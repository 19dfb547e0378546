"""SparseGPT / Wanda / magnitude on one layer: exact patterns, error ordering, equivalence with a
plain column-by-column OBS reference, rank-deficient Hessians and announced Cholesky retries."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.prune.baselines import magnitude_prune, wanda_prune
from jaxflow.prune.masks import parse_sparsity, prune_count
from jaxflow.prune.sparsegpt import (
    CholeskyRetryWarning,
    hessian_from_inputs,
    hessian_init,
    hessian_update,
    reconstruction_error,
    sparsegpt_prune,
)

METHODS = {"sparsegpt": sparsegpt_prune, "wanda": wanda_prune, "magnitude": magnitude_prune}


def _layer(rows=24, cols=64, tokens=512, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0, 1, cols))
    mix = np.eye(cols) * 0.5 + rng.normal(size=(cols, cols)) / np.sqrt(cols)
    x = lambda n: ((rng.normal(size=(n, cols)) @ mix) * scales).astype(np.float32)  # noqa: E731
    w = rng.normal(size=(rows, cols)).astype(np.float32)
    return w, x(tokens), x(tokens)


def _reference_sparsegpt(w, h, sparsity, block_size, damp=0.01):
    """Paper algorithm in float64 numpy, one column at a time, no lazy batching."""
    pattern = parse_sparsity(sparsity)
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    rows, cols = w.shape
    h += damp * np.mean(np.diag(h)) * np.eye(cols)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    mask = np.zeros_like(w, bool)
    for i in range(cols):
        if i % block_size == 0 and not pattern.is_nm:
            i2 = min(i + block_size, cols)
            score = (w[:, i:i2] / np.diag(u)[i:i2]) ** 2
            k = prune_count(score.size, pattern.fraction)
            flat = np.zeros(score.size, bool)
            flat[np.argsort(score.ravel(), kind="stable")[:k]] = True
            mask[:, i:i2] = flat.reshape(score.shape)
        if pattern.is_nm and i % pattern.m == 0:
            score = (w[:, i:i + pattern.m] / np.diag(u)[i:i + pattern.m]) ** 2
            ranks = np.argsort(np.argsort(score, axis=1, kind="stable"), axis=1, kind="stable")
            mask[:, i:i + pattern.m] = ranks < pattern.n
        q = np.where(mask[:, i], 0.0, w[:, i])
        err = (w[:, i] - q) / u[i, i]
        w[:, i:] -= np.outer(err, u[i, i:])
        w[:, i] = q
    return w, mask


@pytest.mark.parametrize("method", sorted(METHODS))
def test_exact_unstructured_sparsity(method):
    w, x, _ = _layer()
    pruned, mask = METHODS[method](jnp.asarray(w), hessian_from_inputs(jnp.asarray(x)), 0.6,
                                   block_size=32)
    pruned, mask = np.asarray(pruned), np.asarray(mask)
    assert np.all(pruned[mask] == 0) and np.all(pruned[~mask] != 0)
    if method == "sparsegpt":  # exact per column block
        for i in range(0, 64, 32):
            assert mask[:, i:i + 32].sum() == prune_count(24 * 32, 0.6)
    elif method == "wanda":  # exact per output row
        assert np.all(mask.sum(1) == prune_count(64, 0.6))
    else:
        assert mask.sum() == prune_count(w.size, 0.6)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_exact_nm_pattern(method):
    w, x, _ = _layer()
    pruned, _ = METHODS[method](jnp.asarray(w), hessian_from_inputs(jnp.asarray(x)), "2:4",
                                block_size=32)
    zeros = (np.asarray(pruned) == 0).reshape(24, 16, 4).sum(-1)
    assert np.all(zeros == 2)


@pytest.mark.parametrize("sparsity", [0.5, "2:4"])
def test_blocked_lazy_updates_match_columnwise_reference(sparsity):
    w, x, _ = _layer(rows=16, cols=64)
    h = hessian_from_inputs(jnp.asarray(x))
    ours, mask = sparsegpt_prune(jnp.asarray(w), h, sparsity, block_size=16)
    ref, ref_mask = _reference_sparsegpt(w, np.asarray(h), sparsity, block_size=16)
    assert np.array_equal(np.asarray(mask), ref_mask)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=2e-3, atol=2e-4 * np.abs(w).max())


@pytest.mark.parametrize("sparsity", [0.5, 0.7, "2:4"])
def test_sparsegpt_error_below_wanda_and_magnitude(sparsity):
    w, x, held = _layer(rows=32, cols=64, tokens=1024)
    h = hessian_from_inputs(jnp.asarray(x))
    errors = {name: reconstruction_error(w, fn(jnp.asarray(w), h, sparsity)[0], held)
              for name, fn in METHODS.items()}
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors


def test_hessian_running_average_ignores_padding():
    _, x, _ = _layer(cols=16, tokens=64)
    state = hessian_init(16)
    state = hessian_update(state, jnp.asarray(x[:40]))
    padded = np.concatenate([x[40:], np.full((8, 16), 1e3, np.float32)])
    state = hessian_update(state, jnp.asarray(padded), jnp.arange(32) < 24)
    np.testing.assert_allclose(np.asarray(state.h), 2 / 64 * x.T.astype(np.float64) @ x, rtol=1e-4)
    assert float(state.count) == 64


def test_rank_deficient_hessian_with_dead_inputs():
    w, x, held = _layer(rows=16, cols=64, tokens=16)  # 16 tokens: rank <= 16 < 64
    x[:, 5] = 0.0  # a dead input feature
    h = hessian_from_inputs(jnp.asarray(x))
    pruned, mask = sparsegpt_prune(jnp.asarray(w), h, 0.5)
    pruned = np.asarray(pruned)
    assert np.all(np.isfinite(pruned))
    assert np.all(pruned[:, 5] == 0)
    assert np.asarray(mask).sum() == prune_count(w.size, 0.5)
    assert reconstruction_error(w, pruned, x) < reconstruction_error(w, magnitude_prune(w, None, 0.5)[0], x)


def test_failed_cholesky_retries_with_more_damping_and_says_so():
    w, x, _ = _layer(rows=8, cols=32, tokens=8)
    h = hessian_from_inputs(jnp.asarray(x)) - 0.2 * jnp.eye(32)  # indefinite even after 1%
    with pytest.warns(CholeskyRetryWarning, match="retrying with"):
        pruned, _ = sparsegpt_prune(jnp.asarray(w), h, 0.5, damp=0.01)
    assert np.all(np.isfinite(np.asarray(pruned)))
    with pytest.warns(CholeskyRetryWarning), pytest.raises(np.linalg.LinAlgError, match="failed"):
        sparsegpt_prune(jnp.asarray(w), h, 0.5, damp=0.01, max_retries=1, damp_growth=1.0)


def test_bad_sparsity_values_are_named():
    for bad in (1.5, "3:2", "half", 0):
        with pytest.raises(ValueError, match="sparsity"):
            parse_sparsity(bad)
