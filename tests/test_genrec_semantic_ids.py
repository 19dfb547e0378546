"""RQ-KMeans semantic IDs: error falls per level, unique codes, collisions, sharding, and
de-duplication codes on a skewed catalogue (many items in one prefix)."""

import jax
import numpy as np
import pytest

from jaxflow.genrec.semantic_ids import dedup_codes, rq_kmeans
from jaxflow.genrec.train import data_mesh


def _clustered(n=203, d=8, seed=0):
    rng = np.random.default_rng(seed)
    centres = 3.0 * rng.standard_normal((6, d))
    return (centres[rng.integers(0, 6, n)] + rng.standard_normal((n, d))).astype(np.float32)


@pytest.fixture(scope="module")
def ids():
    return rq_kmeans(_clustered(), levels=3, width=8, key=jax.random.key(0), iters=20)


def test_reconstruction_error_falls_with_each_level(ids):
    x = _clustered()
    base = float(np.mean(np.sum(x ** 2, 1)))
    raw = (base,) + ids.raw_reconstruction_error
    assert all(b < a for a, b in zip(raw, raw[1:])), raw
    resolved = (base,) + ids.reconstruction_error
    assert all(b < a for a, b in zip(resolved, resolved[1:])), resolved
    # the codes really reconstruct: sum of the chosen centroids
    recon = sum(ids.codebooks[lv][ids.codes[:, lv]] for lv in range(3))
    assert np.isclose(np.mean(np.sum((x - recon) ** 2, 1)), ids.reconstruction_error[-1],
                      rtol=1e-4)


def test_codes_unique_and_reported(ids):
    assert ids.codes.shape == (203, 3) and ids.codes.dtype == np.int32
    assert ids.dedup_levels == 0 and ids.kmeans_levels == 3  # every prefix group fits in 8
    assert ids.largest_prefix_group <= 8
    assert len(np.unique(ids.codes, axis=0)) == 203
    assert len(ids.item_of_code()) == 203
    assert all(0 < u <= 1 for u in ids.utilisation)
    assert 0 <= ids.collision_rate <= 1


def test_duplicate_items_collide_then_get_distinct_last_codes():
    x = np.concatenate([_clustered(60), np.repeat(_clustered(1, seed=5), 5, 0)])
    out = rq_kmeans(x, levels=3, width=8, key=jax.random.key(1), iters=10)
    assert out.collision_rate >= 5 / 65  # the 5 identical items share a raw tuple
    assert len(np.unique(out.codes, axis=0)) == 65
    assert len(np.unique(out.codes[-5:, :2], axis=0)) == 1  # same prefix, distinct last codes


def test_collisions_beyond_last_width_name_the_prefix_with_dedup_off():
    x = np.repeat(_clustered(1), 6, 0)  # 6 identical items, last level of width 4
    with pytest.raises(ValueError, match=r"holds 6 items but the last level has width 4"):
        rq_kmeans(x, levels=2, width=4, key=jax.random.key(0), iters=2, dedup="off")
    with pytest.raises(ValueError, match=r"dedup='bogus': must be one of"):
        rq_kmeans(x, levels=2, width=4, key=jax.random.key(0), dedup="bogus")


def _skewed(n_hot=150, n_rest=50, seed=0):
    """A skewed catalogue: ``n_hot`` items that are near copies of one item (the same genre /
    year / title shape, as in MovieLens) and ``n_rest`` spread ones."""
    rng = np.random.default_rng(seed)
    hot = _clustered(1, seed=9) + 1e-3 * rng.standard_normal((n_hot, 8)).astype(np.float32)
    hot[: n_hot // 3] = hot[0]  # a third exactly identical
    return np.concatenate([_clustered(n_rest, seed=seed + 1), hot]).astype(np.float32)


@pytest.mark.parametrize("dedup", ["auto", "tiger"])
def test_skewed_catalogue_gets_unique_ids_from_dedup_codes(dedup):
    x = _skewed()
    out = rq_kmeans(x, levels=2, width=4, key=jax.random.key(0), iters=5, dedup=dedup)
    n = len(x)
    assert out.largest_prefix_group > 4 * 4  # more than the last level can hold, even capped
    assert out.kmeans_levels == 2 and out.levels == 2 + out.dedup_levels
    assert out.codes.min() >= 0 and out.codes.max() < 4  # every level, dedup too, in [0, W)
    assert len(np.unique(out.codes, axis=0)) == n  # unique: the trie accepts them
    assert len(out.utilisation) == out.levels
    # the dedup codes number, in base W, the items that share their k-means codes
    km = out.codes[:, :2]
    value = sum(out.codes[:, 2 + j].astype(np.int64) * 4 ** (out.dedup_levels - 1 - j)
                for j in range(out.dedup_levels))
    _, group, sizes = np.unique(km, axis=0, return_inverse=True, return_counts=True)
    for g in range(len(sizes)):
        assert sorted(value[group.reshape(-1) == g].tolist()) == list(range(sizes[g]))
    assert out.dedup_levels == int(np.ceil(np.log(sizes.max()) / np.log(4) - 1e-9)) or (
        dedup == "tiger" and sizes.max() == 1)
    if dedup == "tiger":  # TIGER: k-means codes are the plain nearest centroids
        assert out.dedup_levels >= 1
        assert out.reconstruction_error == out.raw_reconstruction_error
    else:  # the last level spreads the big group over all W codes, at most ceil(S/W) each
        assert sizes.max() <= -(-out.largest_prefix_group // 4)


def test_dedup_codes_base_width_digits_and_order():
    codes = np.asarray([[0, 1]] * 7 + [[2, 2]])
    dist = np.asarray([0.5, 0.1, 0.3, 0.3, 0.9, 0.0, 0.2, 4.0])
    d = dedup_codes(codes, dist, 3)
    # ranks by distance (ties by index): 5, 1, 6, 2, 3, 0, 4 -> 0..6; base 3 over 2 digits
    want_rank = {5: 0, 1: 1, 6: 2, 2: 3, 3: 4, 0: 5, 4: 6, 7: 0}
    assert d.shape == (8, 2)
    assert [int(a) * 3 + int(b) for a, b in d] == [want_rank[i] for i in range(8)]
    assert dedup_codes(np.asarray([[0], [1]]), np.zeros(2), 3).shape == (2, 0)
    assert dedup_codes(np.asarray([[0], [1]]), np.zeros(2), 3, min_levels=1).tolist() == [[0], [0]]


def test_bad_embeddings_named():
    x = _clustered(10)
    x[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"items \[3\] are not finite"):
        rq_kmeans(x, key=jax.random.key(0), width=4)
    with pytest.raises(ValueError, match="need levels >= 1 and width >= 2"):
        rq_kmeans(_clustered(10), key=jax.random.key(0), width=1)


def test_sharded_over_items_matches_single_device(ids):
    mesh = data_mesh()
    assert mesh.size == 8
    sharded = rq_kmeans(_clustered(), levels=3, width=8, key=jax.random.key(0), iters=20,
                        mesh=mesh)
    np.testing.assert_array_equal(sharded.codes, ids.codes)
    np.testing.assert_allclose(sharded.reconstruction_error, ids.reconstruction_error, rtol=1e-5)
