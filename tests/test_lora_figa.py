"""The `figa` experiment with LoRA (``lora.rank``): every arm trains adapters over the frozen warm
start, optimizer moments for the adapters only, evaluation on the merged weights; rank 0 is the
full fine-tuning of before."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs import figa as figa_config
from configs.lm_pretrain import Config as PretrainConfig
from configs.lm_pretrain import DataConfig, TrainConfig
from jaxflow.align import (
    FigaConfig,
    Rows,
    addition_answers,
    build_pairs,
    interleave_rows,
    lora_policy,
    make_method_step,
    row_logp,
)
from jaxflow.config import ConfigError, apply_overrides
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import standalone_context
from jaxflow.main import figa
from jaxflow.mesh import make_mesh
from jaxflow.models import lora
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig, init_params, lm_functions
from jaxflow.train.state import TrainState

MODEL = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                          max_seq_len=16)
LORA = lora.LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    replicated = NamedSharding(mesh, PartitionSpec())
    fns = lm_functions(MODEL, mesh)
    warm = jax.device_put(init_params(fns, MODEL, jax.random.key(1)), replicated)
    tok = CharTokenizer()
    texts = ["12+5=", "9+9=", "40+3=", "7+8="]
    prompts, lengths = tok.pad_batch([tok.encode(t, bos=True) for t in texts], 7)
    tokens, _ = tok.pad_batch([tok.encode(a, eos=True) for a in ("83", "8", "44", "51")], 4)
    data = build_pairs(texts, prompts, lengths, tokens, np.zeros(4, np.float32), tok,
                       addition_answers, length=4)
    rows = Rows(*(jax.device_put(x, replicated) for x in interleave_rows(data)))
    return fns, warm, rows, replicated


@pytest.fixture(scope="module")
def adapter_policy(setup):
    """One LoRA policy for every arm: immutable (each arm's state starts from its params), so
    the arms share its model functions and its compiled merge."""
    fns, warm, _, replicated = setup
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    return lora_policy(MODEL, LORA, fns, warm, tx, replicated)


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.parametrize("method", figa_config.METHODS)
def test_each_arm_trains_adapters_only_over_the_frozen_warm_start(setup, adapter_policy, method):
    fns, warm, rows, replicated = setup
    policy = adapter_policy
    assert policy.model_cfg.lora == LORA and lora.has_adapters(policy.params)
    # fresh adapters (B = 0): the sampler's merge of the initial params is the warm start, bit for bit
    start = _flat(policy.to_sampler(policy.params))
    assert start.keys() == _flat(warm).keys()
    for name, x in _flat(warm).items():
        np.testing.assert_array_equal(start[name], x, err_msg=name)
    step = make_method_step(policy.fns, method, 0.1, FigaConfig(), replicated)
    state = TrainState.create(policy.tx, policy.params,
                              jax.tree.map(lambda _: replicated, policy.params))
    losses = []
    for _ in range(3):  # the same rows each step: the loss must fall
        state, metrics = step(state, policy.params, rows)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    if method == "dpo":  # the reference (initial params) is the policy at step 0: loss log 2
        np.testing.assert_allclose(losses[0], np.log(2.0), rtol=1e-6)
    params = _flat(state.params)
    for name, x in _flat(warm).items():  # the base is frozen, bit for bit
        np.testing.assert_array_equal(params[name], x, err_msg=name)
    assert any(np.any(x) for n, x in params.items() if n.endswith("_lora_b']"))
    n_adapter = sum(x.size for x in jax.tree.leaves(lora.adapters(state.params)))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter  # Adam's mu and nu of the adapters only
    # the sampler's merged weights compute what the adapter model trained: same log-probs, bit for bit
    merged = policy.to_sampler(state.params)
    np.testing.assert_array_equal(np.asarray(row_logp(fns, merged, rows)),
                                  np.asarray(row_logp(policy.fns, state.params, rows)))
    assert any(np.any(_flat(merged)[n] != x) for n, x in _flat(warm).items())


def test_rank_zero_is_the_full_fine_tuning_of_before(setup):
    fns, warm, rows, replicated = setup
    tx = optax.adam(1e-2)
    policy = lora_policy(MODEL, lora.LoraConfig(), fns, warm, tx, replicated)
    assert policy.model_cfg is MODEL and policy.fns is fns and policy.params is warm
    assert policy.tx is tx and policy.to_sampler(warm) is warm


def test_config_key_and_refusal():
    quick = figa_config.get_config("quick")
    assert quick.lora == lora.LoraConfig() and not quick.lora.enabled
    cfg = apply_overrides(quick, ["lora.rank=8", "lora.targets=q,v"])
    assert cfg.lora.rank == 8 and cfg.lora.targets == ("q", "v")
    with_pretrain_lora = dataclasses.replace(
        quick.pretrain, model=dataclasses.replace(quick.pretrain.model, lora=lora.LoraConfig(rank=2)))
    with pytest.raises(ValueError, match="lora.rank=8 with pretrain.model.lora.rank=2: the warm start "
                                         "already has adapters"):
        dataclasses.replace(cfg, pretrain=with_pretrain_lora)
    with pytest.raises(ConfigError, match="lora.rank"):
        apply_overrides(quick, ["lora.rank=-1"])


def test_tiny_run_with_lora(tmp_path):
    """The driver end to end with LoRA (one arm; the others differ only in the step tested
    above): adapters' size in the summary, evaluation on the merged weights (the warm start's
    sampler takes them)."""
    pretrain = PretrainConfig(
        seed=0, model=MODEL, data=DataConfig(max_digits=1, heldout_mod=5),
        train=TrainConfig(steps=4, batch_size=8, seq_len=16, log_every=4, eval_every=4,
                          eval_examples=4, checkpoint_every=4, keep_checkpoints=1),
        optim=OptimConfig(lr=3e-3, warmup_steps=5))
    cfg = dataclasses.replace(
        figa_config.get_config("quick"), seeds=1, pretrain=pretrain, lora=LORA, methods=("dpo",),
        cache_root=str(tmp_path / "cache"),
        data=figa_config.DataConfig(pairs=8, prompts_per_round=16),
        train=figa_config.TrainConfig(steps=2, pairs_per_batch=4, eval_every=2,
                                      eval_examples=8, eval_samples=0, log_every=1))
    summary = figa.main(cfg, standalone_context("figa", out_dir=str(tmp_path / "run")))
    n_base = sum(x.size for x in jax.tree.leaves(lm_functions(MODEL, make_mesh(
        {"data": 1}, devices=jax.devices()[:1])).abstract_params()))
    # 1 layer: q, k, v [32 -> 2x16], o [2x16 -> 32], gate, up [32 -> 64], down [64 -> 32]; r = 4
    n_adapter = 4 * (4 * (32 + 32) + 2 * (32 + 64) + (64 + 32))
    assert summary["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(lora.TARGETS),
                               "adapter_params": n_adapter, "base_params": n_base}
    (row,) = summary["results"]
    assert row["method"] == "dpo" and [c["step"] for c in row["curve"]] == [0, 2]
    assert 0 <= row["heldout_greedy_mean"] <= 1
