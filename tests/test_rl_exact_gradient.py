"""The sis_exact_gradient study: its config contract and its entry function on the quick variant."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sis_exact_gradient
from jaxflow.experiment import standalone_context
from jaxflow.main.sis_exact_gradient import main as sis_exact_gradient_main
from jaxflow.rl import exact_gradient


def test_config_contract():
    assert sis_exact_gradient.ENTRY == "jaxflow.main.sis_exact_gradient:main"
    for variant in sis_exact_gradient.VARIANTS:
        cfg = sis_exact_gradient.get_config(variant)
        assert dataclasses.is_dataclass(cfg) and cfg.draws >= 1000
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.seed = 1
    with pytest.raises(ValueError, match=r"unknown variant 'huge'"):
        sis_exact_gradient.get_config("huge")


def test_exact_gradient_matches_score_function_enumeration():
    vocab, length = 3, 2
    responses = exact_gradient.all_responses(vocab, length)
    ctx = exact_gradient.context_ids(responses, vocab)
    theta = jax.random.normal(jax.random.PRNGKey(0), (1 + vocab, vocab))
    rewards = jnp.arange(responses.shape[0], dtype=jnp.float32) % 2
    value, g = exact_gradient.exact_gradient(theta, responses, ctx, rewards)
    # sum_y pi(y) R(y) grad log pi(y), with each context used by the prefixes that reach it
    logp = lambda th: jnp.sum(exact_gradient.token_logp(th, responses, ctx), -1)
    probs = jnp.exp(logp(theta))
    score = jax.jacrev(logp)(theta)  # [N, C, V]
    np.testing.assert_allclose(g, jnp.einsum("n,n,ncv->cv", probs, rewards, score), atol=1e-6)
    np.testing.assert_allclose(value, jnp.sum(probs * rewards), rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(probs), 1.0, rtol=1e-6)
    assert ctx.max() == exact_gradient.num_contexts(vocab, length) - 1


def test_quick_variant_entry():
    cfg = sis_exact_gradient.get_config("quick")
    summary = sis_exact_gradient_main(cfg, standalone_context("sis_exact_gradient"))
    rows = summary["estimators"]
    names = {(r["algo"], r["name"]) for r in rows}
    for algo in ("grpo", "dapo", "gspo", "cispo", "token_is"):
        assert (algo, "none") in names and (algo, "sis") in names
    assert {("seq_is", "seq_is"), ("grpo", "tis"), ("grpo", "mis")} <= names
    assert len(rows) == len(names) * len(cfg.perturbations)
    for r in rows:
        assert set(r) >= {"name", "algo", "perturbation", "bias", "variance"}
        assert np.isfinite(r["bias"]) and r["variance"] > 0
        # The sampled (>= 1000 draws) estimate agrees with the exact expectation within its
        # Monte Carlo noise (mc_error ~ mc_noise for a many-dimensional Gaussian mean).
        assert r["mc_error"] < 2.0 * r["mc_noise"], r
        if r["perturbation"] == 0.0 or r["algo"] == "seq_is":  # unbiased: on-policy / seq IS
            assert r["bias"] < 1e-4, r
    by = {(r["algo"], r["name"], r["perturbation"]): r for r in rows}
    off = max(cfg.perturbations)
    # Off-policy, the token-level estimators are biased and sequence IS has the largest variance.
    assert by[("token_is", "none", off)]["bias"] > 0.1
    assert by[("seq_is", "seq_is", off)]["variance"] > by[("token_is", "none", off)]["variance"]
    stats = {s["perturbation"]: s for s in summary["perturbation_stats"]}
    assert stats[0.0]["accept_rate"] == 1.0 and 0 < stats[off]["accept_rate"] < 1
