"""policy_loss: base algorithms, aggregation, TIS / MIS, masking, metrics and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl import (
    ALGOS,
    CORRECTIONS,
    PolicyLossConfig,
    grpo_advantages,
    mis_weights,
    policy_loss,
    rloo_advantages,
    tis_weights,
)


def make_batch(seed, B=3, T=5, K=4, scale=0.5):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    logp = -jnp.abs(f(B, T)) - 0.1
    old_logp = logp + scale * f(B, T)
    new_topk = -jnp.abs(f(B, T, K)) - 0.1
    return dict(logp=logp, old_logp=old_logp, adv=f(B), mask=jnp.ones((B, T), bool),
                new_topk=new_topk, old_topk=new_topk + scale * f(B, T, K),
                behaviour=old_logp + scale * f(B, T), behaviour_topk=new_topk + scale * f(B, T, K))


def run(b, config, key=jax.random.PRNGKey(0), logp=None, **over):
    args = dict(old_logp=b["old_logp"], advantages=b["adv"], mask=b["mask"],
                old_topk_logp=b["old_topk"], new_topk_logp=b["new_topk"],
                behaviour_logp=b["behaviour"], behaviour_topk_logp=b.get("behaviour_topk"))
    args.update(over)

    def f(lp):
        return policy_loss(lp, args["old_logp"],
                           args["advantages"], args["mask"], config=config, key=key,
                           **{k: args[k] for k in ("old_topk_logp", "new_topk_logp",
                                                   "behaviour_logp", "behaviour_topk_logp")})
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(b["logp"] if logp is None
                                                                 else logp)
    return loss, metrics, grad


# ----------------------------------------------------------------------------- base algorithms


def test_grpo_clip_matches_hand_computation():
    b = make_batch(0)
    loss, metrics, _ = run(b, PolicyLossConfig(algo="grpo"))
    r = np.exp(np.asarray(b["logp"] - b["old_logp"]))
    a = np.asarray(b["adv"])[:, None]
    expected = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)
    clipped = -a * np.clip(r, 0.8, 1.2) > -a * r
    assert metrics["clip_fraction"] == pytest.approx(clipped.mean())
    assert 0 < clipped.mean() < 1


def test_dapo_clip_higher_and_default_dual_clip():
    log_w = jnp.log(jnp.array([[1.25, 1.25, 5.0]]))
    b = dict(logp=log_w - 1.0, old_logp=jnp.full((1, 3), -1.0), mask=jnp.ones((1, 3), bool),
             adv=jnp.array([[1.0, 1.0, -1.0]]), new_topk=None, old_topk=None, behaviour=None)
    _, _, g_grpo = run(b, PolicyLossConfig(algo="grpo", dual_clip_c=None))
    _, _, g_dapo = run(b, PolicyLossConfig(algo="dapo", dual_clip_c=None))
    # ratio 1.25 is clipped by grpo (1.2) but not by dapo (1.28)
    assert g_grpo[0, 0] == 0 and g_dapo[0, 0] == pytest.approx(-1.25 / 3, rel=1e-5)
    # dual clip off: the A < 0 token at ratio 5 keeps its gradient -A r / n = 5 / 3
    assert g_grpo[0, 2] == pytest.approx(5.0 / 3, rel=1e-5)
    # the default (c = 3, verl's clip_ratio_c) caps its loss at -A c = 3: no gradient
    assert PolicyLossConfig().dual_clip_c == 3.0 == PolicyLossConfig(algo="dapo").dual_clip
    for cfg in (PolicyLossConfig(algo="grpo"), PolicyLossConfig(algo="dapo")):
        loss, metrics, g_dual = run(b, cfg)
        assert g_dual[0, 2] == 0
        assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)
        if cfg.algo == "grpo":  # losses -1.2, -1.2 (clipped), 3 (dual-clipped): mean 0.2
            assert metrics["clip_fraction"] == 1.0
            np.testing.assert_allclose(loss, (-1.2 - 1.2 + 3.0) / 3, rtol=1e-5)
        else:  # dapo: -1.25, -1.25 (inside 1.28), 3: mean 1/6
            assert metrics["clip_fraction"] == pytest.approx(1 / 3)
            np.testing.assert_allclose(loss, (-1.25 - 1.25 + 3.0) / 3, rtol=1e-5)


def test_gspo_token_form_equals_sequence_gspo():
    b = make_batch(1, B=4, T=6, scale=0.02)
    cfg = PolicyLossConfig(algo="gspo", agg="seq-mean-token-mean", clip_eps_low=0.01,
                           clip_eps_high=0.01)
    loss, _, grad = run(b, cfg)

    def sequence_gspo(lp):
        s = jnp.exp(jnp.mean(lp - b["old_logp"], axis=1))
        a = b["adv"]
        return jnp.mean(jnp.maximum(-a * s, -a * jnp.clip(s, 0.99, 1.01)))
    np.testing.assert_allclose(loss, sequence_gspo(b["logp"]), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(sequence_gspo)(b["logp"]), rtol=1e-5, atol=1e-8)


def test_cispo_gradient_flows_through_truncated_tokens():
    b = make_batch(2, scale=1.0)
    loss, metrics, grad = run(b, PolicyLossConfig(algo="cispo"))
    r = np.exp(np.asarray(b["logp"] - b["old_logp"]))
    w = np.clip(r, 0.0, 1.28)
    a = np.asarray(b["adv"])[:, None] * np.ones_like(r)
    np.testing.assert_allclose(grad, -a * w / r.size, rtol=1e-5)
    np.testing.assert_allclose(loss, np.mean(-a * w * np.asarray(b["logp"])), rtol=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(np.mean(r > 1.28))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregations(agg):
    b = make_batch(3, B=3, T=4)
    b["mask"] = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    cfg = PolicyLossConfig(algo="grpo", clip_eps_low=1.0, clip_eps_high=float("inf"), agg=agg)
    loss, _, _ = run(b, cfg)
    m = np.asarray(b["mask"])
    tok = -np.asarray(b["adv"])[:, None] * np.exp(np.asarray(b["logp"] - b["old_logp"]))
    tok = np.where(m, tok, 0)
    if agg == "token-mean":
        expected = tok.sum() / m.sum()
    elif agg == "seq-mean-token-mean":
        expected = np.mean([tok[0, :2].mean(), tok[1].mean()])  # the empty row is skipped
    else:
        expected = np.mean([tok[0].sum(), tok[1].sum()])
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


# ----------------------------------------------------------------------------- TIS / MIS


def test_tis_and_mis_weights():
    old = jnp.log(jnp.array([[0.5, 0.9, 0.1, 0.3]]))
    mu = jnp.log(jnp.array([[0.1, 0.9, 0.5, 0.29]]))
    np.testing.assert_allclose(tis_weights(old, mu, 2.0), [[2.0, 1.0, 0.2, 0.3 / 0.29]],
                               rtol=1e-6)
    np.testing.assert_allclose(mis_weights(old, mu, 0.5, 2.0), [[0.0, 1.0, 0.0, 0.3 / 0.29]],
                               rtol=1e-6)


@pytest.mark.parametrize("correction", ["tis", "mis", "sis+tis", "sis+mis"])
def test_behaviour_weights_multiply_every_token(correction):
    b = make_batch(4, scale=1.0)
    key = jax.random.PRNGKey(4)
    base_corr = "sis" if correction.startswith("sis") else "none"
    _, _, g_base = run(b, PolicyLossConfig(algo="dapo", correction=base_corr), key)
    _, metrics, g = run(b, PolicyLossConfig(algo="dapo", correction=correction), key)
    if correction.endswith("tis"):
        w = tis_weights(b["old_logp"], b["behaviour"], 2.0)
    else:
        w = mis_weights(b["old_logp"], b["behaviour"], 0.5, 2.0)
    assert 0 < np.mean(np.asarray(w) == 0) < 1 if "mis" in correction else True
    np.testing.assert_allclose(g, g_base * w, rtol=1e-6, atol=1e-9)
    if correction.startswith("sis"):
        assert 0 < metrics["accept_rate"] < 1


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("correction", ["none", "sis+tis", "sis+mis", "sis+rs"])
def test_masked_tokens_get_no_gradient_and_do_not_matter(algo, correction):
    b = make_batch(5, B=3, T=6, scale=1.0)
    mask = jnp.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], bool)
    b["mask"] = mask
    cfg = PolicyLossConfig(algo=algo, correction=correction, agg="seq-mean-token-mean")
    loss, metrics, grad = run(b, cfg)
    junk = dict(b)
    for name in ("logp", "old_logp", "behaviour"):
        junk[name] = jnp.where(mask, b[name], jnp.array([jnp.nan, -jnp.inf, jnp.inf])[
            np.arange(18).reshape(3, 6) % 3])
    for name in ("new_topk", "old_topk"):
        junk[name] = jnp.where(mask[..., None], b[name], -jnp.inf)
    junk_loss, junk_metrics, junk_grad = run(junk, cfg)
    assert np.all(np.asarray(grad)[~np.asarray(mask)] == 0)
    assert np.all(np.asarray(junk_grad)[~np.asarray(mask)] == 0)
    np.testing.assert_array_equal(junk_loss, loss)
    np.testing.assert_array_equal(junk_grad, grad)
    for k, v in junk_metrics.items():
        np.testing.assert_array_equal(v, metrics[k], err_msg=k)
    assert np.abs(np.asarray(grad)[np.asarray(mask)]).max() > 0


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_all_masked_batch_gives_zero_loss_and_finite_gradient(correction):
    b = make_batch(6)
    b["mask"] = jnp.zeros_like(b["mask"])
    for algo in ALGOS:
        loss, metrics, grad = run(b, PolicyLossConfig(algo=algo, correction=correction))
        assert loss == 0 and np.all(np.asarray(grad) == 0)
        assert all(np.isfinite(v) for v in metrics.values())


# ----------------------------------------------------------------------------- metrics, jit


def test_metrics_match_numpy():
    b = make_batch(7, B=8, T=16, scale=1.0)
    b["mask"] = jnp.asarray(np.random.default_rng(0).random((8, 16)) < 0.7)
    _, m, _ = run(b, PolicyLossConfig(algo="grpo", correction="tis"))
    mask = np.asarray(b["mask"])
    log_w = np.asarray(b["logp"] - b["old_logp"])[mask]
    r = np.exp(log_w)
    w = r * np.minimum(np.exp(np.asarray(b["old_logp"] - b["behaviour"])[mask]), 2.0)
    assert m["d_original"] == pytest.approx(np.abs(log_w).mean(), rel=1e-5)
    assert m["d_sis"] == m["d_original"] and m["accept_rate"] == 0
    assert m["ratio_max"] == pytest.approx(r.max(), rel=1e-5)
    assert m["ratio_p99"] == pytest.approx(np.percentile(r, 99), rel=1e-5)
    assert m["ess"] == pytest.approx(w.sum() ** 2 / (w.size * (w * w).sum()), rel=1e-5)


@pytest.mark.parametrize("algo", ["grpo", "cispo"])
def test_d_seq_metrics_are_the_sis_forks_definition(algo):
    # row 0: log ratios 0.3 (accepted), -0.6, 0.9; row 1: -25 (clipped to -20), then masked;
    # row 2: every token masked (an empty row)
    old = jnp.full((3, 3), -30.0)
    logp = old + jnp.array([[0.3, -0.6, 0.9], [-25.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    topk = jnp.zeros((3, 3, 1))
    uniforms = jnp.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])  # 0 accepts
    cfg = PolicyLossConfig(algo=algo, correction="sis")
    _, m = policy_loss(logp, old, jnp.ones(3), mask, config=cfg, uniforms=uniforms,
                       old_topk_logp=topk, new_topk_logp=topk)
    # the fork: |log w| of the PPO-clipped ratio, per-row token mean, mean over all 3 rows
    # (the empty row counts 0); grpo's range is [log 0.8, log 1.2], cispo's [-inf, log 1.28]
    lo, hi = (np.log(0.8), np.log(1.2)) if algo == "grpo" else (-np.inf, np.log(1.28))
    c = lambda x: abs(min(max(x, lo), hi))
    fork_orig = ((c(0.3) + c(-0.6) + c(0.9)) / 3 + c(-20.0) + 0.0) / 3
    fork_sis = ((c(-0.6) + c(0.9)) / 3 + c(-20.0) + 0.0) / 3
    assert m["d_original_seq"] == pytest.approx(fork_orig, rel=1e-5)
    assert m["d_sis_seq"] == pytest.approx(fork_sis, rel=1e-5)
    # jaxflow's own sequence form: +-20 clip only, the empty row left out
    assert m["d_original_seq_nonempty"] == pytest.approx((1.8 / 3 + 20) / 2, rel=1e-5)
    assert m["d_sis_seq_nonempty"] == pytest.approx((1.5 / 3 + 20) / 2, rel=1e-5)
    assert abs(m["d_original_seq"] - m["d_original_seq_nonempty"]) > 1.0  # not the same metric


def test_jit_with_static_config_matches_eager():
    b = make_batch(8)
    cfg = PolicyLossConfig(algo="gspo", correction="sis+tis")
    key = jax.random.PRNGKey(1)
    args = (b["logp"], b["old_logp"], b["adv"], b["mask"])
    kw = dict(key=key, old_topk_logp=b["old_topk"], new_topk_logp=b["new_topk"],
              behaviour_logp=b["behaviour"])
    eager = policy_loss(*args, config=cfg, **kw)
    jitted = jax.jit(policy_loss, static_argnames="config")(*args, config=cfg, **kw)
    np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
    assert hash(cfg) == hash(PolicyLossConfig(algo="gspo", correction="sis+tis"))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(algo="ppo"), r"unknown algo 'ppo'.*grpo"),
    (dict(correction="is"), r"unknown correction 'is'.*sis\+tis"),
    (dict(agg="mean"), r"unknown agg 'mean'.*token-mean"),
    (dict(algo="gspo", dual_clip_c=5.0), r"dual_clip_c=5.0 applies to .*'gspo' has no dual"),
    (dict(dual_clip_c=0.5), r"dual_clip_c must be > 1"),
    (dict(mis_low=2.0, mis_high=1.0), r"mis_low < mis_high"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_input_errors():
    b = make_batch(9)
    sis = PolicyLossConfig(correction="sis")
    with pytest.raises(ValueError, match=r"old_logp shape \(3, 4\) does not match"):
        run(b, PolicyLossConfig(), old_logp=b["old_logp"][:, :4])
    with pytest.raises(ValueError, match=r"old_logp dtype bfloat16 does not match .*float32"):
        run(b, PolicyLossConfig(), old_logp=b["old_logp"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"advantages shape \(2,\)"):
        run(b, PolicyLossConfig(), advantages=b["adv"][:2])
    with pytest.raises(ValueError, match=r"mask shape"):
        run(b, PolicyLossConfig(), mask=b["mask"][0])
    with pytest.raises(ValueError, match=r"needs key="):
        run(b, sis, key=None)
    with pytest.raises(ValueError, match=r"needs old_topk_logp="):
        run(b, sis, old_topk_logp=None)
    with pytest.raises(ValueError, match=r"new_topk_logp shape \(3, 5\) must be \[B, T, K\]"):
        run(b, sis, new_topk_logp=b["new_topk"][..., 0])
    with pytest.raises(ValueError, match=r"old_topk_logp shape .* does not match new_topk"):
        run(b, sis, old_topk_logp=b["old_topk"][..., :2])
    with pytest.raises(ValueError, match=r"needs behaviour_logp="):
        run(b, PolicyLossConfig(correction="sis+mis"), behaviour_logp=None)
    with pytest.raises(ValueError, match=r"must be a PolicyLossConfig"):
        run(b, {"algo": "grpo"})


# ----------------------------------------------------------------------------- advantages


def test_advantages():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    g = np.asarray(r).reshape(2, 4)
    centred = g - g.mean(1, keepdims=True)
    np.testing.assert_allclose(grpo_advantages(r, 4, normalize_std=False), centred.reshape(-1))
    np.testing.assert_allclose(grpo_advantages(r, 4),
                               (centred / (g.std(1, keepdims=True) + 1e-6)).reshape(-1),
                               rtol=1e-6)
    loo = g - (g.sum(1, keepdims=True) - g) / 3
    np.testing.assert_allclose(rloo_advantages(r, 4), loo.reshape(-1), rtol=1e-6)
    with pytest.raises(ValueError, match=r"not a multiple of group_size=3"):
        grpo_advantages(r, 3)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 2"):
        rloo_advantages(r, 1)
