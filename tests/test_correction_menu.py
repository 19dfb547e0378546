"""The correction menu (jaxflow.rl.correction_menu) equals each reference implementation.

Every reference below is an independent float64 numpy re-implementation of the named file's math
(never its code), with the gradient of the loss in ``logp`` written out by hand; jaxflow's
``policy_loss`` (x64) must match loss and gradient within 1e-8 on the same inputs. The shared PPO
part (clip 0.2, dual clip c = 3, token-mean) is the one all three PPO references compute.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl.correction_menu import MENU, CorrectionMenuConfig, m2po_keep_mask, menu_correction
from jaxflow.rl.policy_loss import CORRECTIONS, PolicyLossConfig, policy_loss

TOL = 1e-8
NEMO = "NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909"
VERL = "volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7"
AREAL = "inclusionAI/AReaL@4aef98d8d818af55b43621aaadba047ae10f4e77"
PRIME = "PrimeIntellect-ai/prime-rl@bf71516c9154e4da2f2b92396d80045b271f46a3"


def _inputs(seed: int = 0):
    """Eight rows of eight tokens whose behaviour gaps exercise every bound (rho = pi_old / mu):
    row 0 tiny (kept by all); rows 1 / 6 geo-mean 1.0015 / 0.9985 (out of verl's Geo-RS band below
    / above, in / out of NeMo-RL's seq-mask-TIS band); row 2 geo-mean 1 with moderate noise
    and rho ~4 (IcePop's 0.5-5, TIS's cap 2); row 3 large noise, rho 5.3, 9 and 0.11 (AReaL's 5,
    prime-rl's 0.125-8); row 4 geo-mean ~0.095 with tokens at 0.22 (prime-rl's geo mask); rows
    5 / 7 geo-mean ~7.4 / 4.5 (AReaL's stage 1)."""
    rng = np.random.default_rng(seed)
    B, T = 8, 8
    old = -rng.uniform(0.05, 3.0, (B, T))
    log_rho = np.stack([rng.normal(0, 1e-4, T), 0.0015 + rng.normal(0, 1e-4, T), rng.normal(0, 0.6, T),
                        rng.normal(0, 2.0, T), np.tile([-1.5, -3.2], T // 2) + rng.normal(0, 0.02, T),
                        2.0 + rng.normal(0, 0.3, T), -0.0015 + rng.normal(0, 1e-4, T),
                        math.log(4.5) + rng.normal(0, 0.05, T)])
    log_rho[2, 0], log_rho[3, 1:4] = math.log(4.5), np.log([5.3, 9.0, 0.11])
    log_rho[2, :6] -= log_rho[2, :6].mean()  # geo-mean exactly 1 (kept by Geo-RS) with rho > 2 (TIS bites)
    behaviour = old - log_rho
    logp = old + rng.normal(0, 0.3, (B, T))
    logp[1, 2] = old[1, 2] + 1.5  # r = 4.5 with a negative advantage: the dual clip
    adv = np.array([0.7, -1.2, 0.4, -0.5, 1.1, -0.9, 0.8, -0.3])
    mask = np.arange(T)[None, :] < np.array([8, 8, 6, 8, 6, 7, 8, 8])[:, None]
    return logp, old, behaviour, adv, mask


def _ppo(logp, old, adv, eps=0.2, c=3.0):
    """Per-token PPO loss with the dual clip and its derivative in logp: ``max(-A r, -A clip(r))``,
    then ``min(., -A c)`` where A < 0 (verl ``compute_policy_loss_vanilla``, NeMo-RL
    ``ClippedPGLossFn``, AReaL ``ppo_actor_loss_fn``)."""
    r = np.exp(logp - old)
    a = adv[:, None] * np.ones_like(r)
    loss1, loss2 = -a * r, -a * np.clip(r, 1 - eps, 1 + eps)
    loss = np.maximum(loss1, loss2)
    grad = np.where((loss1 >= loss2) | ((r > 1 - eps) & (r < 1 + eps)), -a * r, 0.0)
    dual = (a < 0) & (loss > -a * c)
    return np.where(dual, -a * c, loss), np.where(dual, 0.0, grad)


def _jaxflow(correction, logp, old, behaviour, adv, mask, **cfg):
    with jax.enable_x64(True):
        config = PolicyLossConfig(correction=correction, **cfg)

        def f(lp):
            return policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), config=config,
                               behaviour_logp=jnp.asarray(behaviour))[0]

        loss, grad = jax.value_and_grad(f)(jnp.asarray(logp))
        assert loss.dtype == jnp.float64
        return float(loss), np.asarray(grad)


def _check(correction, ref, inputs=None, **cfg):
    inputs = _inputs() if inputs is None else inputs
    ref_loss, ref_grad = ref(*inputs)
    loss, grad = _jaxflow(correction, *inputs, **cfg)
    assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
    np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=TOL)
    assert np.abs(ref_grad).max() > 0


def _nemo_masked_mean(x, mask, axis=None):
    return np.sum(x * mask, axis=axis) / (np.sum(mask, axis=axis) + 1e-8)


def nemo_icepop(logp, old, behaviour, adv, mask, low=0.5, high=5.0):
    """NeMo-RL nemo_rl/algorithms/loss/loss_functions.py, ``truncated_importance_sampling_type:
    icepop`` (token-level loss), at NEMO: weight exp(prev - generation) zeroed outside [min, max]."""
    w = np.exp(old - behaviour)
    w = np.where((w >= low) & (w <= high), w, 0.0)
    loss, grad = _ppo(logp, old, adv)
    n = mask.sum() + 1e-8
    return _nemo_masked_mean(w * loss, mask), w * grad * mask / n


def nemo_seq_mask_tis(logp, old, behaviour, adv, mask, low=0.999, high=1.002):
    """NeMo-RL nemo_rl/algorithms/loss/loss_functions.py, ``seq-mask-tis`` at NEMO: rows whose
    exp(masked mean of log(prev / generation)) is outside [min, max] weigh 0, others raw ratios."""
    log_is = old - behaviour
    geo = np.exp(_nemo_masked_mean(log_is, mask, axis=-1))
    keep = ((geo >= low) & (geo <= high)).astype(float)[:, None]
    w = np.exp(log_is) * keep
    loss, grad = _ppo(logp, old, adv)
    n = mask.sum() + 1e-8
    return _nemo_masked_mean(w * loss, mask), w * grad * mask / n


def verl_geo_rs(logp, old, behaviour, adv, mask, lower=0.999, upper=1.001, is_threshold=None, seq_is=False):
    """verl verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_rejection_mask`` with
    ``rollout_rs="seq_mean_k1"``, threshold "0.999_1.001" (preset ``decoupled_geo_rs``; with
    ``is_threshold``, ``compute_rollout_correction_weights``' token IS weights of
    ``decoupled_geo_rs_token_tis``, or with ``seq_is`` the sequence ones of
    ``decoupled_geo_rs_seq_tis``), then core_algos.py ``compute_policy_loss_vanilla`` token-mean
    over the modified mask, at VERL."""
    log_ratio = np.clip(old - behaviour, -20, 20)
    stat = np.sum(-log_ratio * mask, -1) / (mask.sum(-1) + 1e-8)
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    new_mask = mask * keep[:, None]
    w = np.ones_like(old)
    if is_threshold is not None and seq_is:
        seq = np.clip(np.sum((old - behaviour) * mask, -1, keepdims=True), -20, 20)
        w = np.minimum(np.exp(seq) * mask, is_threshold)
    elif is_threshold is not None:
        w = np.minimum(np.exp(log_ratio) * mask, is_threshold)
    loss, grad = _ppo(logp, old, adv)
    n = new_mask.sum()
    return np.sum(w * loss * new_mask) / n, w * grad * new_mask / n


def _areal_rs(log_ratio, loss_mask, level, upper, lower=None):
    """AReaL areal/utils/functional/functional.py ``apply_rejection_sampling`` (2D, metric ratio,
    action mask, agg mean) at AREAL: (updated mask, behave_imp_weight)."""
    def bounds(x):
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper
    weight = np.exp(log_ratio)
    if level == "sequence":
        seq_log_mean = np.sum(np.where(loss_mask, log_ratio, 0), -1, keepdims=True) / np.maximum(
            loss_mask.sum(-1, keepdims=True), 1)
        weight = np.broadcast_to(np.exp(seq_log_mean), log_ratio.shape)
        in_bounds = np.broadcast_to(bounds(np.exp(seq_log_mean)), log_ratio.shape)
    else:
        in_bounds = bounds(weight)
    updated = loss_mask & in_bounds
    return updated, np.where(updated, weight, 0.0)


def areal_two_stage(logp, old, behaviour, adv, mask, upper=5.0):
    """AReaL's two-stage Geo-RS + token MIS (areal-project/AReaL PR #1218): the merged
    ``apply_rejection_sampling`` at AREAL run at level "sequence" then "token" on the updated mask,
    inside ``ppo_actor_loss_fn`` (denominator: the loss mask's count before rejection)."""
    log_ratio = old - behaviour
    stage1, _ = _areal_rs(log_ratio, mask, "sequence", upper)
    stage2, w = _areal_rs(log_ratio, stage1, "token", upper)
    loss, grad = _ppo(logp, old, adv)
    n = max(mask.sum(), 1)
    return np.sum(np.where(stage2, loss * w, 0)) / n, np.where(stage2, grad * w, 0) / n


def _areal_m2po_mask(old, behaviour, mask, threshold):
    """AReaL areal/trainer/ppo/actor.py ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` at
    AREAL: drop the largest second moments until the suffix mean is below the threshold."""
    m2 = ((behaviour - old) ** 2)[mask]
    order = np.argsort(-m2, kind="stable")
    sorted_m2 = m2[order]
    suffix_avg = np.cumsum(sorted_m2[::-1])[::-1] / np.arange(len(m2), 0, -1)
    below = np.nonzero(suffix_avg < threshold)[0]
    k = below[0] if len(below) else len(m2) - 1
    keep_sorted = np.arange(len(m2)) >= k
    keep = np.zeros(len(m2), bool)
    keep[order] = keep_sorted
    out = np.zeros_like(mask)
    out[mask] = keep
    return out


def areal_m2po(logp, old, behaviour, adv, mask, threshold=0.04, token_upper=None):
    """AReaL M2PO (``_apply_m2po_masking`` then ``ppo_actor_loss_fn``) at AREAL; with
    ``token_upper`` the gsm8k_m2po.yaml recipe's token rejection sampling (ratio, upper 5)."""
    m2_mask = _areal_m2po_mask(old, behaviour, mask, threshold)
    n = max(m2_mask.sum(), 1)
    final, w = m2_mask, np.ones_like(old)
    if token_upper is not None:
        final, w = _areal_rs(old - behaviour, m2_mask, "token", token_upper)
    loss, grad = _ppo(logp, old, adv)
    return np.sum(np.where(final, loss * w, 0)) / n, np.where(final, grad * w, 0) / n


def prime_masks(logp, old, behaviour, adv, mask, token=(0.125, 8.0), geo=(0.1, 10.0), seq=(0.0, 100.0)):
    """prime-rl src/prime_rl/trainer/rl/loss.py ``default_loss_fn`` (ratio_type token, kl_tau 0,
    adv_tau 1) per row, summed and divided by the batch's loss-mask count (``loss_scale``), at
    PRIME; the trainer's log-probs are pi_old's (the first update of a rollout)."""
    total, grad = 0.0, np.zeros_like(logp)
    for i in range(len(logp)):
        m = mask[i]
        log_ir = logp[i] - behaviour[i]
        ratio = np.exp(log_ir)
        geo_ratio = np.exp(log_ir[m].sum() / max(m.sum(), 1))
        is_masked = ((ratio < token[0]) | (ratio > token[1]) | (geo_ratio < geo[0]) | (geo_ratio > geo[1])
                     | (np.where(m, ratio, np.inf).min() < seq[0]) | (np.where(m, ratio, -np.inf).max() > seq[1]))
        keep = m & ~is_masked
        coeff = ratio * adv[i]
        total += -(coeff * logp[i])[keep].sum()
        grad[i] = np.where(keep, -coeff, 0.0)
    n = max(mask.sum(), 1)
    return total / n, grad / n


PPO = dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)


def test_icepop_equals_nemo_rl():
    _check("icepop", nemo_icepop, **PPO)


def test_icepop_is_mis_with_nemo_rl_bounds():
    logp, old, behaviour, adv, mask = _inputs(2)
    icepop = _jaxflow("icepop", logp, old, behaviour, adv, mask)
    mis = _jaxflow("mis", logp, old, behaviour, adv, mask, mis_low=0.5, mis_high=5.0)
    assert icepop[0] == mis[0]
    np.testing.assert_array_equal(icepop[1], mis[1])


def test_seq_mask_tis_equals_nemo_rl():
    _check("seq-mask-tis", nemo_seq_mask_tis, **PPO)


def test_geo_rs_equals_verl_seq_mean_k1():
    _check("geo-rs", verl_geo_rs, **PPO)
    _check("geo-rs+tis", lambda *a: verl_geo_rs(*a, is_threshold=2.0), **PPO)
    _check("geo-rs+seq-tis", lambda *a: verl_geo_rs(*a, is_threshold=2.0, seq_is=True), **PPO)
    # a band as wide as verl's token RS default ("0.5_2.0") and rows 2 / 6 with sequence ratios
    # ~2.05 / ~1.7: the sequence cap bites on one of them
    wide = CorrectionMenuConfig(geo_rs_low=0.5, geo_rs_high=2.0)
    logp, old, behaviour, adv, mask = _inputs()
    behaviour = behaviour - np.array([0, 0, 0.12, 0, 0, 0, 0.066, 0])[:, None]
    _check("geo-rs+seq-tis", lambda *a: verl_geo_rs(*a, lower=0.5, upper=2.0, is_threshold=2.0, seq_is=True),
           (logp, old, behaviour, adv, mask), menu=wide, **PPO)


def test_geo_rs_token_mis_equals_areal_two_stage():
    _check("geo-rs+token-mis", areal_two_stage, **PPO)


def test_m2po_equals_areal():
    _check("m2po", areal_m2po, **PPO)
    _check("m2po+mis", lambda *a: areal_m2po(*a, token_upper=5.0), **PPO)
    menu = CorrectionMenuConfig(m2po_threshold=1.0)  # loose enough that the token stage bites
    _check("m2po", lambda *a: areal_m2po(*a, threshold=1.0), menu=menu, **PPO)
    _check("m2po+mis", lambda *a: areal_m2po(*a, threshold=1.0, token_upper=5.0), menu=menu, **PPO)


def test_prime_masks_equal_prime_rl():
    logp, old, behaviour, adv, mask = _inputs(1)
    cfg = dict(algo="cispo", clip_eps_low=1.0, clip_eps_high=float("inf"), dual_clip_c=None)
    _check("prime-masks", prime_masks, (old.copy(), old, behaviour, adv, mask), **cfg)
    # the sequence max mask (off at 100 by default) masks row 3 whole at 5
    menu = CorrectionMenuConfig(prime_seq_high=5.0)
    _check("prime-masks", lambda *a: prime_masks(*a, seq=(0.0, 5.0)), (old.copy(), old, behaviour, adv, mask),
           menu=menu, **cfg)


def test_each_bound_bites_on_the_shared_inputs():
    """The equality tests above are not vacuous: each correction masks some tokens and keeps some."""
    _, old, behaviour, _, mask = _inputs()
    with jax.enable_x64(True):
        for name in MENU:
            out = menu_correction(name, CorrectionMenuConfig(), jnp.asarray(old), jnp.asarray(behaviour),
                                  jnp.asarray(mask), tis_cap=2.0)
            masked, kept = int(out.masked.sum()), int((mask & ~np.asarray(out.masked)).sum())
            assert 0 < masked < mask.sum() and kept > 0, (name, masked)


def test_m2po_always_keeps_one_token_and_nothing_when_all_masked():
    old = jnp.zeros((2, 3))
    behaviour = jnp.full((2, 3), -5.0)  # every m2 = 25 > threshold: all but one leave
    keep = m2po_keep_mask(old, behaviour, jnp.ones((2, 3), bool), 0.04)
    assert int(keep.sum()) == 1
    assert not bool(m2po_keep_mask(old, behaviour, jnp.zeros((2, 3), bool), 0.04).any())


def test_menu_is_selectable_and_bounds_are_checked():
    assert set(MENU) <= set(CORRECTIONS)
    cfg = PolicyLossConfig(correction="icepop")
    assert cfg.needs_behaviour_logp and cfg.behaviour_correction is None and not cfg.uses_rs
    assert PolicyLossConfig(correction="geo-rs+tis").behaviour_correction is None  # TIS once, from the menu
    with pytest.raises(ValueError, match="icepop_low < icepop_high"):
        CorrectionMenuConfig(icepop_low=6.0)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones((1, 2)), config=cfg)
