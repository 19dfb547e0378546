"""``sis_b``: SIS with the behaviour policy mu as its proposal (the rejection test on
pi_theta / mu, the envelope over mu's top-K), and the samplers' record of mu's top-K.

The equivalence it is built on: with mu == pi_old (the same sampled-token log-probs and the same
top-K log-probs) the test ``log u < log(pi_theta / mu) - log M_mu`` is the authors' test on
pi_theta / pi_old, so ``sis_b`` equals ``sis`` bit for bit (loss, metrics, gradient).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import PRESETS, SamplingConfig, Transformer, make_sampler
from jaxflow.rl import PolicyLossConfig, policy_loss
from jaxflow.rl.grpo_step import GRPOConfig, MiniBatch, OldStats, grpo_loss
from jaxflow.rl.rollout import RolloutBatch, RolloutSpec
from jaxflow.rl.sis import sis_uniforms
from jaxflow.train.lm_state import lm_functions

TOL = 1e-8


def _batch(seed, B=4, T=6, V=7, k=3, scale=0.5, mu_scale=0.4):
    """logp / old / behaviour [B, T], adv [B], mask, and the current / old / behaviour log-probs
    at the old's and at the behaviour's top-K tokens [B, T, K]. Tokens are drawn from mu."""
    rng = np.random.default_rng(seed)
    old_logits = rng.normal(size=(B, T, V))
    mu_logits = old_logits + mu_scale * rng.normal(size=(B, T, V))
    new_logits = old_logits + scale * rng.normal(size=(B, T, V))
    lsm = {n: jax.nn.log_softmax(jnp.asarray(x, jnp.float32))
           for n, x in (("old", old_logits), ("mu", mu_logits), ("new", new_logits))}
    tokens = jax.random.categorical(jax.random.key(seed), lsm["mu"])[..., None]
    take = lambda x, idx: jnp.take_along_axis(x, idx, axis=-1)  # noqa: E731
    top_old = jnp.argsort(-lsm["old"], axis=-1)[..., :k]
    top_mu = jnp.argsort(-lsm["mu"], axis=-1)[..., :k]
    mask = jnp.asarray(np.arange(T)[None] < rng.integers(2, T + 1, size=(B, 1)))
    return dict(logp=take(lsm["new"], tokens)[..., 0], old=take(lsm["old"], tokens)[..., 0],
                mu=take(lsm["mu"], tokens)[..., 0], adv=jnp.asarray(rng.normal(size=(B,)), jnp.float32),
                mask=mask, new_at_old=take(lsm["new"], top_old), old_topk=take(lsm["old"], top_old),
                new_at_mu=take(lsm["new"], top_mu), mu_topk=take(lsm["mu"], top_mu))


def _loss(correction, b, *, algo="grpo", behaviour="mu", behaviour_topk="mu_topk", new_topk=None,
          uniforms=None, key=None, logp=None):
    cfg = PolicyLossConfig(algo=algo, correction=correction)
    sis_b = correction == "sis_b"
    new_topk = new_topk or ("new_at_mu" if sis_b else "new_at_old")

    def f(lp):
        return policy_loss(lp, b["old"], b["adv"], b["mask"], config=cfg, key=key, uniforms=uniforms,
                           old_topk_logp=None if sis_b else b["old_topk"], new_topk_logp=b[new_topk],
                           behaviour_logp=b[behaviour], behaviour_topk_logp=b[behaviour_topk] if sis_b else None)
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(b["logp"] if logp is None else logp)
    return loss, metrics, grad


@pytest.mark.parametrize("algo", ["grpo", "dapo", "gspo", "cispo"])
def test_sis_b_equals_sis_when_behaviour_is_pi_old(algo):
    b = _batch(0)
    key = jax.random.key(3)
    ref = _loss("sis", b, algo=algo, key=key)
    # mu := pi_old, mu's top-K := pi_old's: the same test, the same envelope
    got = _loss("sis_b", b, algo=algo, key=key, behaviour="old", behaviour_topk="old_topk",
                new_topk="new_at_old")
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))
    for name in ref[1]:
        np.testing.assert_array_equal(np.asarray(got[1][name]), np.asarray(ref[1][name]), err_msg=name)
    assert 0 < float(ref[1]["accept_rate"]) < 1


def test_sis_b_tests_against_the_behaviour_policy():
    """The accept share is the one recomputed from pi_theta / mu and mu's envelope, and it is
    not SIS's (the data's mu differs from pi_old)."""
    b = _batch(1, B=8, T=8, mu_scale=1.0)
    u = sis_uniforms(jax.random.key(5), b["logp"].shape)
    _, metrics, _ = _loss("sis_b", b, uniforms=u)
    log_w = jnp.clip(b["logp"] - b["mu"], -20, 20)
    log_m = jnp.maximum(jnp.max(jnp.clip(b["new_at_mu"] - b["mu_topk"], -20, 20), -1), log_w)
    accept = ((jnp.log(u) < log_w - log_m) | (log_w == 0)) & b["mask"]
    expected = float(jnp.sum(accept) / jnp.sum(b["mask"]))
    assert float(metrics["accept_rate"]) == pytest.approx(expected, abs=1e-7)
    sis_rate = float(_loss("sis", b, uniforms=u)[1]["accept_rate"])
    assert sis_rate != pytest.approx(expected, abs=1e-7)


def _reference_sis_b_grpo(logp, old, mu, new_at_mu, mu_topk, adv, mask, u, eps=0.2, c=3.0):
    """float64 numpy: SIS-b then GRPO's PPO clip + dual clip, token-mean; loss and d loss / d logp.
    Accepted tokens: value -A (ratio 1), gradient -A (the on-policy grad log pi_theta)."""
    log_w_b = np.clip(logp - mu, -20, 20)
    log_m = np.maximum(np.clip(new_at_mu - mu_topk, -20, 20).max(-1), log_w_b)
    accept = ((np.log(u) < log_w_b - log_m) | (log_w_b == 0)) & mask
    r = np.exp(np.clip(logp - old, -20, 20))
    a = adv[:, None] * np.ones_like(r)
    l1, l2 = -a * r, -a * np.clip(r, 1 - eps, 1 + eps)
    loss = np.maximum(l1, l2)
    grad = np.where((l1 >= l2) | ((r > 1 - eps) & (r < 1 + eps)), -a * r, 0.0)
    dual = (a < 0) & (loss > -a * c)
    loss, grad = np.where(dual, -a * c, loss), np.where(dual, 0.0, grad)
    loss, grad = np.where(accept, -a, loss), np.where(accept, -a, grad)
    n = mask.sum()
    return float(np.sum(np.where(mask, loss, 0.0)) / n), np.where(mask, grad, 0.0) / n, accept


def test_sis_b_f64_gradient_equals_reference():
    b32 = _batch(2, B=6, T=8, scale=0.6, mu_scale=0.8)
    u = np.asarray(sis_uniforms(jax.random.key(9), b32["logp"].shape), np.float64)
    with jax.enable_x64(True):
        b = {k: (jnp.asarray(v, jnp.float64) if v.dtype == jnp.float32 else v) for k, v in b32.items()}
        loss, metrics, grad = _loss("sis_b", b, uniforms=jnp.asarray(u))
        assert loss.dtype == jnp.float64
    ref_loss, ref_grad, accept = _reference_sis_b_grpo(*(np.asarray(b[k], np.float64) for k in (
        "logp", "old", "mu", "new_at_mu", "mu_topk", "adv")), np.asarray(b["mask"]), u)
    assert 0 < accept.sum() < np.asarray(b["mask"]).sum()  # both branches exercised
    assert abs(float(loss) - ref_loss) <= TOL
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=0, atol=TOL)


def test_sis_b_inputs_and_config_are_checked():
    b = _batch(0)
    with pytest.raises(ValueError, match="behaviour_topk_logp"):
        policy_loss(b["logp"], b["old"], b["adv"], b["mask"], config=PolicyLossConfig(correction="sis_b"),
                    key=jax.random.key(0), new_topk_logp=b["new_at_mu"], behaviour_logp=b["mu"])
    with pytest.raises(ValueError, match="behaviour_logp"):
        policy_loss(b["logp"], b["old"], b["adv"], b["mask"], config=PolicyLossConfig(correction="sis_b"),
                    key=jax.random.key(0), new_topk_logp=b["new_at_mu"], behaviour_topk_logp=b["mu_topk"])
    cfg = GRPOConfig(loss=PolicyLossConfig(correction="sis_b"), sis_topk=5)
    assert cfg.rollout_spec.behaviour_topk == 5 and not cfg.old_from_update
    assert GRPOConfig(loss=PolicyLossConfig(correction="sis")).rollout_spec.behaviour_topk == 0
    with pytest.raises(ValueError, match=r"^behaviour_topk=-1: need an int >= 0"):
        RolloutSpec(behaviour_topk=-1)


def test_rollout_batch_topk_fields_default_empty_and_slice_like_rows():
    z = np.zeros((4, 3), np.float32)
    batch = RolloutBatch(np.zeros((4, 2), np.int32), np.ones(4, np.int32), z.astype(np.int32), z, z,
                         np.zeros(4, np.float32))
    assert not batch.has_behaviour_topk and batch.behaviour_topk_ids.shape == (4, 3, 0)
    with pytest.raises(ValueError, match="needs a rollout with the behaviour top-K"):
        batch.behaviour_topk("correction 'sis_b'")
    with pytest.raises(ValueError, match="go together"):
        RolloutBatch(*batch[:7], behaviour_topk_logp=np.zeros((4, 3, 2), np.float32))
    rows = RolloutBatch(*(x[1:3] for x in batch))  # the row operations of dynamic sampling
    assert rows.behaviour_topk_logp.shape == (2, 3, 0)


# ----------------------------------------------------------------------------- the samplers' record

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(nnx.jit(lambda: Transformer(TINY, rngs=nnx.Rngs(0)))())


B, P, N, K, TEMP = 3, 4, 5, 4, 0.7
LENGTHS = jnp.array([4, 2, 3], jnp.int32)


def _prompts():
    prompts = jax.random.randint(jax.random.key(1), (B, P), 1, TINY.vocab_size, jnp.int32)
    return jnp.where(jnp.arange(P)[None] < LENGTHS[:, None], prompts, 0)


def _assert_recorded_topk_is_the_forwards(split_model, prompts, out, b=B, p=P, n=N, k=K, temp=TEMP,
                                          lengths=LENGTHS, atol=1e-5):
    """Recorded top-K == top-K of log_softmax(forward logits / T) at each sampled position."""
    graphdef, state = split_model
    seq = jnp.stack([jnp.concatenate([prompts[i, :lengths[i]], out.tokens[i], jnp.zeros(p - lengths[i], jnp.int32)])
                     for i in range(b)])
    logits = nnx.merge(graphdef, state)(seq)
    idx = lengths[:, None] - 1 + jnp.arange(n)[None]
    logp = jax.nn.log_softmax(jnp.take_along_axis(logits, idx[..., None], axis=1) / temp, axis=-1)
    ref_lp, ref_idx = jax.lax.top_k(logp, k)
    live = np.asarray(out.mask) > 0
    np.testing.assert_array_equal(np.asarray(out.topk_indices)[live], np.asarray(ref_idx)[live])
    np.testing.assert_allclose(np.asarray(out.topk_logprobs)[live], np.asarray(ref_lp)[live], atol=1e-5)
    assert not np.asarray(out.topk_logprobs)[~live].any()
    # the sampled token's own log-prob is the recorded distribution's
    own = np.take_along_axis(np.asarray(logp), np.asarray(out.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[live], own[live], atol=atol)


@pytest.mark.parametrize("per_row", [False, True])
def test_static_sampler_records_the_behaviour_top_k(split_model, per_row):
    graphdef, state = split_model
    prompts = _prompts()
    sampling = SamplingConfig(max_new_tokens=N, temperature=TEMP)
    key = jax.random.split(jax.random.key(2), B) if per_row else jax.random.key(2)
    out = make_sampler(graphdef, sampling, per_row_keys=per_row, behaviour_topk=K)(state, prompts, LENGTHS, key)
    plain = make_sampler(graphdef, sampling, per_row_keys=per_row)(state, prompts, LENGTHS, key)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))  # recording draws nothing
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(plain.logprobs))
    assert plain.topk_logprobs is None and out.topk_logprobs.shape == (B, N, K)
    _assert_recorded_topk_is_the_forwards(split_model, prompts, out)


def test_engine_records_the_behaviour_top_k(split_model):
    """The paged engine with ``sampled_topk``: the same record as the forward's (and its tokens
    those of the engine without it)."""
    from jaxflow.rollout import EngineConfig, RolloutEngine

    graphdef, state = split_model
    prompts = _prompts()
    sampling = SamplingConfig(max_new_tokens=N, temperature=TEMP)
    keys = jax.random.split(jax.random.key(2), B)
    cfg = EngineConfig(slots=3, page_size=8, num_pages=40, prefill_chunk=5, max_seq_len=P + N,
                       narrow_tables=False)
    plain = RolloutEngine(graphdef, state, cfg, sampling).generate(prompts, LENGTHS, keys)
    cfg = dataclasses.replace(cfg, top_logprobs=K, sampled_topk=True)
    out = RolloutEngine(graphdef, state, cfg, sampling).generate(prompts, LENGTHS, keys)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    _assert_recorded_topk_is_the_forwards(split_model, prompts, out)


def test_grpo_loss_with_sis_b_takes_the_mini_batch_top_k():
    """grpo_loss gathers pi_theta at the batch's behaviour top-K; sampled by the policy itself
    (pi_theta == mu up to the decode's rounding) every token passes the test."""
    from jaxflow.mesh import role_meshes
    from jaxflow.models.transformer import TransformerConfig
    from jaxflow.train.lm_state import init_params

    model = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=16)
    fns = lm_functions(model, role_meshes({"trainer": 1})["trainer"])
    params = init_params(fns, model, jax.random.key(0))
    b, p, n, k = 4, 3, 3, 4
    prompts = jax.random.randint(jax.random.key(1), (b, p), 1, model.vocab_size, jnp.int32)
    lengths = jnp.full((b,), p, jnp.int32)
    out = make_sampler(fns.graphdef, SamplingConfig(max_new_tokens=n), behaviour_topk=k)(
        fns.nnx_state(params), prompts, lengths, jax.random.key(0))
    mb = MiniBatch(prompts, lengths, out.tokens, out.mask, out.logprobs, jnp.linspace(-1.0, 1.0, b),
                   out.topk_logprobs, out.topk_indices)
    config = GRPOConfig(loss=PolicyLossConfig(correction="sis_b"), sis_topk=k, group_size=2,
                        prompts_per_rollout=2, max_new_tokens=n)
    old = OldStats(out.logprobs, None, None, jnp.zeros_like(out.logprobs))
    # one compiled loss for both parameter sets (op-by-op dispatch costs more than the compile)
    loss = jax.jit(functools.partial(grpo_loss, fns=fns, config=config))
    _, metrics = loss(params, mb, old, key=jax.random.key(1))
    assert float(metrics["accept_rate"]) == 1.0
    moved = jax.tree.map(lambda x: x * 1.5, params)
    assert float(loss(moved, mb, old, key=jax.random.key(1))[1]["accept_rate"]) < 1
    with pytest.raises(ValueError, match="behaviour_topk_logp / _ids"):
        loss(params, mb._replace(behaviour_topk_logp=None, behaviour_topk_ids=None), old, key=jax.random.key(1))
