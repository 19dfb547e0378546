"""verl-compatible defaults and options, each against numbers worked out by hand: the default
dual clip, GSPO's default aggregation and sequence log-ratio cap, RS vs MIS, the accepted-token
gradient past the +-20 clip, the D metrics both ways, overlong shaping, dynamic sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl import PolicyLossConfig, policy_loss, rs_keep_mask, sis_log_ratio
from jaxflow.rl.dynamic_sampling import fill_groups, groups_with_signal
from jaxflow.rl.policy_loss import rs_token_mask
from jaxflow.rl.reward_shaping import OverlongBufferConfig, overlong_penalty
from jaxflow.rl.rollout import RolloutBatch

INF = float("inf")


def loss_grad(config, logp, old, adv, mask, **kw):
    def f(lp):
        return policy_loss(lp, old, adv, mask, config=config, **kw)
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return float(loss), jax.device_get(metrics), np.asarray(grad)


# ----------------------------------------------------------------------------- dual clip


def test_dual_clip_default_is_three_for_grpo_dapo_and_none_disables():
    # one token, A = -1, ratio 5: PPO loss max(5, 1.2) = 5; dual clip caps it at -A c = 3
    logp, old = jnp.array([[np.log(5.0) - 1.0]]), jnp.array([[-1.0]])
    adv, mask = jnp.array([-1.0]), jnp.ones((1, 1), bool)
    for algo in ("grpo", "dapo"):
        loss, m, g = loss_grad(PolicyLossConfig(algo=algo), logp, old, adv, mask)
        assert loss == pytest.approx(3.0) and g[0, 0] == 0 and m["dual_clip_fraction"] == 1
        loss, m, g = loss_grad(PolicyLossConfig(algo=algo, dual_clip_c=None), logp, old, adv,
                               mask)
        assert loss == pytest.approx(5.0, rel=1e-6) and g[0, 0] == pytest.approx(5.0, rel=1e-6)
        assert m["dual_clip_fraction"] == 0
        loss, _, _ = loss_grad(PolicyLossConfig(algo=algo, dual_clip_c=4.0), logp, old, adv, mask)
        assert loss == pytest.approx(4.0)
    # positive advantage at ratio 5 is never dual-clipped: max(-5, -1.2) = -1.2 (clipped)
    loss, m, _ = loss_grad(PolicyLossConfig(), logp, old, jnp.array([1.0]), mask)
    assert loss == pytest.approx(-1.2) and m["dual_clip_fraction"] == 0
    # switching algorithm keeps the default valid; the dual clip then does not apply
    gspo = dataclasses.replace(PolicyLossConfig(), algo="gspo")
    assert gspo.dual_clip_c == 3.0 and gspo.dual_clip is None


# ----------------------------------------------------------------------------- GSPO


def test_gspo_default_aggregation_is_seq_mean_token_mean():
    # on-policy (ratio 1, inside GSPO's tiny clip): token loss -A; rows of 3 and 1 tokens
    logp = jnp.full((2, 3), -1.0)
    mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    adv = jnp.array([1.0, -2.0])
    cfg = PolicyLossConfig(algo="gspo")
    assert cfg.aggregation == "seq-mean-token-mean"
    loss, _, grad = loss_grad(cfg, logp, logp, adv, mask)
    assert loss == pytest.approx((-1.0 + 2.0) / 2)  # token-mean would be (-3 + 2) / 4
    # d/dlogp of -A r_t with dr_t/dlogp_t = s = 1, weighted 1 / (n_tokens(row) * B)
    np.testing.assert_allclose(grad, [[-1 / 6, -1 / 6, -1 / 6], [1.0, 0, 0]], rtol=1e-6)
    token_mean, _, _ = loss_grad(dataclasses.replace(cfg, agg="token-mean"), logp, logp, adv,
                                 mask)
    assert token_mean == pytest.approx(-0.25)


def test_gspo_sequence_log_ratio_cap():
    # row 0: log ratio 12 on both tokens (s = e^12 > e^10), row 1: 0.5; A = -1, no clip
    old = jnp.full((2, 2), -15.0)
    logp = old + jnp.array([[12.0, 12.0], [0.5, 0.5]])
    adv, mask = jnp.array([-1.0, -1.0]), jnp.ones((2, 2), bool)
    cfg = PolicyLossConfig(algo="gspo", clip_eps_low=1.0, clip_eps_high=INF)
    loss, _, grad = loss_grad(cfg, logp, old, adv, mask)
    # loss = mean_seq mean_tok r_t = (e^10 + e^0.5) / 2; capped row: no gradient; row 1:
    # d r_t / d logp_t = s = e^0.5, weight 1 / (2 tokens * 2 rows)
    assert loss == pytest.approx((np.exp(10.0) + np.exp(0.5)) / 2, rel=1e-6)
    np.testing.assert_allclose(grad, [[0, 0], [np.exp(0.5) / 4] * 2], rtol=1e-6)
    loss, _, grad = loss_grad(dataclasses.replace(cfg, seq_log_ratio_cap=INF), logp, old, adv,
                              mask)
    assert loss == pytest.approx((np.exp(12.0) + np.exp(0.5)) / 2, rel=1e-6)
    np.testing.assert_allclose(grad[0], [np.exp(12.0) / 4] * 2, rtol=1e-6)


# ----------------------------------------------------------------------------- RS vs MIS


def test_rs_removes_tokens_from_the_denominator_mis_keeps_them():
    # on-policy, A = 1: token loss -w (w the behaviour weight); rho = pi_old / mu per token
    rho = np.array([[1.0, 3.0, 0.25, 1.5]])
    old = jnp.full((1, 4), -1.0)
    behaviour = old - jnp.log(jnp.asarray(rho, jnp.float32))
    adv, mask = jnp.array([1.0]), jnp.ones((1, 4), bool)
    kw = dict(behaviour_logp=behaviour)
    np.testing.assert_array_equal(rs_keep_mask(old, behaviour, 0.5, 2.0),
                                  [[True, False, False, True]])
    # mis: weights [1, 0, 0, 1.5] over all 4 tokens
    loss, m, grad = loss_grad(PolicyLossConfig(correction="mis"), old, old, adv, mask, **kw)
    assert loss == pytest.approx(-2.5 / 4, rel=1e-6) and m["rs_masked_fraction"] == 0
    np.testing.assert_allclose(grad, [[-1 / 4, 0, 0, -1.5 / 4]], rtol=1e-6)
    # rs: weight 1 on the 2 kept tokens, the other 2 leave the mask (verl's default lower
    # bound 1 / rs_threshold = 0.5)
    loss, m, grad = loss_grad(PolicyLossConfig(correction="rs"), old, old, adv, mask, **kw)
    assert loss == pytest.approx(-1.0, rel=1e-6) and m["rs_masked_fraction"] == 0.5
    np.testing.assert_allclose(grad, [[-0.5, 0, 0, -0.5]], rtol=1e-6)
    # tis+rs: TIS weights min(rho, 2) = [1, 2, .25, 1.5] on the kept tokens: -(1 + 1.5) / 2
    loss, _, _ = loss_grad(PolicyLossConfig(correction="tis+rs"), old, old, adv, mask, **kw)
    assert loss == pytest.approx(-1.25, rel=1e-6)
    # explicit asymmetric bounds keep [0.2, 1.2]: tokens 0 and 2, -(1 + 1) / 2
    cfg = PolicyLossConfig(correction="rs", rs_threshold=1.2, rs_threshold_lower=0.2)
    loss, m, grad = loss_grad(cfg, old, old, adv, mask, **kw)
    assert loss == pytest.approx(-1.0) and m["rs_masked_fraction"] == 0.5
    np.testing.assert_allclose(grad, [[-0.5, 0, -0.5, 0]], rtol=1e-6)
    with pytest.raises(ValueError, match=r"rs_threshold_lower <= rs_threshold"):
        PolicyLossConfig(correction="rs", rs_threshold=0.5)  # lower 1 / 0.5 = 2 > 0.5
    with pytest.raises(ValueError, match=r"needs behaviour_logp="):
        policy_loss(old, old, adv, mask, config=PolicyLossConfig(correction="rs"))


def test_one_rs_mask_zeroes_masked_entries_and_is_the_given_mask_without_rs():
    # rho = [1, 3, 0.25, -]; the last token is masked and holds inf in both log-probs
    old = jnp.array([[-1.0, -1.0, -1.0, INF]])
    behaviour = old - jnp.log(jnp.array([[1.0, 3.0, 0.25, 1.0]]))
    given = jnp.array([[True, True, True, False]])
    for correction in ("rs", "tis+rs", "sis+rs"):
        keep = rs_token_mask(PolicyLossConfig(correction=correction), old, behaviour, given)
        np.testing.assert_array_equal(keep, [[True, False, False, False]])
    keep = rs_token_mask(PolicyLossConfig(correction="rs", rs_threshold_lower=0.2), old,
                         behaviour, given)
    np.testing.assert_array_equal(keep, [[True, False, True, False]])
    for correction in ("none", "mis", "tis", "geo-rs"):  # no RS (a menu mask is its own)
        assert rs_token_mask(PolicyLossConfig(correction=correction), old, behaviour,
                             given) is given


def test_rs_mask_reaches_sis_and_gspo_sequence_mean():
    # GSPO seq mean over the kept tokens only: log ratios [1, 3], token 1 rejected by RS ->
    # s = e^1 (not e^2); loss = -A s over the one kept token
    old = jnp.full((1, 2), -5.0)
    logp = old + jnp.array([[1.0, 3.0]])
    behaviour = old - jnp.log(jnp.array([[1.0, 4.0]]))
    cfg = PolicyLossConfig(algo="gspo", correction="rs", clip_eps_low=1.0, clip_eps_high=INF)
    loss, m, grad = loss_grad(cfg, logp, old, jnp.array([-1.0]), jnp.ones((1, 2), bool),
                              behaviour_logp=behaviour)
    assert loss == pytest.approx(np.e, rel=1e-6) and m["d_original"] == pytest.approx(1.0)
    np.testing.assert_allclose(grad, [[np.e, 0]], rtol=1e-6)


# ----------------------------------------------------------------------------- SIS + clip


@pytest.mark.parametrize("algo", ["grpo", "dapo", "gspo", "cispo", "sa_gcpo"])
def test_accepted_token_gets_on_policy_gradient_past_the_log_ratio_clip(algo):
    # log ratios 25 (beyond the +-20 clip) and 0.1, both forced accepted (u = 0), A = 1:
    # ratio value 1 and gradient -A / n = -0.5 for both tokens
    old = jnp.full((1, 2), -30.0)
    logp = old + jnp.array([[25.0, 0.1]])
    topk = jnp.zeros((1, 2, 1))
    kw = dict(uniforms=jnp.zeros((1, 2)), old_topk_logp=topk, new_topk_logp=topk)
    loss, m, grad = loss_grad(PolicyLossConfig(algo=algo, correction="sis"), logp, old,
                              jnp.array([1.0]), jnp.ones((1, 2), bool), **kw)
    assert m["accept_rate"] == 1.0
    np.testing.assert_allclose(grad, [[-0.5, -0.5]], rtol=1e-6)
    # the authors' form log_w - sg(log_w) has the clip's zero gradient there; same value
    log_w = jnp.clip(logp - old, -20, 20)
    accept = jnp.ones((1, 2), bool)
    g_fork = jax.grad(lambda lp: jnp.sum(sis_log_ratio(jnp.clip(lp - old, -20, 20), accept)))(logp)
    g_raw = jax.grad(lambda lp: jnp.sum(sis_log_ratio(jnp.clip(lp - old, -20, 20), accept,
                                                      lp - old)))(logp)
    np.testing.assert_array_equal(g_fork, [[0.0, 1.0]])
    np.testing.assert_array_equal(g_raw, [[1.0, 1.0]])
    np.testing.assert_array_equal(sis_log_ratio(log_w, accept, logp - old), [[0.0, 0.0]])


# ----------------------------------------------------------------------------- D metrics


def test_d_metrics_token_and_sequence_means():
    # row 0: log ratios 0.3 (accepted), -0.6, 0.9; row 1: -25 (clipped to -20), then masked
    old = jnp.full((2, 3), -30.0)
    logp = old + jnp.array([[0.3, -0.6, 0.9], [-25.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    topk = jnp.zeros((2, 3, 1))  # envelope max(0, log_w)
    uniforms = jnp.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])  # 0 accepts, 1 rejects
    _, m, _ = loss_grad(PolicyLossConfig(correction="sis"), logp, old, jnp.array([1.0, 1.0]),
                        mask, uniforms=uniforms, old_topk_logp=topk, new_topk_logp=topk)
    assert m["accept_rate"] == pytest.approx(0.25)
    assert m["d_original"] == pytest.approx((0.3 + 0.6 + 0.9 + 20) / 4, rel=1e-5)
    assert m["d_sis"] == pytest.approx((0.6 + 0.9 + 20) / 4, rel=1e-5)
    assert m["d_original_seq_nonempty"] == pytest.approx((0.6 + 20) / 2, rel=1e-5)
    assert m["d_sis_seq_nonempty"] == pytest.approx(((0.6 + 0.9) / 3 + 20) / 2, rel=1e-5)


# ----------------------------------------------------------------------------- overlong


def test_overlong_penalty_hand_computed():
    # cap 3, buffer 2: expected length 1; lengths 1, 2, 3 exceed by 0, 1, 2 -> 0, -.5, -1 (x f)
    np.testing.assert_allclose(overlong_penalty(jnp.array([1, 2, 3]), 3, 2, 1.0),
                               [0.0, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(jnp.array([0, 3]), 3, 2, 0.5), [0.0, -0.5])
    with pytest.raises(ValueError, match=r"buffer_len=4 must lie in \[1, max_response_length=3"):
        overlong_penalty(jnp.array([1]), 3, 4, 1.0)
    with pytest.raises(ValueError, match=r"overlong_buffer.len=0"):
        OverlongBufferConfig(len=0)


# ----------------------------------------------------------------------------- dynamic sampling


def _fake_batch(gen_batch, rewards, group_size):
    """Rows tagged (generation batch, row) in prompts so the selection can be checked."""
    b = len(rewards)
    tags = np.stack([np.full(b, gen_batch), np.arange(b)], axis=1).astype(np.int32)
    return RolloutBatch(tags, np.ones(b, np.int32), np.zeros((b, 2), np.int32),
                        np.ones((b, 2), np.float32), np.zeros((b, 2), np.float32),
                        np.asarray(rewards, np.float32))


def test_fill_groups_drops_all_equal_groups_and_refills_to_the_batch_size():
    # G = 2, 3 groups per rollout; batch 0 has 1 group with signal (group 1), batch 1 two
    # (groups 0 and 2), batch 2 would have three but is never generated
    rewards = [[1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 0]]
    calls = []

    def generate(i):
        calls.append(i)
        batch = _fake_batch(i, rewards[i], 2)
        return batch, batch.rewards

    np.testing.assert_array_equal(groups_with_signal(np.array(rewards[0]), 2),
                                  [False, True, False])
    batch, stats = fill_groups(generate, num_groups=3, group_size=2, max_num_gen_batches=10)
    assert calls == [0, 1]
    assert stats == {"num_gen_batches": 2, "groups_generated": 6, "groups_with_signal": 3}
    assert batch.rewards.shape == (6,) and all(len(x) == 6 for x in batch)
    np.testing.assert_array_equal(batch.prompts, [[0, 2], [0, 3], [1, 0], [1, 1], [1, 4],
                                                  [1, 5]])
    # more groups with signal than needed: the first 3 are kept (verl's batch[:traj_bsz])
    batch, stats = fill_groups(lambda i: generate(2), num_groups=2, group_size=2,
                               max_num_gen_batches=0)
    np.testing.assert_array_equal(batch.prompts[:, 1], [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"found 1 of the 3 groups .* in 1 generation "
                                         r"batches \(max_num_gen_batches=1\)"):
        fill_groups(generate, num_groups=3, group_size=2, max_num_gen_batches=1)
