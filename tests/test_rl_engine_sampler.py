"""GRPO rollouts through the rollout engine (``rl.sampler="engine"``): the same tokens as the
static sampler with per-row keys, per-token versions, the in-process SparseRL-Sync replica and
the rollout job's replica followed in place.

Trainer and rollout on disjoint one-device sub-meshes of the fake CPU devices.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.mesh import role_meshes
from jaxflow.models.sampler import make_sampler
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import GRPOConfig, GRPOTrainer
from jaxflow.rl.remote import protocol as P
from jaxflow.rl.remote.server import RolloutService
from jaxflow.rl.rollout import EngineSettings, RolloutWorker
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.sync.replica import Replica
from jaxflow.sync.sync_sender import SyncSender
from jaxflow.sync.transport.inprocess import InProcessLink
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.sync.wire import tree_digest
from jaxflow.train.lm_state import OptimConfig, init_params

MODEL = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=64, max_seq_len=32)
BASE = GRPOConfig(prompts_per_rollout=4, group_size=4, max_new_tokens=4, sis_topk=4)
#: the engine's log-probs vs the static sampler's: XLA:CPU f32 matmuls depend on the batch shape
#: they run in (jaxflow.rollout's docstring: ~2e-6); tokens are compared exactly
LOGP_ATOL = 1e-5


@pytest.fixture(scope="module")
def meshes():
    return role_meshes({"trainer": 1, "rollout": 1}, devices=jax.devices()[:2])


def _trainer(meshes, sync=None, **overrides):
    return GRPOTrainer(MODEL, dataclasses.replace(BASE, **overrides),
                       OptimConfig(lr=3e-3, warmup_steps=0), AdditionRLTask(max_digits=1),
                       CharTokenizer(), meshes, seed=0, total_rollouts=4, sync=sync)


def _static_per_row(trainer, state, batch):
    """``make_sampler(per_row_keys=True)`` on the rollout's prompts with the engine's keys
    ``split(rollout key, B)`` and the params the rollout sampled (f32, upcast from the bf16
    replica with sync on)."""
    w = trainer.worker
    sample_key, _ = trainer._keys(state, int(state["rollout"]))
    keys = jax.device_put(jax.random.split(sample_key, batch.tokens.shape[0]),
                          trainer.rollout_mesh.devices.flat[0])
    out = make_sampler(w._sampler_fns.graphdef, w._sampling, per_row_keys=True)(
        w._sampler_fns.nnx_state(trainer.rollout_params(state)), batch.prompts,
        batch.prompt_lengths, keys)
    return jax.tree.map(np.asarray, out)


def _check_equal(batch, ref, version):
    np.testing.assert_array_equal(batch.tokens, ref.tokens)
    np.testing.assert_array_equal(batch.mask, ref.mask)
    np.testing.assert_allclose(batch.behaviour_logp, ref.logprobs, rtol=0, atol=LOGP_ATOL)
    # per-token versions: ``version`` sampled every response token, -1 past EOS
    np.testing.assert_array_equal(batch.versions, np.where(batch.mask > 0, version, -1))


def test_engine_rollout_equals_the_static_sampler_with_per_row_keys_and_trains(meshes):
    trainer = _trainer(meshes, sampler="engine", lag=2)
    state = trainer.init_state(init_params(trainer.fns, MODEL, jax.random.key(0)))
    batch = trainer.generate(state)
    rows = BASE.rollout_size
    assert batch.tokens.shape == (rows, BASE.max_new_tokens)
    assert len({tuple(t) for t in batch.tokens}) > 1  # sampled, not one repeated row
    assert 0 < batch.mask.sum() < batch.mask.size  # some responses end early (EOS)
    _check_equal(batch, _static_per_row(trainer, state, batch), 0)
    # the G responses of a prompt shared its prefill: 4 prompts, one prefill call of 4 rows
    engine = trainer.worker.engine
    assert engine.stats.prefill_calls == 1 and engine.config.slots == rows
    state, metrics = trainer.step(state)
    assert np.isfinite(metrics["actor/loss"]) and int(state["policy"].step) == 2
    assert metrics["version/sampler_min"] == metrics["version/sampler_max"] == 0
    # the next rollout: the dense publisher hands the engine version 2's params
    batch = trainer.generate(state)
    _check_equal(batch, _static_per_row(trainer, state, batch), 2)


def test_engine_follows_the_in_process_sync_replica(meshes):
    # weight sync every rollout, lag 2: rollout r samples version 2r; the engine reads the bf16
    # replica itself (no f32 upcast) and samples what the static sampler does on the upcast
    trainer = _trainer(meshes, sync=SyncConfig(codec="auto", every=1), sampler="engine", lag=2)
    state = trainer.init_state(init_params(trainer.fns, MODEL, jax.random.key(1)))
    for r in range(2):
        batch = trainer.generate(state)
        _check_equal(batch, _static_per_row(trainer, state, batch), 2 * r)
        replica = trainer.weight_sync.replicas[0]
        assert trainer.worker._following is replica and trainer.worker.engine.version == 2 * r
        leaves = {id(x) for x in jax.tree.leaves(replica.params)}
        assert all(id(x) in leaves for x in jax.tree.leaves(trainer.worker.engine._state))
        state, metrics = trainer.step(state)
        assert metrics["version/sampler"] == 2 * r and metrics["sync/bit_exact"] == 1.0
        assert metrics["version/sampler_min"] == metrics["version/sampler_max"] == 2 * r


def _bf16(tree):
    return jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), tree)


def test_rollout_service_samples_through_the_engine_following_its_replica(meshes):
    mesh = meshes["rollout"]
    spec = dataclasses.replace(BASE, sampler="engine").rollout_spec
    task, tok = AdditionRLTask(max_digits=1), CharTokenizer()
    ref_worker = RolloutWorker(MODEL, mesh, dataclasses.replace(spec, sampler="static_per_row"),
                               task, tok)
    service = RolloutService(RolloutWorker(MODEL, mesh, spec, task, tok))
    try:
        p0 = init_params(ref_worker.fns, MODEL, jax.random.key(2))
        p1 = init_params(ref_worker.fns, MODEL, jax.random.key(3))
        host0, host1 = _bf16(p0), _bf16(p1)
        service.replica_server.replica = Replica(host0, version=3)
        sender = SyncSender(host0, version=3, codec="auto", path="host")
        prompts = ["1+2=", "3+4=", "5+5=", "9+0="]
        key = jax.random.key(7)
        for version, host in ((3, host0), (5, host1)):
            if version == 5:  # a sparse payload lands in the replica the engine follows
                sender.publish(host1, version=5)
                sender.sync(InProcessLink(service.replica))
            body = service._roll({"version": version, "digest": tree_digest(host),
                                  "prompts": prompts,
                                  "key": np.asarray(jax.random.key_data(key)).tolist()})
            rows = len(prompts) * spec.group_size
            expected = {k: (tuple(s), d) for k, (s, d) in {
                "prompts": ((rows, ref_worker.prompt_width), "int32"),
                "prompt_lengths": ((rows,), "int32"), "tokens": ((rows, 4), "int32"),
                "mask": ((rows, 4), "float32"), "behaviour_logp": ((rows, 4), "float32"),
                "rewards": ((rows,), "float32"), "versions": ((rows, 4), "int32")}.items()}
            _, arrays = P.decode_batch(body, expected, "test")
            f32 = jax.device_put(jax.tree.map(lambda x: x.astype(np.float32), host),
                                 ref_worker.param_shardings)
            want = ref_worker.generate(f32, prompts, key, version=version)
            for name, ours in zip(P.BATCH_FIELDS, want):
                if name == "behaviour_logp":
                    np.testing.assert_allclose(arrays[name], ours, rtol=0, atol=LOGP_ATOL)
                else:
                    np.testing.assert_array_equal(arrays[name], ours, err_msg=name)
            assert service.worker.engine.version == version
            assert service.worker._following is service.replica
        with pytest.raises(P.RolloutRefused, match="version 5, the trainer asked for 4"):
            service._roll({"version": 4, "digest": "x", "prompts": prompts, "key": [0, 1]})
    finally:
        service._sock.close()


def test_sampler_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="sampler='vllm'; valid: static, static_per_row, engine"):
        GRPOConfig(sampler="vllm")
    with pytest.raises(ValueError, match=r"engine.slots=0: need an int >= 1 or None"):
        EngineSettings(slots=0)
    with pytest.raises(ValueError, match="engine.attention='cuda'"):
        EngineSettings(attention="cuda")
