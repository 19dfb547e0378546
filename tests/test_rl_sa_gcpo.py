"""SA-GCPO (OxygenREC): soft-gated policy loss, target gate on advantages, unified reward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl import (
    PolicyLossConfig,
    grpo_advantages,
    policy_loss,
    sa_gcpo_advantages,
    sapo_gate,
    unified_reward,
    zero_positive_below_target,
)


def _batch(seed, B=6, T=5):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.6, (B, T))).astype(np.float32)
    mask = rng.random((B, T)) < 0.8
    mask[:, 0] = True
    # two groups of 3 with advantages (-, +, +); rows 1 and 5 are below their targets
    rewards = np.tile(np.array([0.1, 0.6, 0.8, 0.2, 0.7, 0.9], np.float32), B // 6)
    rewards = (rewards + rng.uniform(-0.02, 0.02, B)).astype(np.float32)
    adv = np.asarray(grpo_advantages(jnp.asarray(rewards), 3))
    target = np.tile(np.array([0.5, 0.7, 0.5, 0.5, 0.5, 1.0], np.float32), B // 6)
    return logp, old, adv, mask, rewards, target


def _numpy_sa_gcpo(logp, old, adv, mask, rewards, target, tau_pos=2.0, tau_neg=5.0):
    """Direct transcription: A' = 0 where A > 0 and r < target; loss = mean_seq mean_tok
    -A' * sigmoid(tau (rho - 1)) * 4 / tau; d/dlogp = -A' * 4 s (1 - s) * rho / (n_b * B)."""
    a = np.where((adv > 0) & (rewards < target), 0.0, adv)[:, None] * np.ones_like(logp)
    rho = np.exp(np.clip(logp.astype(np.float64) - old, -20, 20))
    tau = np.where(a > 0, tau_pos, tau_neg)
    s = 1 / (1 + np.exp(-tau * (rho - 1)))
    per_token = -a * s * 4 / tau
    counts = mask.sum(1)
    loss = np.mean(np.sum(per_token * mask, 1) / counts)
    grad = -a * 4 * s * (1 - s) * rho * mask / counts[:, None] / logp.shape[0]
    return loss, grad


def _loss_grad(logp, old, adv, mask, cfg, **kw):
    def f(lp):
        return policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), config=cfg,
                           **kw)
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    return float(loss), metrics, np.asarray(grad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_numpy_transcription(seed):
    logp, old, adv, mask, rewards, target = _batch(seed)
    cfg = PolicyLossConfig(algo="sa_gcpo")
    assert cfg.aggregation == "seq-mean-token-mean"  # the paper's aggregation by default
    loss, metrics, grad = _loss_grad(logp, old, adv, mask, cfg, rewards=jnp.asarray(rewards),
                                     target_reward=jnp.asarray(target))
    ref_loss, ref_grad = _numpy_sa_gcpo(logp, old, adv, mask, rewards, target)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert metrics["clip_fraction"] == 0  # no hard clip
    # the target gate bit on this batch, so the comparison covers it
    assert np.any((adv > 0) & (rewards < target)) and np.any((adv > 0) & (rewards >= target))


def test_gate_temperatures_are_config_fields():
    logp, old, adv, mask, rewards, target = _batch(3)
    cfg = PolicyLossConfig(algo="sa_gcpo", gate_tau_pos=1.0, gate_tau_neg=3.0)
    loss, _, grad = _loss_grad(logp, old, adv, mask, cfg)
    ref_loss, ref_grad = _numpy_sa_gcpo(logp, old, adv, mask, rewards, -np.inf, 1.0, 3.0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_gate_gradient_is_smooth_where_ppo_clip_is_zero():
    ratios = np.linspace(1.25, 2.5, 26).astype(np.float32)  # all beyond PPO's 1 + 0.2
    logp = np.log(ratios)[None].repeat(2, 0) - 1.0
    old = np.full_like(logp, -1.0)
    adv = np.array([1.0, -1.0], np.float32)  # A < 0 beyond 1 + eps is not clipped by PPO
    mask = np.ones_like(logp, bool)
    mask_pos = mask.copy()
    mask_pos[1] = False
    _, ppo_m, ppo_grad = _loss_grad(logp, old, adv, mask_pos, PolicyLossConfig(algo="grpo"))
    assert ppo_m["clip_fraction"] == 1.0 and np.all(ppo_grad == 0)  # PPO: no gradient at all
    _, _, grad = _loss_grad(logp, old, adv, mask_pos, PolicyLossConfig(algo="sa_gcpo"))
    g = -grad[0]  # ascent direction on logp of a positive-advantage token
    assert np.all(g > 0)  # the gate still pushes up where PPO's gradient is exactly 0
    assert g[-1] < 0.5 * g[0]  # ... with a force that fades as the ratio grows
    # smooth: the derivative in log-ratio is 4 s (1 - s) rho, whose slope is bounded; on this grid
    # neighbouring values differ by < 15% (a hard clip jumps from 1 to 0).
    assert np.max(np.abs(np.diff(g)) / g[:-1]) < 0.15
    s = 1 / (1 + np.exp(-2.0 * (ratios - 1)))
    np.testing.assert_allclose(g, 4 * s * (1 - s) * ratios / ratios.size, rtol=1e-5)


def test_gate_value_and_slope_at_ratio_one():
    r = jnp.float32(1.0)
    for tau in (2.0, 5.0):
        assert float(sapo_gate(r, tau)) == pytest.approx(2.0 / tau)
        assert float(jax.grad(sapo_gate)(r, tau)) == pytest.approx(1.0)  # on-policy gradient


def test_zeroed_positive_advantages_give_zero_gradient():
    logp, old, _, _, _, _ = _batch(4, B=6, T=3)
    logp, old = logp[:4], old[:4]
    mask = np.ones_like(logp, bool)
    adv = np.array([1.0, 1.0, -1.0, 0.5], np.float32)
    rewards = np.array([0.4, 0.9, 0.1, 0.6], np.float32)
    target = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    _, _, grad = _loss_grad(logp, old, adv, mask, PolicyLossConfig(algo="sa_gcpo"),
                            rewards=jnp.asarray(rewards), target_reward=jnp.asarray(target))
    assert np.all(grad[0] == 0)  # positive advantage, reward below target
    assert np.all(np.abs(grad[1:]) > 0)  # above target / negative advantage: still trained
    _, _, free = _loss_grad(logp, old, adv, mask, PolicyLossConfig(algo="sa_gcpo"))
    np.testing.assert_array_equal(grad[1:], free[1:])
    assert np.all(np.abs(free[0]) > 0)


def test_sa_gcpo_advantages_match_numpy():
    rewards = np.array([0.0, 1.0, 0.5, 0.5, 0.2, 0.9, 0.7, 0.1], np.float32)
    target = np.array([1.0, 0.9, 0.9, 0.9, 0.5, 1.0, 0.5, 0.5], np.float32)
    adv = np.asarray(sa_gcpo_advantages(jnp.asarray(rewards), jnp.asarray(target), 4))
    g = rewards.reshape(2, 4)
    ref = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1)
    assert ref[5] > 0 and ref[1] > 0 and ref[6] > 0  # row 5 (0.9 < target 1.0) gets zeroed
    ref = np.where((ref > 0) & (rewards < target), 0.0, ref)
    np.testing.assert_allclose(adv, ref, rtol=1e-6)
    assert ref[5] == 0 and ref[1] > 0 and ref[6] > 0
    per_token = zero_positive_below_target(jnp.ones((2, 3)), jnp.array([0.1, 0.9]),
                                           jnp.array([0.5, 0.5]))
    np.testing.assert_array_equal(per_token, [[0, 0, 0], [1, 1, 1]])


def test_unified_reward_matches_numpy():
    rng = np.random.default_rng(0)
    rewards = rng.random((7, 3)).astype(np.float32)
    scenario = rng.integers(0, 2, 7).astype(np.int32)
    weights = np.array([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]], np.float32)
    offsets = np.array([0.5, 0.0, 0.1], np.float32)
    scales = np.array([2.0, 1.0, 0.5], np.float32)
    out = unified_reward(jnp.asarray(rewards), jnp.asarray(scenario), jnp.asarray(weights),
                         offsets=jnp.asarray(offsets), scales=jnp.asarray(scales))
    ref = np.array([weights[s] @ ((r - offsets) / scales) for r, s in zip(rewards, scenario)])
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    jitted = jax.jit(unified_reward)(jnp.asarray(rewards), jnp.asarray(scenario),
                                     jnp.asarray(weights))
    np.testing.assert_allclose(jitted, np.einsum("bk,bk->b", weights[scenario], rewards),
                               rtol=1e-6)


def test_bad_inputs_name_argument_and_shape():
    logp, old, adv, mask, rewards, target = _batch(5)
    cfg = PolicyLossConfig(algo="sa_gcpo")
    args = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
    with pytest.raises(ValueError, match=r"target_reward shape \(5,\) must be \[B\] = \(6,\)"):
        policy_loss(*args, config=cfg, rewards=jnp.asarray(rewards),
                    target_reward=jnp.asarray(target[:5]))
    with pytest.raises(ValueError, match=r"rewards shape \(6, 1\) must be \[B\]"):
        policy_loss(*args, config=cfg, rewards=jnp.asarray(rewards)[:, None],
                    target_reward=jnp.asarray(target))
    with pytest.raises(ValueError, match="target_reward is None"):
        policy_loss(*args, config=cfg, rewards=jnp.asarray(rewards))
    with pytest.raises(ValueError, match="apply to algo 'sa_gcpo', not 'grpo'"):
        policy_loss(*args, config=PolicyLossConfig(), rewards=jnp.asarray(rewards),
                    target_reward=jnp.asarray(target))
    with pytest.raises(ValueError, match="gate_tau_neg must be > 0"):
        PolicyLossConfig(algo="sa_gcpo", gate_tau_neg=0.0)
    with pytest.raises(ValueError, match=r"target_reward shape \(3,\) must be \[B\] = \(2,\)"):
        sa_gcpo_advantages(jnp.zeros(2), jnp.zeros(3), 2)
    r = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match=r"weights shape \(2, 2\) must be \[S, K\] with K = 3"):
        unified_reward(r, jnp.zeros(4, jnp.int32), jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"scenario shape \(3,\) must be \[B\] = \(4,\)"):
        unified_reward(r, jnp.zeros(3, jnp.int32), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"scenario ids must lie in \[0, S=2\), got range \[0, 2\]"):
        unified_reward(r, jnp.array([0, 1, 2, 0]), jnp.zeros((2, 3)))


def test_lowers_for_tpu_and_cuda():
    cfg = PolicyLossConfig(algo="sa_gcpo", correction="sis+tis")

    def loss_grad(logp, old, adv, mask, old_k, new_k, behaviour, u, rewards, target):
        return jax.grad(lambda lp: policy_loss(
            lp, old, adv, mask, config=cfg, old_topk_logp=old_k, new_topk_logp=new_k,
            behaviour_logp=behaviour, uniforms=u, rewards=rewards, target_reward=target)[0])(logp)

    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (f32(4, 6), f32(4, 6), f32(4), jax.ShapeDtypeStruct((4, 6), jnp.bool_), f32(4, 6, 3),
            f32(4, 6, 3), f32(4, 6), f32(4, 6), f32(4), f32(4))
    exported = jax.export.export(jax.jit(loss_grad), platforms=("tpu", "cuda"))(*args)
    assert exported.platforms == ("tpu", "cuda")
