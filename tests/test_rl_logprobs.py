"""Fused XLA log-prob path == naive reference (values and gradients), top-K, memory, errors.

Tolerance (f32): the fused path reorders the vocab sums (online logsumexp over tiles), so
values and gradients match the reference to max|a - b| <= 1e-5 * max(1, max|b|).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl import logprobs as lp

F32_TOL = 1e-5


def _close(a, b, tol=F32_TOL):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    err = np.max(np.abs(a - b))
    assert err <= tol * max(1.0, float(np.max(np.abs(b)))), err


def _inputs(B=2, T=5, d=16, V=203, K=3, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (B, T, d), dtype)
    w = (0.5 * jax.random.normal(k[1], (d, V))).astype(dtype)
    t = jax.random.randint(k[2], (B, T), 0, V)
    ki = jax.random.randint(k[3], (B, T, K), 0, V)
    return h, w, t, ki


def _loss(h, w, t, ki, **kw):
    out = lp.fused_logprobs(h, w, t, ki, **kw)
    B, T = t.shape
    wt = jnp.sin(jnp.arange(B * T, dtype=jnp.float32)).reshape(B, T)
    wk = jnp.cos(jnp.arange(out.topk_logp.size, dtype=jnp.float32)).reshape(out.topk_logp.shape)
    return jnp.sum(wt * out.target_logp) + jnp.sum(wk * out.topk_logp)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_tile", [64, 203, 4096])  # remainder tile, one tile, tile > V
def test_xla_matches_reference_values_and_grads(temperature, vocab_tile):
    h, w, t, ki = _inputs()
    fused = lp.fused_logprobs(h, w, t, ki, temperature=temperature, backend="xla",
                              vocab_tile=vocab_tile)
    ref = lp.fused_logprobs(h, w, t, ki, temperature=temperature, backend="reference")
    _close(fused.target_logp, ref.target_logp)
    _close(fused.topk_logp, ref.topk_logp)
    g_fused = jax.jit(jax.grad(lambda h, w: _loss(h, w, t, ki, temperature=temperature,
                                                   backend="xla", vocab_tile=vocab_tile),
                               (0, 1)))(h, w)
    g_ref = jax.grad(lambda h, w: _loss(h, w, t, ki, temperature=temperature,
                                        backend="reference"), (0, 1))(h, w)
    for a, b in zip(g_fused, g_ref):
        assert np.max(np.abs(np.asarray(b))) > 0.1  # a non-trivial gradient
        _close(a, b)


def test_temperature_changes_result():
    h, w, t, ki = _inputs()
    a = lp.fused_logprobs(h, w, t, ki, temperature=1.0, vocab_tile=64).target_logp
    b = lp.fused_logprobs(h, w, t, ki, temperature=0.5, vocab_tile=64).target_logp
    assert np.max(np.abs(np.asarray(a - b))) > 1e-2


def test_own_topk_matches_lax_top_k_of_full_log_softmax():
    h, w, t, _ = _inputs(V=301)
    out = lp.fused_logprobs(h, w, t, own_topk=7, temperature=0.8, vocab_tile=64)
    full = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w) / 0.8, axis=-1)
    vals, idx = jax.lax.top_k(full, 7)
    np.testing.assert_array_equal(np.asarray(out.own_topk_indices), np.asarray(idx))
    _close(out.own_topk_logp, vals)
    assert out.own_topk_indices.dtype == jnp.int32
    assert out.topk_logp is None


def test_duplicate_and_target_in_topk_indices_grads():
    h, w, t, _ = _inputs(V=150)
    ki = jnp.stack([t, t, jnp.zeros_like(t)], axis=-1)  # target twice, plus token 0
    g_fused = jax.grad(lambda h, w: _loss(h, w, t, ki, backend="xla", vocab_tile=64), (0, 1))(h, w)
    g_ref = jax.grad(lambda h, w: _loss(h, w, t, ki, backend="reference"), (0, 1))(h, w)
    for a, b in zip(g_fused, g_ref):
        _close(a, b)


def test_bf16_inputs_close_to_reference():
    h, w, t, ki = _inputs(dtype=jnp.bfloat16)
    fused = lp.fused_logprobs(h, w, t, ki, backend="xla", vocab_tile=64)
    ref = lp.fused_logprobs(h, w, t, ki, backend="reference")
    assert fused.target_logp.dtype == jnp.float32
    _close(fused.target_logp, ref.target_logp, tol=1e-2)
    g = jax.grad(lambda h, w: _loss(h, w, t, ki, backend="xla", vocab_tile=64), (0, 1))(h, w)
    assert g[0].dtype == jnp.bfloat16 and g[1].dtype == jnp.bfloat16


def test_fused_temp_bytes_far_below_naive():
    """Compiled memory analysis of value_and_grad: fused temp << naive logits buffers."""
    N, d, V, K = 512, 64, 16384, 8
    specs = (jax.ShapeDtypeStruct((N, d), jnp.float32), jax.ShapeDtypeStruct((d, V), jnp.float32),
             jax.ShapeDtypeStruct((N,), jnp.int32), jax.ShapeDtypeStruct((N, K), jnp.int32))

    def temp_bytes(**kw):
        def loss(h, w, t, ki):
            out = lp.fused_logprobs(h, w, t, ki, **kw)
            return jnp.sum(out.target_logp) + jnp.sum(out.topk_logp)
        f = jax.jit(jax.value_and_grad(loss, (0, 1)))
        return f.lower(*specs).compile().memory_analysis().temp_size_in_bytes

    fused = temp_bytes(backend="xla", vocab_tile=1024)
    naive = temp_bytes(backend="reference")
    logits_bytes = N * V * 4
    assert naive >= logits_bytes  # the naive path really holds the logits
    assert fused < logits_bytes / 4  # the fused one holds at most a few [N, tile] buffers
    assert fused * 8 <= naive


def test_errors_name_the_bad_value():
    h, w, t, ki = _inputs()
    with pytest.raises(ValueError, match="hidden's last dim 16 must equal head's first dim 8"):
        lp.fused_logprobs(h, w[:8], t)
    with pytest.raises(TypeError, match="dtype"):
        lp.fused_logprobs(h, w.astype(jnp.bfloat16), t)
    with pytest.raises(TypeError, match="integer"):
        lp.fused_logprobs(h, w, t.astype(jnp.float32))
    with pytest.raises(ValueError, match="targets shape"):
        lp.fused_logprobs(h, w, t[:, :3])
    with pytest.raises(ValueError, match="topk_indices shape"):
        lp.fused_logprobs(h, w, t, ki[:1])
    with pytest.raises(ValueError, match="own_topk"):
        lp.fused_logprobs(h, w, t, own_topk=10_000)
    with pytest.raises(ValueError, match="temperature"):
        lp.fused_logprobs(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="unknown log-prob backend 'cuda'"):
        lp.fused_logprobs(h, w, t, backend="cuda")


def test_auto_backend_on_cpu_is_xla_without_warning():
    h, w, t, ki = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lp.fused_logprobs(h, w, t, ki, vocab_tile=64)
    ref = lp.fused_logprobs_xla(h, w, t, ki, vocab_tile=64)
    np.testing.assert_array_equal(np.asarray(out.target_logp), np.asarray(ref.target_logp))


def test_bench_policy_loss_entry_tiny():
    """The experiment entry runs end to end on a tiny config and reports its summary keys."""
    import dataclasses
    import json

    from configs import bench_policy_loss as bench_cfg
    from jaxflow.experiment import standalone_context
    from jaxflow.main.bench_policy_loss import main

    with pytest.raises(ValueError, match="unknown variant 'huge'"):
        bench_cfg.get_config("huge")
    for variant in bench_cfg.VARIANTS:
        bench_cfg.get_config(variant)
    cfg = dataclasses.replace(bench_cfg.get_config("quick"), batch=2, seq_len=8, d_model=16,
                              vocab=300, topk=4, vocab_tile=64, warmup=0, pairs=2,
                              grpo_iteration=False)
    run = standalone_context("bench_policy_loss")
    summary = main(cfg, run)
    run.close()
    json.dumps(summary)
    for key in ("sis_overhead_ratio", "sis_overhead_ratio_min", "sis_overhead_ratio_max",
                "fused_temp_bytes", "naive_temp_bytes", "fused_to_naive_bytes_ratio"):
        assert key in summary, key
    assert len(summary["sis_overhead_ratios"]) == 2
    assert 0.0 <= summary["accept_rate"] <= 1.0
    assert summary["naive_temp_bytes"] >= summary["logits_bytes"]
    assert (run.out_dir / "metrics.jsonl").exists()
