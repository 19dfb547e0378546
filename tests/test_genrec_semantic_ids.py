"""RQ-KMeans semantic IDs: error falls per level, unique codes, collisions, sharding."""

import jax
import numpy as np
import pytest

from jaxflow.genrec.semantic_ids import rq_kmeans
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
    recon = sum(ids.codebooks[l][ids.codes[:, l]] for l in range(3))
    assert np.isclose(np.mean(np.sum((x - recon) ** 2, 1)), ids.reconstruction_error[-1],
                      rtol=1e-4)


def test_codes_unique_and_reported(ids):
    assert ids.codes.shape == (203, 3) and ids.codes.dtype == np.int32
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


def test_collisions_beyond_last_width_name_the_prefix():
    x = np.repeat(_clustered(1), 6, 0)  # 6 identical items, last level of width 4
    with pytest.raises(ValueError, match=r"holds 6 items but the last level has width 4"):
        rq_kmeans(x, levels=2, width=4, key=jax.random.key(0), iters=2)


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
