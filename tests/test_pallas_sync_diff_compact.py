"""sync_diff_compact kernel == reference (interpret mode, small grids)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sync_diff_compact import BlockSizes, diff_compact, diff_compact_reference


def _bits(n, changes, seed=0):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old.copy()
    where = rng.choice(n, changes, replace=False)
    new[where] ^= rng.integers(1, 1 << 16, changes, dtype=np.uint16)
    new[where[: changes // 2]] = 0x7FC1  # NaN payloads still compare as bits
    old[where[: changes // 2]] = 0xFFC1
    return jnp.asarray(old), jnp.asarray(new), np.sort(where)


# One shape (300 elements: a ragged last block; capacity 64) so the cases share a compile.
@pytest.mark.parametrize("n,changes,capacity", [
    (300, 37, 64),   # some changed
    (300, 0, 64),    # nothing changed
    (300, 300, 64),  # everything changed; capacity below the count: first 64, count 300
    (300, 64, 64),   # exactly full
])
def test_kernel_matches_reference(n, changes, capacity):
    old, new, where = _bits(n, changes)
    got = diff_compact(old, new, capacity=capacity, block_sizes=BlockSizes(128), interpret=True)
    want = diff_compact_reference(old, new, capacity=capacity)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert int(got[0]) == changes
    k = min(changes, capacity)
    np.testing.assert_array_equal(np.asarray(got[1])[:k], where[:k])
    np.testing.assert_array_equal(np.asarray(got[3])[:k], np.asarray(new)[where[:k]])


def test_rejects_bad_inputs():
    old, new, _ = _bits(64, 3)
    with pytest.raises(ValueError, match="uint16"):
        diff_compact(old.astype(jnp.int32), new.astype(jnp.int32), capacity=4, interpret=True)
    with pytest.raises(ValueError, match="equal 1-D"):
        diff_compact(old, new[:10], capacity=4, interpret=True)
