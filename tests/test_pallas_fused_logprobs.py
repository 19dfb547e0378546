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
# (a ragged last tile of 44 columns), 5 of 64 on the GPU layout (ragged: 44) with d = 16 in
# two chunks of 8. The head is not padded, so interpret mode fills the ragged tile's
# columns >= V with NaN: a gradient that reads them unmasked is NaN.
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


def test_block_sizes_per_chip_follow_the_compiled_table():
    """Each chip's TPU blocks carry a VMEM limit of at least 1.25x every kernel's compiled
    need and at most 3/4 of the core's VMEM; chip=None takes v5p's blocks (the smallest core)
    with the largest limit any chip needs; GPU chips, unknown chips and sizes outside the
    compiled range are handled."""
    from pallas_kernels import fused_logprobs_blocks as flb
    mib = 2**20
    for dtype in (jnp.bfloat16, jnp.float32):
        dname = jnp.dtype(dtype).name
        for d in (1024, 4096, 8192):
            row = 4096 if d <= 4096 else 8192
            any_b = FusedLogprobsBlockSizes.get_default("tpu", d=d, dtype=dtype, num_ids=101)
            v5p = FusedLogprobsBlockSizes.get_default("tpu", d=d, dtype=dtype, num_ids=101,
                                                      chip="v5p")
            assert (any_b.block_n, any_b.block_v, any_b.block_n_dw, any_b.block_v_dw) == (
                v5p.block_n, v5p.block_v, v5p.block_n_dw, v5p.block_v_dw)
            for chip in flb.TPU_CHIPS:
                b = FusedLogprobsBlockSizes.get_default("tpu", d=d, dtype=dtype, num_ids=101,
                                                        chip=chip)
                blocks = (b.block_n, b.block_v, b.block_n_dw, b.block_v_dw)
                needs = flb._table_needs(chip, dname, row, blocks)
                assert None not in needs, (chip, dname, row, blocks)  # every kernel measured
                assert b.platform == "tpu" and b.vmem_limit_bytes >= 1.25 * max(needs) * mib
                assert b.vmem_limit_bytes <= 0.75 * flb.VMEM_PER_CORE[chip]
                assert any_b.vmem_limit_bytes >= b.vmem_limit_bytes or blocks != (
                    any_b.block_n, any_b.block_v, any_b.block_n_dw, any_b.block_v_dw)
                assert any_b.vmem_limit_bytes <= 0.75 * flb.VMEM_PER_CORE[chip]
    # outside the compiled range: the smallest blocks, 3/4 of the (smallest) core's VMEM
    beyond = FusedLogprobsBlockSizes.get_default("tpu", d=16384, dtype=jnp.bfloat16)
    assert beyond.vmem_limit_bytes == 48 * mib and beyond.block_v_dw == 128
    wide = FusedLogprobsBlockSizes.get_default("tpu", d=4096, num_ids=200, chip="v6e")
    assert wide.vmem_limit_bytes == 96 * mib
    for chip in ("h100", "h200", None):
        assert FusedLogprobsBlockSizes.get_default("gpu", chip=chip).platform == "gpu"
    with pytest.raises(ValueError, match="chip 'h100' for platform 'tpu'"):
        FusedLogprobsBlockSizes.get_default("tpu", chip="h100")
    with pytest.raises(ValueError, match="power of two"):
        FusedLogprobsBlockSizes(block_n=12)


@pytest.mark.parametrize("chip", [None, "v5e", "v5p", "v6e"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_blocks_past_the_measured_rows_shrink_to_fit_the_vmem(chip, dtype):
    """d 16,384 (a Llama-3-405B head): the widest row's blocks, halved until its measured
    needs scaled by d x (rows + columns), x 1.25, fit 3/4 of the core's VMEM (or the smallest
    blocks, 32 rows x 128 columns, are reached); never larger than the d 8,192 row's."""
    from pallas_kernels import fused_logprobs_blocks as flb
    b = flb.tpu_choice(chip, dtype, 16384, 101)
    row = flb.tpu_choice(chip, dtype, 8192, 101)
    keys = ("block_n", "block_v", "block_n_dw", "block_v_dw")
    new, old = tuple(b[k] for k in keys), tuple(row[k] for k in keys)
    assert all(n <= o for n, o in zip(new, old)) and min(new[1], new[3]) >= 128
    needs = flb._table_needs(chip or "v5p", dtype, 8192, old)
    scaled = [need * 2 * (n + v) / (n0 + v0) for need, (n, v), (n0, v0) in
              zip(needs, (new[:2], new[:2], new[2:]), (old[:2], old[:2], old[2:]))]
    smallest = new == (32, 128, 32, 128)  # f32: left to the compiler (the sweep compiles it)
    assert smallest or 1.25 * max(scaled) * 2**20 <= b["vmem_limit_bytes"]
    assert b["vmem_limit_bytes"] == 3 * min(
        flb.VMEM_PER_CORE[c] for c in ((chip,) if chip else flb.TPU_CHIPS)) // 4
    if chip in (None, "v5p") and dtype == "bfloat16":  # 49.25 MiB > 48 with the 8,192 blocks
        assert new != old


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its params (not inside kernels)."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name == "pallas_call":
            continue
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
def test_head_is_not_padded_or_copied(layout):
    """Forward and gradient programs (ragged V = 300) never pad, concatenate or update W:
    the kernels read the head itself, and every pallas_call carries a cost estimate
    (2 N d V flops per matmul, N V exps)."""
    h, w, t, ki = _inputs(jnp.float32)

    def grads(h, w):
        def f(h, w):
            out = fused_logprobs(h, w, t, ki, own_topk=5, block_sizes=LAYOUTS[layout],
                                 interpret=True)
            return jnp.sum(out.target_logp) + jnp.sum(out.topk_logp)
        return jax.grad(f, (0, 1))(h, w)

    eqns = list(_eqns(jax.make_jaxpr(grads)(h, w).jaxpr))
    copies = {"pad", "concatenate", "dynamic_update_slice", "scatter"}
    bad = [e.primitive.name for e in eqns if e.primitive.name in copies
           and any(getattr(v.aval, "shape", None) == w.shape for v in e.invars)]
    assert not bad, bad
    calls = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 3  # forward, dh, dW
    n, v = 16, w.shape[1]  # 12 rows padded to one 16-row block
    for e, matmuls in zip(calls, (1, 2, 2)):
        cost = e.params["cost_estimate"]
        assert cost.flops == 2 * matmuls * n * w.shape[0] * v
        assert cost.transcendentals == n * v and cost.bytes_accessed > w.size * 4


def test_own_topk_over_a_ragged_remainder_tile():
    """The own top-K' pass over 128-wide tiles of V = 300 (a 44-wide remainder) equals
    lax.top_k of the log-softmax, with no padded copy of W."""
    from pallas_kernels.fused_logprobs import _own_topk
    h, w, _, _ = _inputs(jnp.float32)
    h = h.reshape(-1, h.shape[-1])
    logits = jnp.dot(h, w) / 0.7
    lse = jax.nn.logsumexp(logits, axis=1)
    vals, idx = _own_topk(h, w, lse, 7, 0.7, tile=128)
    ref_v, ref_i = jax.lax.top_k(logits - lse[:, None], 7)
    _close(vals, ref_v, TOL[jnp.float32])
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_i))
    eqns = _eqns(jax.make_jaxpr(lambda w: _own_topk(h, w, lse, 7, 0.7, tile=128))(w).jaxpr)
    assert not [e for e in eqns if e.primitive.name == "pad"]


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
        assert np.isfinite(np.asarray(a)).all()  # the ragged tile's NaN columns are masked
        assert np.max(np.abs(np.asarray(b))) > 0.1
        _close(a, b, TOL[jnp.float32])


def test_wrapper_validates_shapes():
    h, w, t, ki = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="must equal head's first dim"):
        fused_logprobs(h, w[:4], t, interpret=True)
    with pytest.raises(ValueError, match="topk_indices shape"):
        fused_logprobs(h, w, t, ki[..., 0], interpret=True)
