"""sync_scatter_apply kernel == reference (interpret mode, small grids, both layouts).

5,000 elements in tiles of 16 x 128: three tiles, the last ragged; up to 300 updates are
three 128-update chunks, the last partial."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sync_scatter_apply import (
    BlockSizes,
    scatter_apply,
    scatter_apply_reference,
)

LAYOUTS = {"tpu": BlockSizes(16), "gpu": BlockSizes(16, platform="gpu")}


# One shape so the cases share a compile per layout: some, none, capacity-full.
@pytest.mark.parametrize("layout", ["tpu", "gpu"])
@pytest.mark.parametrize("n,changes,capacity", [(5000, 137, 300), (5000, 0, 300),
                                                (5000, 300, 300)])
def test_kernel_matches_reference_and_writes_bits(n, changes, capacity, layout):
    rng = np.random.default_rng(n)
    dst = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    where = np.sort(rng.choice(n, changes, replace=False)).astype(np.int32)
    values = rng.integers(0, 1 << 16, changes, dtype=np.uint16)
    values[: changes // 3] = 0x7FC1  # NaN payload bits must land unchanged
    positions = np.full(capacity, -1, np.int32)
    positions[:changes] = where
    padded_values = np.zeros(capacity, np.uint16)
    padded_values[:changes] = values
    want = scatter_apply_reference(jnp.asarray(dst), jnp.asarray(positions),
                                   jnp.asarray(padded_values))
    got = scatter_apply(jnp.asarray(dst), jnp.asarray(positions), jnp.asarray(padded_values),
                        block_sizes=LAYOUTS[layout], interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    expected = dst.copy()
    expected[where] = values
    np.testing.assert_array_equal(np.asarray(want), expected)


def test_rejects_bad_inputs():
    dst = jnp.zeros(16, jnp.uint16)
    with pytest.raises(ValueError, match="int32 positions"):
        scatter_apply(dst, jnp.zeros(4, jnp.uint32),
                      jnp.zeros(4, jnp.uint16), interpret=True)
    with pytest.raises(ValueError, match="uint16"):
        scatter_apply(dst.astype(jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.uint16),
                      interpret=True)
