"""The compiled vote clustering == its numpy twin (the same permutation, bit for bit)."""

import numpy as np
import pytest

from jaxflow.nestpipe import clustering


def test_compiled_vote_in_use():
    assert clustering._compiled_vote() is not None  # numba is a dependency (pyproject)


@pytest.mark.parametrize("seed", range(12))
def test_compiled_vote_matches_numpy(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    b = 64 * (1 + seed % 3)
    sparse = {f"t{i}": np.where(rng.random((b, 3)) < 0.1, -1,
                                np.minimum(rng.zipf(1.3, (b, 3)) - 1, 500))
              for i in range(1 + seed % 4)}
    for groups, n in [(1, 4), (2, 2), (4, 2), (1, 8), (8, 4)]:
        if b % (groups * n):
            continue
        compiled = clustering.cluster_groups(sparse, groups, n)
        with monkeypatch.context() as m:
            m.setattr(clustering, "_compiled_vote", lambda: None)
            reference = clustering.cluster_groups(sparse, groups, n)
        assert np.array_equal(compiled, reference), (groups, n)
        assert np.array_equal(np.sort(compiled), np.arange(b))  # a permutation
