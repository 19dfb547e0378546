"""Statistics done by the dependencies that already do them: jaxflow.stats' paired
t / bootstrap intervals (scipy ttest_rel / bootstrap), prune.correlation's bootstrap Spearman
(scipy spearmanr / bootstrap), decorate.editing's edit distance (Levenshtein) and
genrec.metrics' NDCG (checked against sklearn). The hand-written versions they replaced live
on here only as references: same resamples, same figures (to 1e-14 where the arithmetic
differs in the last bits, exactly where it does not)."""
import math

import numpy as np
import pytest
from scipy.stats import t as student_t
from sklearn.metrics import ndcg_score

from jaxflow.decorate.editing import edit_similarity, levenshtein
from jaxflow.genrec.metrics import recall_ndcg_at_k
from jaxflow.prune.correlation import bootstrap_spearman, spearman
from jaxflow.stats import paired_interval

# ----------------------------------------------------------------- the replaced implementations


def old_paired_interval(a, b, *, level=0.95, n_boot=10_000, seed=0):
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    n = d.size
    sd = float(d.std(ddof=1))
    half = float(student_t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n))
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(d.mean()), half, sd, n, float(low), float(high)


def _old_ranks(v):
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=np.float64)
    for value in np.unique(v):
        same = v == value
        r[same] = r[same].mean()
    return r


def old_spearman(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if np.isnan(x).any() or np.isnan(y).any():
        return float("nan")
    rx, ry = _old_ranks(x), _old_ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def old_bootstrap_spearman(x, y, *, n_boot=2000, level=0.95, seed=0):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    reps = np.array([old_spearman(x[i], y[i]) for i in idx])
    defined = reps[~np.isnan(reps)]
    tail = (1 - level) / 2
    lo, hi = (np.quantile(defined, [tail, 1 - tail]) if defined.size else (np.nan, np.nan))
    return {"rho": old_spearman(x, y), "lo": float(lo), "hi": float(hi), "n": int(len(x)),
            "n_boot": int(n_boot), "n_undefined": int(n_boot - defined.size),
            "p_positive": float(np.mean(defined > 0)) if defined.size else float("nan")}


def old_levenshtein(a, b):
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    bb = np.frombuffer(b.encode("utf-32-le"), np.uint32)
    prev = np.arange(len(b) + 1, dtype=np.int64)
    ar = np.arange(len(b) + 1, dtype=np.int64)
    for i, ca in enumerate(a, 1):
        sub = prev[:-1] + (bb != ord(ca))
        cur = np.empty_like(prev)
        cur[0] = i
        cur[1:] = np.minimum(sub, prev[1:] + 1)
        cur = np.minimum.accumulate(cur - ar) + ar
        prev = cur
    return int(prev[-1])


def _close(got, want):
    """Equal, or both nan, or within 1e-14 (scipy interpolates quantiles and forms the t
    half width as (high - low) / 2 around the mean: a few ulp of the mean)."""
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return got == want or abs(got - want) <= 1e-14 * max(1.0, abs(want))


# ----------------------------------------------------------------- the tests


def test_paired_interval_matches_the_hand_written_one_on_random_inputs():
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(2, 12))
        a, b = rng.random(n), rng.random(n)
        level = (0.9, 0.95, 0.99)[trial % 3]
        got = paired_interval(a, b, level=level, n_boot=2000, seed=trial)
        want = old_paired_interval(a, b, level=level, n_boot=2000, seed=trial)
        assert got.n == want[3] and got.mean == want[0] and got.sd == want[2]
        for g, w in zip((got.half_width, got.boot_low, got.boot_high), (want[1], want[4], want[5])):
            assert _close(g, w), (trial, g, w)
    same = paired_interval([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])  # every difference 1: zero width
    assert (same.mean, same.half_width, same.boot_low, same.boot_high) == (1.0, 0.0, 1.0, 1.0)
    one = paired_interval([1.0], [0.5])
    assert one.mean == 0.5 and math.isnan(one.half_width) and math.isnan(one.boot_low)


def test_bootstrap_spearman_matches_the_hand_written_one_on_random_inputs():
    rng = np.random.default_rng(1)
    for trial in range(8):
        n = int(rng.integers(3, 8))
        x = rng.integers(0, 4, n).astype(float)  # ties and constant replicates included
        y = rng.random(n)
        got = bootstrap_spearman(x, y, n_boot=300, seed=trial)
        want = old_bootstrap_spearman(x, y, n_boot=300, seed=trial)
        assert got.keys() == want.keys()
        for key in want:
            assert _close(got[key], want[key]), (trial, key, got[key], want[key])
    assert want["n_undefined"] >= 0
    assert np.isnan(spearman([1, 2, 3], [5, 5, 5])) and np.isnan(spearman([1, np.nan, 2], [1, 2, 3]))
    assert bootstrap_spearman([1.0], [2.0], n_boot=5)["n_undefined"] == 5
    with pytest.raises(ValueError, match="n_boot=0"):
        bootstrap_spearman([1.0, 2.0], [2.0, 3.0], n_boot=0)


def test_levenshtein_matches_the_hand_written_one_on_random_strings():
    rng = np.random.default_rng(2)
    alphabet = np.array(list("abcAB .,é€"))
    for _ in range(300):
        a = "".join(rng.choice(alphabet, int(rng.integers(0, 25))))
        b = "".join(rng.choice(alphabet, int(rng.integers(0, 25))))
        assert levenshtein(a, b) == old_levenshtein(a, b), (a, b)
    assert levenshtein("kitten", "sitting") == 3 and edit_similarity("", "") == 1.0
    assert edit_similarity("abcd", "abed") == 0.75


def test_ndcg_matches_sklearn():
    """One relevant item per request: jaxflow's NDCG@K == sklearn.metrics.ndcg_score row by row
    (scores: the ranked items in order, every other item below them). jaxflow's numpy version
    stays: it is exact and needs no [B, n_items] score matrix."""
    rng = np.random.default_rng(3)
    n_items, b, k = 30, 64, 10
    ranked = np.stack([rng.permutation(n_items)[:k + 2] for _ in range(b)])
    ranked[::7, k - 3:] = -1  # short rankings: -1 = no item
    target = np.where(rng.random(b) < 0.7, ranked[:, rng.integers(0, k)], rng.integers(0, n_items, b))
    target = np.where(target < 0, 0, target)
    recall, ndcg = recall_ndcg_at_k(ranked, target, k)
    for i in range(b):
        relevance = np.zeros((1, n_items))
        relevance[0, target[i]] = 1.0
        items = [int(v) for v in ranked[i, :k] if v >= 0]
        # best first; unranked items below them, the target (if unranked) last of all, so a
        # short ranking's empty slots do not give sklearn a tie-averaged share of it
        score = -1.0 - np.arange(n_items, dtype=np.float64)[None]
        score[0, target[i]] = -2.0 * n_items
        score[0, items] = np.arange(len(items), 0, -1)
        want = ndcg_score(relevance, score, k=k)
        assert ndcg[i] == pytest.approx(want, rel=1e-6), i
        assert recall[i] == float(target[i] in items)
    assert 0 < recall.mean() < 1
