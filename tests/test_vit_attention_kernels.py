"""Bidirectional (``causal=False``) segment attention on the kernels == the XLA reference, and
the ViT encoder on it == its former dense-mask path.

Splash (TPU) and Pallas flash (GPU) run in Pallas interpret mode on the packed rows of
``tests/test_attention_backends.py`` (three images and padding in one row, two in the other;
GQA 4 / 2 heads; T 60, padded by the wrappers to 64 / 128 tokens), forward and gradient, at
its f32 tolerances. Padding queries are meaningless in every backend: outputs are compared on
real tokens, but every output and gradient must be finite (a fully masked row gives NaN in
some kernels, and NaN gradients even where its output is unused).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.flow.vit import ViTConfig, ViTEncoder
from jaxflow.models import attention_backends as ab
from jaxflow.models.attention import dot_product_attention
from tests.test_attention_backends import SEGMENTS, TOL, B, D, H, K, T, _out_and_grads

REAL = SEGMENTS > 0


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(7)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D)))
    ct = ct * REAL[:, :, None, None]  # the loss reads real tokens only
    return q, k, v, jnp.asarray(SEGMENTS), ct


def _bidirectional_reference(q, k, v, seg):
    """Written out here, not taken from the library: same segment, key not padding."""
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
    return dot_product_attention(q, k, v, mask)


def test_segment_mask_non_causal_is_same_segment_and_real_key():
    seg = jnp.asarray([[1, 1, 2, 0]])
    want = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(ab.segment_mask(seg, causal=False)[0], want)
    np.testing.assert_array_equal(ab.segment_mask(seg)[0], np.tril(want))


@pytest.fixture(scope="module")
def reference(qkv):
    """(bidirectional reference: output, grads), the library's xla output, the causal one."""
    def fn(q, k, v, s, c):
        return (_out_and_grads(_bidirectional_reference, q, k, v, s, c),
                ab.attention(q, k, v, s, backend="xla", causal=False),
                ab.attention(q, k, v, s, backend="xla"))

    return jax.jit(fn)(*qkv)


@pytest.mark.parametrize("backend", ["splash", "flash"])
def test_non_causal_kernel_matches_xla_forward_and_gradient_interpret(backend, qkv, reference):
    q, k, v, seg, ct = qkv
    (ref_out, ref_grads), xla_out, causal = reference
    np.testing.assert_array_equal(xla_out, ref_out)  # the library's xla path is the reference
    fn = jax.jit(lambda q, k, v, s, c: _out_and_grads(
        lambda q, k, v, s: ab.attention(q, k, v, s, backend=backend, interpret=True,
                                        causal=False), q, k, v, s, c))
    out, grads = fn(q, k, v, seg, ct)
    assert out.shape == (B, T, H, D) and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out)[REAL], np.asarray(ref_out)[REAL], **TOL)
    assert np.all(np.isfinite(np.asarray(out)))  # padding rows too
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name
        assert np.all(np.isfinite(np.asarray(g))), f"d{name} not finite"
        np.testing.assert_allclose(g, r, err_msg=f"d{name}", **TOL)
    # and it is not the causal kernel: a real token early in its segment sees later ones
    assert not np.allclose(np.asarray(causal)[REAL], np.asarray(out)[REAL], **TOL)


VIT = ViTConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, out_dim=16, max_grid=5)


@pytest.fixture(scope="module")
def encoder():
    """(graphdef, params) of a ViT encoder, params drawn on the host (N(0, 0.25^2): XLA:CPU
    takes seconds to compile the encoder's own random init)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: ViTEncoder(VIT, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return graphdef, jax.tree.map(
        lambda a: jnp.asarray(0.25 * rng.standard_normal(a.shape), a.dtype), abstract)


def _patch_rows():
    """Two rows of 25 slots: images of 9, 4 and 9 patches then 3 empty slots; 16 + 1 patches
    then 8 empty slots."""
    counts = ((9, 4, 9), (16, 1))
    seg, rows, cols = (np.zeros((2, VIT.row_len), np.int32) for _ in range(3))
    for r, images in enumerate(counts):
        c = 0
        for i, n in enumerate(images):
            seg[r, c:c + n] = i + 1
            rows[r, c:c + n], cols[r, c:c + n] = np.divmod(np.arange(n), int(np.sqrt(n)))
            c += n
    patches = jax.random.normal(jax.random.key(3), (2, VIT.row_len, VIT.patch_dim))
    return patches, jnp.asarray(seg), jnp.asarray(rows), jnp.asarray(cols)


def _dense_mask_encoder(enc: ViTEncoder, patches, seg, rows, cols):
    """The encoder as it ran before its blocks went through the attention switch: each block
    under an explicit [R, L, L] bidirectional segment mask (``Block.__call__``)."""
    x = patches @ enc.patch_embed[...]
    x = x + enc.row_embed[...][rows] + enc.col_embed[...][cols]
    x = x.astype(enc.config.block_config().compute_dtype)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
    positions = rows * enc.config.max_grid + cols
    for block in enc.blocks:
        x = block(x, positions, mask)
    x = enc.norm(x)
    return jax.nn.gelu(x @ enc.proj_in[...]) @ enc.proj_out[...]


def test_vit_encoder_on_xla_equals_the_dense_mask_path(encoder):
    graphdef, params = encoder
    args = _patch_rows()
    real = np.asarray(args[1]) > 0

    def outputs(params, *args):
        enc = nnx.merge(graphdef, params)
        return (enc(*args, attention="xla"), enc(*args, attention="auto"),  # auto: CPU -> xla
                _dense_mask_encoder(enc, *args))

    new, auto, old = jax.jit(outputs)(params, *args)
    np.testing.assert_array_equal(np.asarray(new)[real], np.asarray(old)[real])
    np.testing.assert_array_equal(auto, new)


def test_vit_encoder_on_flash_kernel_matches_xla_interpret(encoder):
    """The encoder's blocks through the (interpret) Triton kernel, bidirectional: the output
    on real patches == XLA's, finite everywhere (the kernel's gradients: the tests above)."""
    graphdef, params = encoder
    patches, seg, rows, cols = _patch_rows()

    def run(params, backend, interpret):
        return nnx.merge(graphdef, params)(patches, seg, rows, cols, attention=backend,
                                           interpret=interpret)

    ref, out = jax.jit(lambda p: (run(p, "xla", False), run(p, "flash", True)))(params)
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], **TOL)
    assert np.all(np.isfinite(np.asarray(out)))
