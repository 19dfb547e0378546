"""Generation / Q2I / the RL stage's SA-GCPO losses against numpy; IGR keeps exactly m."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.genrec import igr
from jaxflow.genrec.losses import generation_loss, q2i_loss


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_generation_loss_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 3, 7)).astype(np.float32)
    tgt = rng.integers(0, 7, (5, 3))
    w = np.asarray([1, 2, 3, 1, 0], np.float32)
    nll = -np.take_along_axis(_log_softmax(logits.astype(np.float64)), tgt[..., None], -1)[..., 0]
    want = (w[:, None] * nll).sum() / (w.sum() * 3)
    got = generation_loss(jnp.asarray(logits), jnp.asarray(tgt), jnp.asarray(w))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    np.testing.assert_allclose(float(generation_loss(jnp.asarray(logits), jnp.asarray(tgt))),
                               nll.mean(), rtol=1e-6)


def test_q2i_loss_matches_numpy():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((6, 4))
    k = rng.standard_normal((6, 4))
    ids = np.asarray([0, 1, 2, 1, 3, 4])
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=1, keepdims=True)
    logits = qn @ kn.T / 0.2
    want = -np.mean(np.diag(_log_softmax(logits)))
    got = q2i_loss(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), temperature=0.2)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # duplicate targets (rows 1 and 3 share item 1) are not each other's negatives
    masked = logits.copy()
    masked[1, 3] = masked[3, 1] = -np.inf
    want = -np.mean(np.diag(_log_softmax(masked)))
    got = q2i_loss(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                   item_ids=jnp.asarray(ids), temperature=0.2)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_rl_stage_loss_is_sa_gcpo_against_numpy():
    """The RL stage's loss (the project's policy_loss, algo="sa_gcpo") and advantages against
    the OxygenREC formulas in numpy; on policy its gradient is the plain policy gradient."""
    from jaxflow.genrec.rl import RLConfig, _policy_loss
    from jaxflow.rl.advantages import sa_gcpo_advantages

    rng = np.random.default_rng(2)
    r = rng.random((3, 4)).astype(np.float32)
    target = np.asarray([0.5, 0.0, 0.9], np.float32)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    adv = np.where((adv > 0) & (r < target[:, None]), 0.0, adv)
    got_adv = sa_gcpo_advantages(jnp.asarray(r.reshape(-1)),
                                 jnp.asarray(np.repeat(target, 4)), 4)
    np.testing.assert_allclose(np.asarray(got_adv), adv.reshape(-1), rtol=1e-5, atol=1e-6)
    logp = rng.normal(-1, 0.3, (12, 3)).astype(np.float32)
    old = logp + rng.normal(0, 0.2, (12, 3)).astype(np.float32)
    mask = rng.random((12, 3)) > 0.2
    mask[5] = False  # a sequence with no token (an empty beam) does not count
    a = adv.reshape(-1)
    rho = np.exp(logp - old)
    tau = np.where(a > 0, 2.0, 5.0)[:, None]
    f = 4.0 / tau / (1.0 + np.exp(-tau * (rho - 1.0)))
    rows = mask.any(1)
    per = (f * mask).sum(1)[rows] / mask.sum(1)[rows]
    want = -np.mean(per * a[rows])
    cfg = RLConfig()
    loss, _ = _policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(a),
                           jnp.asarray(mask), cfg)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    g = jax.grad(lambda lp: _policy_loss(lp, jnp.asarray(logp), jnp.asarray(a),
                                         jnp.asarray(mask), cfg)[0])(jnp.asarray(logp))
    want_g = -(a[:, None] * mask / np.maximum(mask.sum(1, keepdims=True), 1)) / rows.sum()
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-7)


def test_igr_keeps_exactly_m_in_chronological_order():
    rng = np.random.default_rng(3)
    for h, m in ((10, 4), (3, 5)):  # m <= H and m > H (padding slots)
        scores = rng.standard_normal((64, h)).astype(np.float32)
        valid = rng.random((64, h)) < rng.random((64, 1))  # 0 .. H valid entries per row
        idx, kept = igr.top_m_indices(jnp.asarray(scores), jnp.asarray(valid), m)
        idx, kept = np.asarray(idx), np.asarray(kept)
        assert idx.shape == kept.shape == (64, m)
        for b in range(64):
            n_valid = int(valid[b].sum())
            assert kept[b].sum() == min(m, n_valid)  # exactly m when the history has m
            chosen = idx[b][kept[b]]
            assert (np.diff(chosen) > 0).all()  # chronological, distinct
            assert valid[b][chosen].all()
            best = np.sort(np.where(valid[b], scores[b], -np.inf))[::-1][:min(m, n_valid)]
            np.testing.assert_allclose(np.sort(scores[b][chosen])[::-1], best)
    idx, kept = igr.recency_indices(jnp.asarray([[True, True, True, False]]), 2)
    assert np.asarray(idx).tolist() == [[1, 2]] and np.asarray(kept).all()


def test_igr_gate_is_one_with_a_gradient():
    s = jnp.asarray([0.3, -0.2])
    np.testing.assert_array_equal(np.asarray(igr.straight_through_gate(s)), [1.0, 1.0])
    g = jax.grad(lambda x: igr.straight_through_gate(x).sum())(s)
    assert (np.abs(np.asarray(g)) > 0).all()
