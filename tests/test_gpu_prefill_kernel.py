"""The GPU prefill kernel (Pallas, Triton) in interpret mode == the engine's XLA prefill attention.

``gpu_prefill_attention`` reads each row's pages through the table inside the kernel, folds the
GQA heads into its query block and stops its key loop at the block's last real query; it must
give ``xla_prefill_attention`` (the pages gathered into a contiguous cache, masked by slot <=
position) on every real query, and zeros on padding queries. Tolerances per dtype (rtol, atol):
f32 (1e-5, 1e-6): online vs one-pass softmax over logits up to ~10, whose exp carries a few ulp
of the logit (on the long case both are as far from a float64 reference: kernel 6.9e-7, xla
9.7e-7; from each other 1.3e-6 at 0.19); bf16 (1e-2, 1e-2): bf16 rounding of the
probabilities and the output. The compile gate (``tests/aot/test_gpu_prefill_gate.py``)
compiles the kernel with Triton for H100.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rollout import prefill_attention as pf
from jaxflow.rollout.gpu_prefill_kernel import GpuPrefillBlockSizes, gpu_prefill_attention
from pallas_kernels import dispatch

TOL = {jnp.float32: (1e-5, 1e-6), jnp.bfloat16: (1e-2, 1e-2)}  # (rtol, atol)
SMALL = GpuPrefillBlockSizes(block_q=16, block_k=16)  # several query and key blocks per row


def _problem(dtype, *, r=4, c=6, h=4, kvh=2, d=16, s=4, w=5, start=(0, 5, 13, 2),
             n_valid=(6, 3, 1, 0), pool=32, seed=0):
    """A full chunk at 0, a partial one at 5, one token at 13, a padding row (n_valid 0)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(r, c, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(kvh, pool, s, d)) * 3, dtype)
    v = jnp.asarray(rng.normal(size=(kvh, pool, s, d)), dtype)
    table = jnp.asarray(rng.permutation(pool)[: r * w].reshape(r, w), jnp.int32)
    return q, k, v, table, jnp.asarray(start, jnp.int32), jnp.asarray(n_valid, jnp.int32)


def _assert_matches(got, args, dtype):
    """Real queries == the xla reference within the dtype's tolerance; padding queries 0."""
    want = np.asarray(pf.xla_prefill_attention(*args), np.float32)
    got = np.asarray(got, np.float32)
    c, n_valid = args[0].shape[1], np.asarray(args[5])
    real = np.arange(c)[None, :] < n_valid[:, None]
    assert got.shape == want.shape and np.abs(want[real]).max() > 0.1
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got[real], want[real], rtol=rtol, atol=atol)
    np.testing.assert_array_equal(got[~real], 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_xla_prefill_attention(dtype):
    args = _problem(dtype)
    got = gpu_prefill_attention(*args, interpret=True)
    assert got.dtype == dtype
    _assert_matches(got, args, dtype)
    # the public entry point with backend "gpu" in interpret mode is this kernel
    routed = pf.prefill_attention(*args, backend="gpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(routed), np.asarray(got))


def test_long_chunks_over_many_key_blocks_and_odd_groups():
    """A 20-token chunk per row at offsets up to 30, 3 query heads per K/V head (padded to 4 in
    the kernel), tiles of 16: several query blocks per row, key loops of 1 to 4 blocks, a
    page table whose width (9) is not a multiple of the 4 pages per block."""
    args = _problem(jnp.float32, c=20, h=6, kvh=2, w=13, start=(30, 0, 7, 12),
                    n_valid=(20, 17, 5, 0), pool=64, seed=1)
    got = gpu_prefill_attention(*args, block_sizes=SMALL, interpret=True)
    _assert_matches(got, args, jnp.float32)
    # the kernel reads positions: the same queries one slot later attend differently
    q, k, v, table, start, n_valid = args
    shifted = np.asarray(gpu_prefill_attention(q, k, v, table, start + 1, n_valid,
                                               block_sizes=SMALL, interpret=True))
    assert np.abs(shifted[0, :20] - np.asarray(got)[0, :20]).max() > 1e-3


def test_pools_stored_padded_give_the_unpadded_result():
    """The padded layout (a head_dim-64 pool stored in 128 lanes, zeros past 64): the kernel
    takes q's true D and returns it."""
    q, k, v, table, start, n_valid = _problem(jnp.float32, d=64, seed=2)
    pad = functools.partial(jnp.pad, pad_width=[(0, 0)] * 3 + [(0, 64)])
    got = gpu_prefill_attention(q, pad(k), pad(v), table, start, n_valid, interpret=True)
    assert got.shape == q.shape
    _assert_matches(got, (q, k, v, table, start, n_valid), jnp.float32)


def test_under_a_mesh_the_kernel_runs_per_head_shard():
    """Under ``jax.set_mesh`` (a "model" axis of 2) the kernel runs in a shard_map over heads."""
    args = _problem(jnp.float32, seed=3)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("model",))
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda *a: pf.prefill_attention(*a, backend="gpu", interpret=True))
        text = fn.lower(*args).as_text()
        got = fn(*args)
    assert "shard_map" in text or "manual" in text
    _assert_matches(got, args, jnp.float32)


def test_gpu_dispatch_falls_back_with_one_warning_and_records_it(monkeypatch):
    """On GPU (the platform patched), shapes the kernel cannot take: auto warns once, records
    the fall-back for the compile report and runs xla; the kernel named raises."""
    q, k, v, table, start, n_valid = _problem(jnp.float32, s=6, seed=4)  # pages of 6 tokens
    monkeypatch.setattr(dispatch, "backend_platform", lambda: "gpu")
    dispatch.clear_cache()
    with dispatch.recording_fallbacks() as log, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            assert pf.choose_prefill_backend(q, k, v, table, start, n_valid) == "xla"
    assert [x["kernel"] for x in log] == [pf.GPU_KERNEL] * 2
    assert "page size 6 is not a power of 2" in log[0]["reason"]
    assert len([w for w in seen if pf.GPU_KERNEL in str(w.message)]) == 1
    with pytest.raises(dispatch.KernelUnavailable, match="page size 6 is not a power of 2"):
        pf.choose_prefill_backend(q, k, v, table, start, n_valid, backend="gpu")
    with pytest.raises(ValueError, match="runs on tpu only"):
        pf.choose_prefill_backend(q, k, v, table, start, n_valid, backend="tpu")


def test_bad_shapes_and_blocks_are_named():
    q, k, v, table, start, n_valid = _problem(jnp.float32, s=6)
    with pytest.raises(ValueError, match=r"page size 6 is not a power of 2"):
        gpu_prefill_attention(q, k, v, table, start, n_valid, interpret=True)
    with pytest.raises(ValueError, match=r"start \(3,\), n_valid \(4,\): need q \[R, C, H, D\]"):
        gpu_prefill_attention(q, k[:, :, :4], v[:, :, :4], table, start[:3], n_valid,
                              interpret=True)
    with pytest.raises(ValueError, match=r"block_q=48; valid: a power of 2 >= 16"):
        GpuPrefillBlockSizes(block_q=48)
    with pytest.raises(ValueError, match="runs on gpu only"):  # off GPU, not interpreted
        pf.prefill_attention(q, k, v, table, start, n_valid, backend="gpu")

