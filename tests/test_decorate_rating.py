"""Bradley-Terry fit vs an independent numpy Newton MLE, pair sampling, rank mapping, records."""
import jax
import numpy as np
import pytest

from jaxflow.decorate import rating as R


def _newton_mle(pairs, y, w, n, l2, iters=60):
    """Penalised BT maximum likelihood by Newton's method (float64, dense Hessian)."""
    s = np.zeros(n)
    for _ in range(iters):
        d = s[pairs[:, 0]] - s[pairs[:, 1]]
        p = 1.0 / (1.0 + np.exp(-d))
        r = w * (y - p)
        g = -l2 * s
        np.add.at(g, pairs[:, 0], r)
        np.add.at(g, pairs[:, 1], -r)
        h = np.zeros((n, n))
        c = w * p * (1 - p)
        np.add.at(h, (pairs[:, 0], pairs[:, 0]), c)
        np.add.at(h, (pairs[:, 1], pairs[:, 1]), c)
        np.add.at(h, (pairs[:, 0], pairs[:, 1]), -c)
        np.add.at(h, (pairs[:, 1], pairs[:, 0]), -c)
        s = s + np.linalg.solve(h + l2 * np.eye(n), g)
    return s


def test_bradley_terry_fit_equals_newton_mle():
    n, k = 40, 3
    rng = np.random.default_rng(0)
    true = rng.normal(size=(n, k)) * 1.5
    pairs = R.sample_pairs(n, 6, key=jax.random.key(0))
    y = R.simulate_outcomes(true, pairs, key=jax.random.key(1))
    y[::7, 1] = 0.5  # ties
    w = np.ones_like(y)
    w[::5, 2] = 0.0  # comparisons not judged on criterion 2
    fit, info = R.fit_bradley_terry(pairs, y, n, weights=w, l2=0.1)
    fit = np.asarray(fit)
    for c in range(k):
        ref = _newton_mle(pairs, y[:, c].astype(np.float64), w[:, c], n, 0.1)
        np.testing.assert_allclose(fit[:, c], ref, atol=1e-4, rtol=0)
    assert np.abs(fit.sum(0)).max() < 1e-3
    assert (info["grad_max"] < 1e-4).all()


def test_recovery_improves_with_comparisons():
    out = R.recovery_study(100, (3, 24), spread=1.0, repeats=1, key=jax.random.key(3))
    assert out[24]["spearman"] > out[3]["spearman"] + 0.1
    assert out[24]["spearman"] > 0.8


def test_sample_pairs_covers_every_item():
    pairs = R.sample_pairs(17, 5, key=jax.random.key(2))
    counts = np.bincount(pairs.ravel(), minlength=17)
    assert counts.min() >= 5 and (pairs[:, 0] != pairs[:, 1]).all()
    with pytest.raises(ValueError, match="n_items >= 2"):
        R.sample_pairs(1, 3, key=jax.random.key(0))


def test_uniform_scores_and_spearman():
    s = np.array([0.3, -1.0, 0.3, 2.0, 0.0])
    np.testing.assert_allclose(R.uniform_scores(s), [62.5, 0.0, 62.5, 100.0, 25.0])
    import scipy.stats as scipy_stats  # scipy comes with the scikit-learn core dependency
    a = np.random.default_rng(0).normal(size=(30, 2))
    b = a + np.random.default_rng(1).normal(size=(30, 2))
    b[:5, 0] = b[0, 0]  # ties
    for c in range(2):
        assert R.spearman(a, b)[c] == pytest.approx(scipy_stats.spearmanr(a[:, c], b[:, c])[0], abs=1e-12)


def test_bad_comparison_records():
    with pytest.raises(ValueError, match=r"record 1 names unknown item\(s\) \[0, 9\]"):
        R.validate_pairs(np.array([[0, 1], [0, 9]]), 5)
    with pytest.raises(ValueError, match="compares item 2 with itself"):
        R.validate_pairs(np.array([[2, 2]]), 5)
    recs = [{"a": "x", "b": "y", "criterion": "expertise", "winner": "a"},
            {"a": "x", "b": "zz", "criterion": "expertise", "winner": "b"}]
    with pytest.raises(ValueError, match="record 1 names unknown item 'zz'"):
        R.comparisons_from_records(recs, ["x", "y"])
    pairs, y, w = R.comparisons_from_records(recs[:1] + [
        {"a": "x", "b": "y", "criterion": "subjectivity", "winner": "tie"}], ["x", "y"])
    assert pairs.tolist() == [[0, 1]] and y[0, 1] == 1.0 and y[0, 7] == 0.5 and w.sum() == 2
    with pytest.raises(ValueError, match="outcomes must lie in"):
        R.fit_bradley_terry(np.array([[0, 1]]), np.array([1.5]), 2)
