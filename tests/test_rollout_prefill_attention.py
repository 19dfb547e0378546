"""The engine's prefill attention: the ragged-kernel route == the engine's XLA attention.

``ragged_prefill_attention`` packs each row's real tokens back to back and gathers the pages
the chunk reads into a combined pool with a renumbered table; run through the ragged op's XLA
reference (the TPU kernel itself does not run in jax 0.10.2's TPU interpreter; the gate compiles
it), it must give the engine's own prefill attention (``xla_prefill_attention``: the contiguous
cache gathered from the pages, masked by slot <= position) on every real token. f32, atol 1e-6:
the same per-token logits and softmax over the same W * S slots (seen: 0, bit for bit).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rollout import prefill_attention as pf

R, C, H, KVH, D = 4, 6, 4, 2, 16
S, W, POOL = 4, 5, 32  # page size, table width, pages in the pool
START = np.array([0, 5, 13, 2], np.int32)
N_VALID = np.array([6, 3, 1, 0], np.int32)  # a full chunk, a partial one, one token, none


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(R, C, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(KVH, POOL, S, D)) * 3, jnp.float32)  # finite garbage too
    v = jnp.asarray(rng.normal(size=(KVH, POOL, S, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(POOL)[: R * W].reshape(R, W), jnp.int32)
    return q, k, v, table, jnp.asarray(START), jnp.asarray(N_VALID)


def test_ragged_route_equals_the_engine_attention_on_real_tokens():
    q, k, v, table, start, n_valid = _problem()
    want = np.asarray(pf.xla_prefill_attention(q, k, v, table, start, n_valid))
    got = np.asarray(pf.ragged_prefill_attention(q, k, v, table, start, n_valid, backend="xla"))
    assert got.shape == want.shape == (R, C, H, D)
    real = np.arange(C)[None, :] < N_VALID[:, None]
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got[~real], 0.0)  # padding queries: zeros
    # a wrong start (one position later) is seen: the route is not blind to positions
    shifted = np.asarray(pf.ragged_prefill_attention(q, k, v, table, start + 1, n_valid,
                                                     backend="xla"))
    assert np.abs(shifted[real] - want[real]).max() > 1e-3


def test_auto_on_cpu_is_the_xla_arithmetic_and_bad_input_is_named():
    q, k, v, table, start, n_valid = _problem(1)
    want = np.asarray(pf.xla_prefill_attention(q, k, v, table, start, n_valid))
    for backend in ("auto", "xla"):
        got = pf.prefill_attention(q, k, v, table, start, n_valid, backend=backend)
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="prefill attention backend 'flash'; valid: auto"):
        pf.prefill_attention(q, k, v, table, start, n_valid, backend="flash")
    with pytest.raises(ValueError, match=r"q \[R, C, H, D\] and page_table \[R, W\]"):
        pf.prefill_attention(q[0], k, v, table, start, n_valid)
    for kernel in ("tpu", "gpu"):  # a kernel off its platform (gpu: tests/test_gpu_prefill_kernel.py)
        with pytest.raises(ValueError, match=f"runs on {kernel} only"):
            pf.prefill_attention(q, k, v, table, start, n_valid, backend=kernel)


def test_pools_stored_padded_give_the_unpadded_result():
    """The engine's padded layout (pools of 128 lanes, zeros past D): the xla attention and the
    ragged route (through the ragged xla reference) return what they return on the unpadded
    pools, bit for bit (both cut the zero lanes before any arithmetic)."""
    q, k, v, table, start, n_valid = _problem(2)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, 128 - D)])  # noqa: E731
    for fn in (pf.xla_prefill_attention,
               lambda *a: pf.ragged_prefill_attention(*a, backend="xla")):
        want = np.asarray(fn(q, k, v, table, start, n_valid))
        got = np.asarray(fn(q, pad(k), pad(v), table, start, n_valid))
        assert got.shape == (R, C, H, D) and np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)
