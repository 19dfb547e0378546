"""GRPO with LoRA (``rl.lora``): adapters over a frozen warm start, the sampler on the merged
weights, SparseRL-Sync of adapters vs merged weights."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.mesh import role_meshes
from jaxflow.models import lora
from jaxflow.rl.grpo import GRPOTrainer
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig, init_params, lm_functions
from tests._cli import persistent_compile_cache
from tests.test_rl_grpo import BASE, MODEL, StopTask, _first_token_prob

LORA = lora.LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The trainers differ in the publish mode and sync, which leave the update and sampler
    unchanged: each program with the same HLO is compiled once and loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


@pytest.fixture(scope="module")
def meshes():
    return role_meshes({"trainer": 2, "rollout": 2})


def _trainer(meshes, sync=None, **lora_changes):
    cfg = dataclasses.replace(BASE, prompts_per_rollout=8, group_size=8, lag=1,
                              lora=dataclasses.replace(LORA, **lora_changes))
    return GRPOTrainer(MODEL, cfg, OptimConfig(lr=3e-2, warmup_steps=0), StopTask(), CharTokenizer(),
                       meshes, seed=0, total_rollouts=4, sync=sync)


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(
        jax.device_get(tree))}


def test_grpo_with_lora_trains_adapters_only_and_samples_the_merged_weights(meshes):
    trainer = _trainer(meshes)
    assert trainer.model_cfg.lora == LORA and not lora.has_adapters(trainer.worker.param_shardings)
    warm = init_params(lm_functions(MODEL, trainer.trainer_mesh), MODEL, jax.random.key(1))
    state = trainer.init_state(warm)  # base-shaped warm start: fresh adapters added, B = 0
    eos = CharTokenizer().eos_id
    before = _first_token_prob(trainer, state["policy"].params, eos)
    # step 0 samples exactly the warm start
    start = _flat(trainer.rollout_params(state))
    for name, x in _flat(warm).items():
        np.testing.assert_array_equal(start[name], x)
    rewards = []
    for _ in range(2):
        state, metrics = trainer.step(state)
        rewards.append(metrics["critic/rewards/mean"])
    after = _first_token_prob(trainer, state["policy"].params, eos)
    assert 0 < rewards[0] < 1 and after > 2 * before, (rewards, before, after)
    params = _flat(state["policy"].params)
    for name, x in _flat(warm).items():  # the base is frozen, bit for bit
        np.testing.assert_array_equal(params[name], x, err_msg=name)
    assert any(np.any(x) for n, x in params.items() if n.endswith("_lora_b']"))
    # the sampler gets the merge of the trainer's params (dense publish: f32, exact)
    sampled = _flat(trainer.rollout_params(state))
    merged = _flat(jax.jit(lambda p: lora.merge(p, LORA))(state["policy"].params))
    assert sampled.keys() == merged.keys() == _flat(warm).keys()
    for name, x in merged.items():
        np.testing.assert_array_equal(sampled[name], x, err_msg=name)
    moments = [x for x in jax.tree.leaves(state["policy"].opt_state) if x.ndim > 0]
    n_adapter = sum(x.size for x in jax.tree.leaves(lora.adapters(state["policy"].params)))
    assert sum(x.size for x in moments) == 2 * n_adapter


@pytest.mark.parametrize("publish", ["adapters", "merged"])
def test_sync_sends_adapter_deltas_or_whole_merged_matrices(meshes, publish):
    trainer = _trainer(meshes, SyncConfig(codec="auto", every=1), publish=publish)
    warm = init_params(lm_functions(MODEL, trainer.trainer_mesh), MODEL, jax.random.key(1))
    state = trainer.init_state(warm)
    state, metrics, sent = trainer.step_with_sync(state)
    assert sent.bit_exact and metrics["sync/payload_bytes"] > 0
    n_base = sum(x.size for x in jax.tree.leaves(warm))
    n_adapter = sum(x.size for x in jax.tree.leaves(lora.adapters(state["policy"].params)))
    changed = sent.stats.changed_fraction * (n_base + (n_adapter if publish == "adapters" else 0))
    n_adapted = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(warm)
                    if str(p[-1].key) in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    if publish == "adapters":
        assert changed <= n_adapter  # only adapter elements can change
    else:
        assert changed > 0.5 * n_adapted  # a merged delta touches most of every adapted matrix
    # the sampler's weights are the bf16 replica's, merged on the rollout side or before the sync
    sampled = _flat(trainer.rollout_params(state))
    assert sampled.keys() == _flat(warm).keys()


def test_lora_with_a_remote_rollout_job_is_refused_with_the_reason(meshes):
    with pytest.raises(ValueError, match="rl.lora.rank=4 with a remote rollout job: the rollout job "
                                         "samples base-shaped bf16 replicas"):
        GRPOTrainer(MODEL, dataclasses.replace(BASE, lora=LORA), OptimConfig(), StopTask(),
                    CharTokenizer(), meshes, seed=0, sync=SyncConfig(codec="auto"), remote=object())
