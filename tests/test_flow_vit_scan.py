"""The ViT encoder's blocks as one scan (``ViTConfig.scan_layers``) == the Python layer loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.flow.vit import ViTConfig, ViTEncoder

CFG = ViTConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, out_dim=8, max_grid=4)


def _inputs():
    patches = jax.random.normal(jax.random.key(1), (2, CFG.row_len, CFG.patch_dim))
    seg = np.zeros((2, CFG.row_len), np.int32)
    seg[0, :4], seg[0, 4:13], seg[1, :16] = 1, 2, 3  # two images in row 0, one in row 1
    rows, cols = np.divmod(np.tile(np.arange(CFG.row_len), (2, 1)), CFG.max_grid)
    return patches, jnp.asarray(seg), jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32)


def _pair(cfg):
    """The same weights (same seed) as a layer loop and as a scan."""
    return (ViTEncoder(cfg, rngs=nnx.Rngs(0)),
            ViTEncoder(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0)))


def test_scanned_vit_forward_equals_the_layer_loop_bitwise():
    """Packed rows: the same output bits, and the scan lowers to one loop over the layers."""
    loop, scanned = _pair(CFG)
    args = _inputs()

    def forward(enc):
        return enc(*args)

    np.testing.assert_array_equal(nnx.jit(forward)(loop), nnx.jit(forward)(scanned))
    assert "stablehlo.while" in nnx.jit(forward).lower(scanned).as_text()
    assert "stablehlo.while" not in nnx.jit(forward).lower(loop).as_text()


def test_scanned_remat_vit_gradients_equal_the_layer_loop_bitwise():
    """With remat (as the full variant runs): the loss and every gradient leaf bit-identical."""
    loop, scanned = _pair(dataclasses.replace(CFG, remat=True))
    args = _inputs()

    def loss(enc):
        return (enc(*args) ** 2).mean()

    (a, ga), (b, gb) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (loop, scanned))
    assert np.asarray(a) == np.asarray(b)
    leaves_a, leaves_b = jax.tree.leaves(ga), jax.tree.leaves(gb)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)
