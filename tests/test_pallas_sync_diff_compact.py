"""sync_diff_compact kernel == reference (interpret mode, small grids, both layouts).

5,000 elements in tiles of 16 x 128 = 2,048: three tiles, the last one ragged."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sync_diff_compact import (
    BlockSizes,
    diff_compact,
    diff_compact_reference,
)


def _bits(n, changes, seed=0):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old.copy()
    where = rng.choice(n, changes, replace=False)
    new[where] ^= rng.integers(1, 1 << 16, changes, dtype=np.uint16)
    new[where[: changes // 2]] = 0x7FC1  # NaN payloads still compare as bits
    old[where[: changes // 2]] = 0xFFC1
    return jnp.asarray(old), jnp.asarray(new), np.sort(where)


LAYOUTS = {"tpu": BlockSizes(16), "gpu": BlockSizes(16, platform="gpu")}


# One shape (ragged last tile; capacity 256) so the cases share a compile per layout.
@pytest.mark.parametrize("layout", ["tpu", "gpu"])
@pytest.mark.parametrize("n,changes,capacity", [
    (5000, 137, 256),   # some changed, in every tile
    (5000, 0, 256),     # nothing changed
    (5000, 5000, 256),  # everything changed; capacity below the count: first 256, count 5000
    (5000, 256, 256),   # exactly full
])
def test_kernel_matches_reference(n, changes, capacity, layout):
    old, new, where = _bits(n, changes)
    got = diff_compact(old, new, capacity=capacity, block_sizes=LAYOUTS[layout],
                       interpret=True)
    want = diff_compact_reference(old, new, capacity=capacity)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert int(got[0]) == changes
    k = min(changes, capacity)
    np.testing.assert_array_equal(np.asarray(got[1])[:k], where[:k])
    np.testing.assert_array_equal(np.asarray(got[3])[:k], np.asarray(new)[where[:k]])


def test_tile_ranks_without_cumsum():
    from pallas_kernels.sync_diff_compact import tile_ranks

    changed = (np.random.default_rng(3).random((32, 128)) < 0.3).astype(np.float32)
    want = np.where(changed > 0, np.cumsum(changed.reshape(-1)).reshape(32, 128) - 1, -1)
    np.testing.assert_array_equal(np.asarray(tile_ranks(jnp.asarray(changed))), want)
    with pytest.raises(ValueError, match="block_rows=24"):
        BlockSizes(24, platform="gpu")


def test_rejects_bad_inputs():
    old, new, _ = _bits(64, 3)
    with pytest.raises(ValueError, match="uint16"):
        diff_compact(old.astype(jnp.int32), new.astype(jnp.int32), capacity=4, interpret=True)
    with pytest.raises(ValueError, match="equal 1-D"):
        diff_compact(old, new[:10], capacity=4, interpret=True)
