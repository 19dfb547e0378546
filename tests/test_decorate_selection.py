"""Sampling weights vs numpy, hierarchical tag balance flattening, token-budget selection."""
import jax
import numpy as np
import pytest

from jaxflow.decorate import selection as S


def test_rating_weights_equal_numpy():
    r = np.random.default_rng(0).normal(size=(50, 8)) * [1, 2, 3, 4, 5, 6, 7, 8] + 10
    want = np.zeros(50)
    for k, c in enumerate(S.DEFAULT_COEFS):
        col = r[:, k]
        want += c * np.exp((col - col.mean()) / col.std())
    np.testing.assert_allclose(S.rating_weights(r), want, rtol=1e-12)
    r[:, 3] = 1.0  # constant column: z = 0, exp(0) = 1
    assert np.isfinite(S.rating_weights(r)).all()
    with pytest.raises(ValueError, match="needs 8 columns"):
        S.rating_weights(r[:, :7])


def _skewed_tags(rng, n1_counts):
    rows = []
    for a, n in enumerate(n1_counts):
        b = 2 * a + (rng.random(n) < 0.8)          # skewed level-2 split inside a
        c = 2 * b + (rng.random(n) < 0.3)
        rows.append(np.stack([np.full(n, a), b, c], 1))
    return np.concatenate(rows)


def test_tag_balance_flattens_as_exponent_predicts():
    rng = np.random.default_rng(0)
    counts = [1200, 300, 100, 40, 10]
    tags = _skewed_tags(rng, counts)
    w = S.tag_balance_weights(tags, (0.5, 0.5, 0.5))
    mass1 = np.bincount(tags[:, 0], weights=w)
    np.testing.assert_allclose(mass1, np.sqrt(counts), rtol=1e-12)
    for a in range(len(counts)):  # level-2 shares inside a follow n_b^0.5
        m = tags[:, 0] == a
        nb = np.bincount(tags[m, 1] - 2 * a, minlength=2)
        mb = np.bincount(tags[m, 1] - 2 * a, weights=w[m], minlength=2)
        np.testing.assert_allclose(mb / mb.sum(), np.sqrt(nb) / np.sqrt(nb).sum(), rtol=1e-12)
    # Sampling follows it: drawn category shares match n_a^0.5 / sum (not n_a / sum).
    predicted = np.sqrt(counts) / np.sqrt(counts).sum()
    freq = np.zeros(len(counts))
    for s in range(20):
        idx = S.gumbel_order(w, key=jax.random.key(s))[:80]
        freq += np.bincount(tags[idx, 0], minlength=len(counts))
    freq /= freq.sum()
    np.testing.assert_allclose(freq, predicted, atol=0.03)
    assert abs(freq[0] - counts[0] / sum(counts)) > 0.2  # far from the raw skew
    # exponent 1 leaves the level-1 distribution as it is
    w1 = S.tag_balance_weights(tags, (1.0, 1.0, 1.0))
    np.testing.assert_allclose(np.bincount(tags[:, 0], weights=w1), counts, rtol=1e-12)


def test_select_budget_rules():
    w = np.array([1.0, 2.0, 0.0, 3.0, 1.0])
    n_tok = np.array([10, 20, 30, 40, 50])
    idx = S.select_budget(w, n_tok, 65, key=jax.random.key(0))
    assert 2 not in idx and n_tok[idx].sum() <= 65
    order = S.gumbel_order(w, key=jax.random.key(0))
    assert list(idx) == list(order[: len(idx)])
    assert len(idx) == len(order) or n_tok[idx].sum() + n_tok[order[len(idx)]] > 65
    with pytest.raises(ValueError, match="token budget 121 exceeds the 120 tokens"):
        S.select_budget(w, n_tok, 121, key=jax.random.key(0))
    with pytest.raises(ValueError, match="must be > 0"):
        S.select_budget(w, n_tok, 0, key=jax.random.key(0))
