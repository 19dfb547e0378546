"""Pallas fused_logprobs (interpret mode, small grids) == fused_logprobs_reference.

Both kernel layouts run: "tpu" (grid over row blocks x vocab tiles, scratch accumulators) and
"gpu" (Triton-style programs with in-kernel vocab and hidden-chunk loops).
Tolerance table (max|a - b| <= tol * max(1, max|b|)): the kernel reorders the vocab sums,
so f32 gets 1e-5; bf16 inputs (f32 accumulation, bf16 gradients) get 1e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fused_logprobs import (
    FusedLogprobsBlockSizes,
    fused_logprobs,
    fused_logprobs_reference,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# N = 12 rows in one padded 16-row block; V = 300: 3 vocab tiles of 128 on the TPU layout
# (ragged last tile), 5 of 64 on the GPU layout with d = 16 in two chunks of 8.
LAYOUTS = {
    "tpu": FusedLogprobsBlockSizes(block_n=16, block_v=128, block_n_dw=16, block_v_dw=128),
    "gpu": FusedLogprobsBlockSizes(platform="gpu", block_n=16, block_v=64, block_n_dw=16,
                                   block_v_dw=64, block_d=8),
}


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    err = np.max(np.abs(a - b))
    assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


def _inputs(dtype, B=2, T=6, d=16, V=300, K=3):
    k = jax.random.split(jax.random.key(1), 4)
    h = jax.random.normal(k[0], (B, T, d), dtype)
    w = (0.5 * jax.random.normal(k[1], (d, V))).astype(dtype)
    t = jax.random.randint(k[2], (B, T), 0, V)
    ki = jax.random.randint(k[3], (B, T, K), 0, V)
    return h, w, t, ki


def test_block_sizes_default_fits_tpu_budget():
    from pallas_kernels.fused_logprobs import (
        TPU_BLOCK_BUDGET,
        tpu_dh_bytes,
        tpu_dw_bytes,
        tpu_forward_bytes,
    )
    for d in (1024, 4096, 8192):
        b = FusedLogprobsBlockSizes.get_default("tpu", d=d, dtype=jnp.bfloat16, num_ids=101)
        assert b.platform == "tpu"
        assert tpu_forward_bytes(b.block_n, b.block_v, d, 2, 128) <= TPU_BLOCK_BUDGET
        assert tpu_dh_bytes(b.block_n, b.block_v, d, 2, 128) <= TPU_BLOCK_BUDGET
        assert tpu_dw_bytes(b.block_n_dw, b.block_v_dw, d, 2, 128) <= TPU_BLOCK_BUDGET
    assert FusedLogprobsBlockSizes.get_default("gpu").platform == "gpu"
    with pytest.raises(ValueError, match="power of two"):
        FusedLogprobsBlockSizes(block_n=12)


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference_forward(dtype, layout):
    h, w, t, ki = _inputs(dtype)
    kw = dict(own_topk=5, temperature=0.7)
    out = fused_logprobs(h, w, t, ki, block_sizes=LAYOUTS[layout], interpret=True, **kw)
    ref = fused_logprobs_reference(h, w, t, ki, **kw)
    tol = TOL[dtype]
    _close(out.target_logp, ref.target_logp, tol)
    _close(out.topk_logp, ref.topk_logp, tol)
    _close(out.own_topk_logp, ref.own_topk_logp, tol)
    if dtype == jnp.float32:  # no near-ties at f32 with these inputs
        np.testing.assert_array_equal(np.asarray(out.own_topk_indices),
                                      np.asarray(ref.own_topk_indices))


@pytest.mark.parametrize("layout,with_topk", [("tpu", True), ("tpu", False), ("gpu", True)])
def test_kernel_matches_reference_gradients(layout, with_topk):
    h, w, t, ki = _inputs(jnp.float32)
    ki = ki if with_topk else None

    def loss(fn, **kw):
        def f(h, w):
            out = fn(h, w, t, ki, temperature=0.7, **kw)
            val = jnp.sum(jnp.sin(jnp.arange(t.size, dtype=jnp.float32)).reshape(t.shape)
                          * out.target_logp)
            if ki is not None:
                val += jnp.sum(jnp.cos(jnp.arange(ki.size, dtype=jnp.float32)).reshape(ki.shape)
                               * out.topk_logp)
            return val
        return jax.grad(f, (0, 1))(h, w)

    g_kernel = loss(fused_logprobs, block_sizes=LAYOUTS[layout], interpret=True)
    g_ref = loss(fused_logprobs_reference)
    for a, b in zip(g_kernel, g_ref):
        assert np.max(np.abs(np.asarray(b))) > 0.1
        _close(a, b, TOL[jnp.float32])


def test_wrapper_validates_shapes():
    h, w, t, ki = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="must equal head's first dim"):
        fused_logprobs(h, w[:4], t, interpret=True)
    with pytest.raises(ValueError, match="topk_indices shape"):
        fused_logprobs(h, w, t, ki[..., 0], interpret=True)
