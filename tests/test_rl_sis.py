"""SIS: the acceptance rule, the envelope, and what accepted / rejected tokens do to the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl import ALGOS, PolicyLossConfig, policy_loss, sis_accept, sis_log_envelope, sis_uniforms


def make_batch(seed, B=4, T=6, V=6, scale=0.5, k=None):
    """Consistent toy data: new / old logits over V tokens, sampled tokens from pi_old.

    Returns logp, old_logp [B, T], adv [B], mask [B, T], new_topk, old_topk [B, T, K] at
    pi_old's top-K tokens (K = V unless ``k``)."""
    rng = np.random.default_rng(seed)
    old_logits = rng.normal(size=(B, T, V))
    new_logits = old_logits + scale * rng.normal(size=(B, T, V))
    old_lsm = jax.nn.log_softmax(jnp.asarray(old_logits, jnp.float32))
    new_lsm = jax.nn.log_softmax(jnp.asarray(new_logits, jnp.float32))
    tokens = jax.random.categorical(jax.random.PRNGKey(seed), old_lsm)
    take = lambda x, idx: jnp.take_along_axis(x, idx, axis=-1)
    logp = take(new_lsm, tokens[..., None])[..., 0]
    old_logp = take(old_lsm, tokens[..., None])[..., 0]
    top = jnp.argsort(-old_lsm, axis=-1)[..., : (k or V)]
    adv = jnp.asarray(rng.normal(size=(B,)), jnp.float32)
    mask = jnp.ones((B, T), bool)
    return dict(logp=logp, old_logp=old_logp, adv=adv, mask=mask,
                new_topk=take(new_lsm, top), old_topk=take(old_lsm, top))


def loss_and_grad(batch, config, key, logp=None):
    def f(lp):
        return policy_loss(lp, batch["old_logp"], batch["adv"], batch["mask"], config=config,
                           key=key, old_topk_logp=batch["old_topk"],
                           new_topk_logp=batch["new_topk"],
                           behaviour_logp=batch.get("behaviour_logp"))
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(
        batch["logp"] if logp is None else logp)
    return loss, metrics, grad


def accepted_mask(batch, key):
    """The tokens a loss call with ``key`` accepts, recomputed from the public pieces."""
    log_w = jnp.clip(batch["logp"] - batch["old_logp"], -20, 20)
    log_m = sis_log_envelope(log_w, batch["new_topk"], batch["old_topk"])
    return np.asarray(sis_accept(log_w, log_m, sis_uniforms(key, log_w.shape)))


# ----------------------------------------------------------------------------- the rule


def test_sis_accept_rule():
    log_w = jnp.array([0.0, -1.0, -1.0, 0.5, 0.5])
    log_m = jnp.array([2.0, 0.0, 0.0, 0.5, 1.0])
    u = jnp.array([0.999, 0.30, 0.40, 0.999, 0.7])
    # log_w == 0 always accepts; e^-1 = 0.368 splits u = 0.30 / 0.40; w == M accepts (u < 1);
    # log(0.7) = -0.357 > 0.5 - 1.0 rejects.
    np.testing.assert_array_equal(sis_accept(log_w, log_m, u), [True, True, False, True, False])


def test_envelope_includes_sampled_token_when_outside_topk():
    log_w = jnp.array([[3.0, -1.0]])
    new_k = jnp.array([[[0.0, -2.0], [0.0, -2.0]]])
    old_k = jnp.array([[[-0.5, -2.0], [-0.5, -2.0]]])  # top-K log ratios 0.5 and 0.0
    np.testing.assert_allclose(sis_log_envelope(log_w, new_k, old_k), [[3.0, 0.5]])


def test_uniforms_are_fresh_per_key():
    b = make_batch(0, B=8, T=16, scale=1.0)
    a0, a1 = accepted_mask(b, jax.random.PRNGKey(1)), accepted_mask(b, jax.random.PRNGKey(2))
    assert 0 < a0.mean() < 1 and (a0 != a1).any()


# ----------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_sis_equals_base_when_on_policy(algo, agg):
    b = make_batch(1)
    b["old_logp"] = b["logp"] + 0.0
    b["old_topk"] = b["new_topk"] + 0.0
    key = jax.random.PRNGKey(3)
    dual = 3.0 if algo in ("grpo", "dapo") else None
    base = loss_and_grad(b, PolicyLossConfig(algo=algo, agg=agg, dual_clip_c=dual), key)
    with_sis = loss_and_grad(
        b, PolicyLossConfig(algo=algo, agg=agg, dual_clip_c=dual, correction="sis"), key)
    assert with_sis[1]["accept_rate"] == 1.0
    np.testing.assert_array_equal(with_sis[0], base[0])
    np.testing.assert_array_equal(with_sis[2], base[2])
    assert np.abs(base[2]).max() > 0


@pytest.mark.parametrize("algo", ALGOS)
def test_accepted_tokens_get_on_policy_gradient_far_outside_clip(algo):
    # The sampled token has the largest log ratio (log 4.5) in the envelope: P(accept) = 1.
    B, T = 2, 3
    b = dict(logp=jnp.full((B, T), -1.0), old_logp=jnp.full((B, T), -1.0 - np.log(4.5)),
             adv=jnp.array([1.0, -1.0]), mask=jnp.ones((B, T), bool),
             new_topk=jnp.full((B, T, 2), -2.0), old_topk=jnp.full((B, T, 2), -2.5))
    key = jax.random.PRNGKey(0)
    n = B * T
    on_policy = -np.asarray(b["adv"])[:, None] / n * np.ones((1, T))
    loss, metrics, grad = loss_and_grad(b, PolicyLossConfig(algo=algo, correction="sis"), key)
    assert metrics["accept_rate"] == 1.0 and metrics["clip_fraction"] == 0.0
    np.testing.assert_allclose(grad, on_policy, rtol=1e-6)
    # The base algorithm clips (or truncates) these tokens: its gradient differs.
    _, base_metrics, base_grad = loss_and_grad(b, PolicyLossConfig(algo=algo), key)
    if algo != "sa_gcpo":  # SA-GCPO's soft gate has no hard clip to count
        assert base_metrics["clip_fraction"] > 0
    assert np.abs(np.asarray(base_grad) - on_policy).max() > 0.1 / n
    if algo == "sa_gcpo":  # ratio value exactly 1: gate value 2 / tau, tau = 2 (A > 0) / 5
        np.testing.assert_allclose(loss, np.mean([-1.0 * 2 / 2, 1.0 * 2 / 5]), rtol=1e-6)
    elif algo != "cispo":  # ratio value is exactly 1: loss = mean(-A)
        np.testing.assert_allclose(loss, 0.0, atol=1e-7)


@pytest.mark.parametrize("algo", ["grpo", "dapo", "cispo"])
def test_token_algos_rejected_tokens_match_base_and_accepted_are_on_policy(algo):
    b = make_batch(4, B=6, T=8, scale=1.5)
    key = jax.random.PRNGKey(5)
    acc = accepted_mask(b, key)
    assert 0.1 < acc.mean() < 0.9
    _, metrics, grad = loss_and_grad(b, PolicyLossConfig(algo=algo, correction="sis"), key)
    _, _, base_grad = loss_and_grad(b, PolicyLossConfig(algo=algo), key)
    grad, base_grad = np.asarray(grad), np.asarray(base_grad)
    on_policy = np.broadcast_to(-np.asarray(b["adv"])[:, None] / acc.size, acc.shape)
    np.testing.assert_array_equal(grad[~acc], base_grad[~acc])
    np.testing.assert_allclose(grad[acc], on_policy[acc], rtol=1e-6)
    assert metrics["accept_rate"] == pytest.approx(acc.mean())


def test_gspo_sequence_ratio_runs_over_rejected_tokens_only():
    b = make_batch(6, B=6, T=5, scale=1.5)
    key = jax.random.PRNGKey(7)
    acc = accepted_mask(b, key)
    assert acc.any() and (~acc).any()
    inf = float("inf")  # no clipping, so the gradient shows the ratio itself
    cfg = PolicyLossConfig(algo="gspo", correction="sis", clip_eps_low=1.0, clip_eps_high=inf)
    _, _, grad = loss_and_grad(b, cfg, key)
    log_w = np.asarray(b["logp"] - b["old_logp"])
    rej = ~acc
    seq = np.where(rej, log_w, 0).sum(1) / np.maximum(rej.sum(1), 1)
    adv = np.asarray(b["adv"])[:, None]
    n = acc.size
    expected = np.where(acc, -adv / n, -adv * np.exp(seq)[:, None] / n)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)


def test_gspo_fully_rejected_sequences_match_base():
    b = make_batch(8, B=16, T=3, scale=3.0)
    key = jax.random.PRNGKey(9)
    acc = accepted_mask(b, key)
    none_accepted = ~acc.any(axis=1)
    assert none_accepted.any() and not none_accepted.all()
    cfg = dict(algo="gspo", clip_eps_low=0.5, clip_eps_high=0.5)
    _, _, grad = loss_and_grad(b, PolicyLossConfig(correction="sis", **cfg), key)
    _, _, base_grad = loss_and_grad(b, PolicyLossConfig(**cfg), key)
    np.testing.assert_array_equal(np.asarray(grad)[none_accepted],
                                  np.asarray(base_grad)[none_accepted])


# ----------------------------------------------------------------------------- statistics


def test_accept_rate_matches_expected_min_w_over_m_and_on_policy_share():
    """Empirical accept rate vs E[min(1, w/M)] over 20 keys x 4096 tokens (~82k Bernoulli
    draws). The sum of independent Bernoulli(p_i) has variance sum p_i (1 - p_i); we require
    agreement within 5 standard deviations (a false failure has probability ~6e-7)."""
    b = make_batch(10, B=64, T=64, V=8, scale=1.0)
    log_w = np.asarray(jnp.clip(b["logp"] - b["old_logp"], -20, 20), np.float64)
    log_m = np.asarray(sis_log_envelope(jnp.asarray(log_w, jnp.float32), b["new_topk"],
                                        b["old_topk"]), np.float64)
    p = np.where(log_w == 0, 1.0, np.exp(np.minimum(log_w - log_m, 0.0)))
    assert 0.3 < p.mean() < 0.9
    cfg = PolicyLossConfig(algo="grpo", correction="sis")
    step = jax.jit(lambda lp, key: loss_and_grad(b, cfg, key, logp=lp))
    n_keys, accepted, on_policy_share = 20, 0.0, []
    on_policy = -np.asarray(b["adv"])[:, None] / p.size * np.ones_like(p)
    for i in range(n_keys):
        _, metrics, grad = step(b["logp"], jax.random.PRNGKey(100 + i))
        rate = float(metrics["accept_rate"])
        accepted += rate * p.size
        # Rejected tokens have ratio != 1 (continuous data), so their gradient is not -A/N.
        share = np.mean(np.isclose(np.asarray(grad), on_policy, rtol=1e-6, atol=0))
        on_policy_share.append(share)
        assert share == pytest.approx(rate, abs=0.5 / p.size)
    sigma = np.sqrt(n_keys * np.sum(p * (1 - p)))
    assert abs(accepted - n_keys * p.sum()) < 5 * sigma, (accepted, n_keys * p.sum(), sigma)


def test_small_k_envelope_accepts_at_least_as_often_as_exact():
    """A top-K envelope is a lower bound on the exact one, so acceptance can only rise."""
    full, small = make_batch(11, B=32, T=32, V=8, scale=1.0), make_batch(11, B=32, T=32, V=8,
                                                                         scale=1.0, k=2)
    for key in range(3):
        a_full = accepted_mask(full, jax.random.PRNGKey(key))
        a_small = accepted_mask(small, jax.random.PRNGKey(key))
        assert np.all(a_small >= a_full) and a_small.mean() > a_full.mean()


def test_explicit_uniforms_replace_the_key():
    b = make_batch(12, B=4, T=8, scale=1.0)
    cfg = PolicyLossConfig(algo="grpo", correction="sis")
    args = (b["logp"], b["old_logp"], b["adv"], b["mask"])
    kw = dict(config=cfg, old_topk_logp=b["old_topk"], new_topk_logp=b["new_topk"])
    _, forced_accept = policy_loss(*args, uniforms=jnp.zeros(b["logp"].shape), **kw)
    _, forced_reject = policy_loss(*args, uniforms=jnp.ones(b["logp"].shape), **kw)
    assert forced_accept["accept_rate"] == 1.0 and forced_reject["accept_rate"] == 0.0
    key = jax.random.PRNGKey(13)
    from_key = policy_loss(*args, key=key, **kw)
    replayed = policy_loss(*args, uniforms=sis_uniforms(key, b["logp"].shape), **kw)
    np.testing.assert_array_equal(from_key[0], replayed[0])
    with pytest.raises(ValueError, match=r"uniforms shape \(4,\) does not match"):
        policy_loss(*args, uniforms=jnp.zeros((4,)), **kw)
