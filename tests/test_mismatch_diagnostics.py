"""Mismatch diagnostics (jaxflow.rl.mismatch_metrics) on crafted inputs with known answers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl.correction_menu import MENU, CorrectionMenuConfig, menu_correction
from jaxflow.rl.mismatch_metrics import correction_shares, mismatch_kl, mismatch_metrics
from jaxflow.rl.policy_loss import PolicyLossConfig


def test_k3_mean_is_the_exact_kl_when_samples_follow_mu():
    """Four tokens drawn in exactly mu's proportions (0.5, 0.25, 0.25): the k3 token mean equals
    KL(mu || pi_old) = sum mu log(mu / pi) exactly; k1 too. Masked junk (inf, nan) is ignored."""
    mu, pi = np.array([0.5, 0.25, 0.25]), np.array([0.2, 0.5, 0.3])
    drawn = np.array([0, 0, 1, 2])
    behaviour = np.log(mu[drawn])[None]
    old = np.log(pi[drawn])[None]
    behaviour = np.concatenate([behaviour, [[np.inf]]], axis=1)
    old = np.concatenate([old, [[np.nan]]], axis=1)
    mask = np.array([[1, 1, 1, 1, 0]], np.float32)
    with jax.enable_x64(True):
        k3, k1 = mismatch_kl(jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask))
    kl = float(np.sum(mu * np.log(mu / pi)))
    assert float(k3) == pytest.approx(kl, abs=1e-12)
    assert float(k1) == pytest.approx(kl, abs=1e-12)


def test_k3_is_non_negative_per_token_and_zero_without_mismatch():
    old = jnp.asarray([[-1.0, -2.0, -0.5]])
    k3, k1 = mismatch_kl(old, old, jnp.ones((1, 3)))
    assert float(k3) == 0 and float(k1) == 0
    k3, k1 = mismatch_kl(old, old + jnp.asarray([[0.5, -0.5, 0.0]]), jnp.ones((1, 3)))
    assert float(k1) == pytest.approx(0.0, abs=1e-7)  # k1's +-0.5 cancel ...
    rho = np.exp([-0.5, 0.5])
    assert float(k3) == pytest.approx(np.sum(rho - 1 - np.log(rho)) / 3, rel=1e-6)  # ... k3's don't


def test_log_ratio_quantiles_match_numpy_over_the_mask():
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.5, (4, 9))
    behaviour = old - rng.normal(0, 0.3, (4, 9))
    mask = rng.random((4, 9)) < 0.7
    behaviour[~mask] = -np.inf  # junk where masked
    m = mismatch_metrics(jnp.asarray(old, jnp.float32), jnp.asarray(behaviour, jnp.float32), jnp.asarray(mask))
    log_rho = (old - behaviour)[mask]
    for q in (5, 50, 95):
        assert float(m[f"mismatch/log_ratio_p{q:02d}"]) == pytest.approx(np.percentile(log_rho, q), abs=1e-5)
    assert float(m["mismatch/abs_log_ratio_max"]) == pytest.approx(np.abs(log_rho).max(), abs=1e-5)
    assert "mismatch/masked_fraction/rs" not in m  # no config: no correction shares


def _rho_batch(rhos, lengths=None):
    rhos = np.asarray(rhos, np.float64)
    old = np.full(rhos.shape, -1.0)
    mask = np.ones(rhos.shape, bool) if lengths is None else np.arange(rhos.shape[1]) < np.asarray(lengths)[:, None]
    return jnp.asarray(old, jnp.float32), jnp.asarray(old - np.log(rhos), jnp.float32), jnp.asarray(mask)


@pytest.mark.parametrize("correction, key, share", [
    ("tis", "clipped_fraction/tis", 2 / 7),       # rho 3 and 9 exceed the cap 2
    ("mis", "masked_fraction/mis", 3 / 7),        # outside [0.5, 2]: 0.4, 3, 9
    ("rs", "masked_fraction/rs", 3 / 7),          # the same band, removed from the mask
    ("icepop", "masked_fraction/icepop", 2 / 7),  # outside [0.5, 5]: 0.4, 9
    ("prime-masks", "masked_fraction/prime-masks", 1 / 7),  # 9 > 8 (row 0 geo-mean 1.9 and max 9 pass)
])
def test_correction_shares_count_what_each_correction_drops(correction, key, share):
    # row 0: 0.4, 9 (and a padded 100, masked); row 1: 1, 1.5, 3, 1, 1.2
    old, behaviour, mask = _rho_batch([[0.4, 9.0, 100.0, 1.0, 1.0], [1.0, 1.5, 3.0, 1.0, 1.2]], lengths=[2, 5])
    out = correction_shares(PolicyLossConfig(correction=correction), old, behaviour, mask)
    assert list(out) == [f"mismatch/{key}"]
    assert float(out[f"mismatch/{key}"]) == pytest.approx(share, abs=1e-6)


def test_combined_corrections_report_each_part_and_sis_reports_none():
    old, behaviour, mask = _rho_batch([[0.4, 9.0, 1.0, 3.0]])
    out = correction_shares(PolicyLossConfig(correction="tis+rs"), old, behaviour, mask)
    assert float(out["mismatch/masked_fraction/rs"]) == pytest.approx(0.75)
    assert float(out["mismatch/clipped_fraction/tis"]) == pytest.approx(0.5)
    assert correction_shares(PolicyLossConfig(correction="sis"), old, behaviour, mask) == {}
    assert correction_shares(PolicyLossConfig(correction="none"), old, behaviour, mask) == {}


@pytest.mark.parametrize("correction", MENU)
def test_menu_share_is_the_share_the_loss_drops(correction):
    """The diagnostic counts exactly the tokens the loss's menu correction removes or weighs 0."""
    rng = np.random.default_rng(3)
    old = rng.normal(-1.5, 0.5, (5, 6))
    behaviour = old - rng.normal(0, 1.0, (5, 6)) * np.array([1e-4, 1e-3, 0.5, 1.5, 3.0])[:, None]
    mask = np.arange(6) < np.array([6, 6, 4, 6, 5])[:, None]
    out = correction_shares(PolicyLossConfig(correction=correction), jnp.asarray(old), jnp.asarray(behaviour),
                            jnp.asarray(mask))
    menu = menu_correction(correction, CorrectionMenuConfig(), jnp.asarray(np.where(mask, old, 0)),
                           jnp.asarray(np.where(mask, behaviour, 0)), jnp.asarray(mask), tis_cap=2.0)
    keep, weights = np.asarray(menu.keep), np.asarray(menu.weights)
    dropped = mask & (~keep | (weights == 0))
    assert float(out[f"mismatch/masked_fraction/{correction}"]) == pytest.approx(dropped.sum() / mask.sum())
    assert 0 < dropped.sum() < mask.sum()


def test_metrics_are_jittable_and_empty_mask_gives_zeros():
    cfg = PolicyLossConfig(correction="geo-rs+tis")
    old, behaviour, _ = _rho_batch([[0.4, 9.0, 1.0, 3.0]])
    f = jax.jit(lambda o, b, m: mismatch_metrics(o, b, m, config=cfg))
    m = f(old, behaviour, jnp.zeros((1, 4), bool))
    assert set(m) >= {"mismatch/kl", "mismatch/log_ratio_p05", "mismatch/masked_fraction/geo-rs+tis",
                      "mismatch/clipped_fraction/tis"}
    assert all(float(v) == 0 for v in m.values())
    full = f(old, behaviour, jnp.ones((1, 4), bool))
    assert float(full["mismatch/kl"]) == pytest.approx(np.mean([r - 1 - math.log(r) for r in (0.4, 9, 1, 3)]), rel=1e-5)


def test_grpo_loss_reports_the_diagnostics_and_geo_rs_rows_leave_every_term():
    """In the GRPO update: Geo-RS rejecting rows 0 and 3 (mu 5 nats above pi_old) gives the loss
    and the entropy term of the same batch without those rows, and the rows' share as its masked
    fraction."""
    import functools

    from jaxflow.mesh import role_meshes
    from jaxflow.models.transformer import TransformerConfig
    from jaxflow.rl.grpo import GRPOConfig, grpo_loss
    from jaxflow.rl.grpo_step import MiniBatch, old_stats
    from jaxflow.train.lm_state import init_params, lm_functions

    model = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=16)
    cfg = GRPOConfig(prompts_per_rollout=2, group_size=4, max_new_tokens=4, sis_topk=4, entropy_coef=0.05,
                     loss=PolicyLossConfig(correction="geo-rs"))
    fns = lm_functions(model, role_meshes({"trainer": 1})["trainer"])
    params = init_params(fns, model, jax.random.key(0))
    rng = np.random.default_rng(0)
    b, n = 8, 4
    mask = (np.arange(n)[None] < rng.integers(1, n + 1, size=(b, 1))).astype(np.float32)
    mb = MiniBatch(prompts=jnp.asarray(rng.integers(3, 23, size=(b, 5)), jnp.int32),
                   prompt_lengths=jnp.asarray(rng.integers(2, 6, size=b), jnp.int32),
                   tokens=jnp.asarray(rng.integers(3, 23, size=(b, n)), jnp.int32), mask=jnp.asarray(mask),
                   behaviour_logp=jnp.zeros((b, n), jnp.float32),
                   advantages=jnp.asarray(rng.normal(size=b), jnp.float32))
    old = old_stats(fns, params, None, mb, config=cfg)
    moved = jax.tree.map(lambda x: x * 1.1, params)
    reject = np.isin(np.arange(b), [0, 3])[:, None]
    loss_fn = jax.jit(functools.partial(grpo_loss, fns=fns, config=cfg, key=jax.random.key(0)))
    rejected = jax.device_get(loss_fn(moved, mb._replace(behaviour_logp=jnp.where(reject, old.logp + 5.0, old.logp)),
                                      old)[1])
    masked = jax.device_get(loss_fn(moved, mb._replace(behaviour_logp=old.logp, mask=mb.mask * ~reject), old)[1])
    for k in ("loss", "policy_loss", "entropy"):
        np.testing.assert_allclose(rejected[k], masked[k], rtol=1e-6, err_msg=k)
    share = mask[reject[:, 0]].sum() / mask.sum()
    assert rejected["mismatch/masked_fraction/geo-rs"] == pytest.approx(share)
    assert masked["mismatch/masked_fraction/geo-rs"] == 0 and masked["mismatch/kl"] == 0
    assert rejected["mismatch/kl"] == pytest.approx(share * (math.exp(-5.0) - 1 + 5.0), rel=1e-5)
