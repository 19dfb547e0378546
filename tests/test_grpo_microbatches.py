"""Gradient accumulation in the GRPO update (``GRPOConfig.microbatches``): an update over M
micro-batches equals the one-program update of the whole mini-batch, and what cannot be split
exactly is refused at config time.

The updates are :func:`update_step` (M = 1) and :func:`accumulated_update_step` (M > 1) under
plain SGD with learning rate 1, so the params after one update are ``params - gradient``: they
differ when the gradient does (Adam's first step, ``lr * g / (|g| + eps)``, would hide all but
the gradient's sign). The mini-batch has rows of different lengths, an empty row, ratios away
from 1 (pi_old perturbed) and a behaviour policy whose corrections mask or clip tokens.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxflow.mesh import jit_on, role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo_step import GRPOConfig, MiniBatch, old_stats
from jaxflow.rl.policy_loss import PolicyLossConfig
from jaxflow.rl.update import accumulated_update_step, split_microbatches, update_step
from jaxflow.train.lm_state import init_params, lm_functions
from jaxflow.train.state import TrainState

MODEL = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=64, max_seq_len=32)
ROWS, PROMPT, NEW = 16, 6, 5
BASE = GRPOConfig(prompts_per_rollout=4, group_size=4, max_new_tokens=NEW, sis_topk=4)
#: name -> (config fields, the micro-batch counts compared with M = 1)
CASES = {
    # token-mean, TIS weights, pi_old from the update's own forward (old=None)
    "grpo-tis": (dict(loss=PolicyLossConfig(algo="grpo", correction="tis")), (4,)),
    # token-mean, SIS (the flagship's) with KL and an entropy bonus: the uniforms are sliced
    "dapo-sis-kl-entropy": (dict(loss=PolicyLossConfig(algo="dapo", correction="sis"),
                                 kl_coef=0.1, entropy_coef=0.05), (4,)),
    # seq-mean-token-mean (GSPO's default) with IcePop masking tokens
    "gspo-icepop": (dict(loss=PolicyLossConfig(algo="gspo", correction="icepop",
                                               clip_eps_low=0.2, clip_eps_high=0.2),
                         reuse_forward=False), (2,)),
}


@pytest.fixture(scope="module")
def setup():
    mesh = role_meshes({"trainer": 4})["trainer"]
    fns = lm_functions(MODEL, mesh)
    params = init_params(fns, MODEL, jax.random.key(0))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, NEW + 1, ROWS)
    lengths[5] = 0  # an empty row: no token in any normaliser
    mask = (np.arange(NEW)[None] < lengths[:, None]).astype(np.float32)
    mb = MiniBatch(prompts=jnp.asarray(rng.integers(3, 23, (ROWS, PROMPT)), jnp.int32),
                   prompt_lengths=jnp.asarray(rng.integers(2, PROMPT + 1, ROWS), jnp.int32),
                   tokens=jnp.asarray(rng.integers(3, 23, (ROWS, NEW)), jnp.int32),
                   mask=jnp.asarray(mask), behaviour_logp=jnp.zeros((ROWS, NEW)),
                   advantages=jnp.asarray(rng.normal(size=ROWS), jnp.float32))
    return mesh, fns, params, mb, rng


def _updates(params, mb, noise, key, *, fns, config, counts):
    """pi_old (perturbed by ``noise``, unless the update takes it from its own forward) and
    one SGD(1) update per micro-batch count in ``counts`` (1 first), in one program (one compile
    per case): ``[(params, metrics) per count]``."""
    old = old_stats(fns, params, params if config.kl_coef else None, mb, config=config)
    mb = mb._replace(behaviour_logp=old.logp + noise[0])  # TIS clips, IcePop masks some tokens
    old = None if config.old_from_update else old._replace(logp=old.logp + noise[1])
    policy = TrainState.create(optax.sgd(1.0), params)
    out = []
    for m in counts:
        cfg = dataclasses.replace(config, microbatches=m)
        step = update_step if m == 1 else accumulated_update_step
        new, metrics = step(policy, mb, old, fns=fns, config=cfg, key=key)
        out.append((new.params, metrics))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_microbatched_update_equals_the_whole_minibatch_update(setup, case):
    mesh, fns, params, mb, rng = setup
    fields, counts = CASES[case]
    config = dataclasses.replace(BASE, **fields)
    # the sampler's log-probs: pi_old's + N(0, 0.6); pi_old: the params' + N(0, 0.3) (ratios
    # != 1, clipping), unless pi_old comes from the update's own forward
    noise = jnp.asarray(rng.normal(0.0, [[[0.6]], [[0.3]]], (2, ROWS, NEW)), jnp.float32)
    fn = jit_on(mesh, functools.partial(_updates, fns=fns, config=config, counts=(1, *counts)))
    (ref_params, ref_metrics), *rest = jax.device_get(fn(params, mb, noise, jax.random.key(7)))
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref_params,
                                         jax.device_get(params)))
    assert max(moved) > 1e-3  # the gradient is not trivially zero
    for m, (got_params, got_metrics) in zip(counts, rest):
        jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                     got_params, ref_params)
        # the losses are exact weighted means; the gradient's norm is the whole batch's
        for name in ("loss", "policy_loss", "grad_norm", "max_abs_log_ratio"):
            np.testing.assert_allclose(got_metrics[name], ref_metrics[name], rtol=1e-5,
                                       atol=1e-6, err_msg=f"{name}, M={m}")
        if config.loss.aggregation == "token-mean":  # token means: exact under token weights
            for name in ("clip_fraction", "accept_rate", "kl", "entropy"):
                if name in ref_metrics:
                    np.testing.assert_allclose(got_metrics[name], ref_metrics[name],
                                               rtol=1e-5, atol=1e-6, err_msg=f"{name}, M={m}")


def test_split_takes_every_mth_row():
    x = jnp.arange(12).reshape(6, 2)
    parts = split_microbatches(x, 3)
    assert parts.shape == (3, 2, 2)
    np.testing.assert_array_equal(parts[1], x[1::3])


@pytest.mark.parametrize("fields,match", [
    (dict(microbatches=0), r"microbatches=0: need an int >= 1 dividing the mini-batch's 16 rows"),
    (dict(microbatches=3), r"microbatches=3: .*valid: \[1, 2, 4, 8, 16\]"),
    (dict(microbatches=16, lag=2), r"microbatches=16: .* 8 rows .*valid: \[1, 2, 4, 8\]"),
    (dict(microbatches=2.0), r"microbatches=2.0: need an int"),
])
def test_bad_microbatches_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(prompts_per_rollout=4, group_size=4, **fields)
    assert GRPOConfig(prompts_per_rollout=4, group_size=4, lag=2, microbatches=8).microbatches == 8


def test_what_micro_batches_cannot_split_exactly_is_refused():
    for correction in ("m2po", "m2po+mis"):
        with pytest.raises(ValueError, match=re.escape(f"correction={correction!r}") + ".*whole mini-batch"):
            dataclasses.replace(BASE, loss=PolicyLossConfig(correction=correction), microbatches=2)
        assert dataclasses.replace(BASE, loss=PolicyLossConfig(correction=correction)).microbatches == 1
    with pytest.raises(ValueError, match="seq-mean-token-mean.*different normalisers"):
        dataclasses.replace(BASE, loss=PolicyLossConfig(algo="gspo"), kl_coef=0.1, microbatches=2)
    # token-mean with KL / entropy, and seq-mean without them, are exact: accepted
    assert dataclasses.replace(BASE, kl_coef=0.1, entropy_coef=0.1, microbatches=2).microbatches == 2
    assert dataclasses.replace(BASE, loss=PolicyLossConfig(algo="gspo"), microbatches=2).microbatches == 2
