"""Decoupled encoder/backbone gradients == monolithic gradients for the same samples, directly
and through :class:`jaxflow.flow.system.FlowTrainSystem`.

Tolerance (f32): the two paths sum the same terms in a different order and on different meshes
(encoder on 2 devices, backbone on 4, monolithic on 8), so round-off differs; we require
max |g_dec - g_mono| <= 1e-5 * max |g_mono| + 1e-7 per parameter leaf. One-step-stale encoder
training (run_ahead=1) must differ from strict training by far more than that.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxflow.flow.batching import PackingConfig, encoder_image_base, encoder_patches, layout_rows, pooled_image_base
from jaxflow.flow.decoupled import (
    DecoupledTrainer,
    embedding_buffer,
    pool_entries,
    put_replicated,
    put_rows,
    scatter_cotangent,
)
from jaxflow.flow.digits_data import DigitsConfig, step_samples, tokenizer
from jaxflow.flow.packing import CostModel
from jaxflow.flow.steps import backbone_grads, encoder_forward, encoder_grads, monolithic_grads
from jaxflow.flow.system import FlowTrainSystem, host_copy, make_sides
from jaxflow.flow.vit import ViTConfig
from jaxflow.flow.vlm import AttentionBackend
from jaxflow.mesh import make_mesh, role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.system import check_system, is_system_state
from jaxflow.train.lm_state import OptimConfig

VIT = ViTConfig(patch_size=4, max_grid=8, d_model=16, n_layers=1, n_heads=2, d_ff=32, out_dim=32)
LM = TransformerConfig(vocab_size=tokenizer().vocab_size, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, d_ff=64, max_seq_len=512)
PACK = PackingConfig(token_budget=320, row_granularity=32)
# One backbone row shape for the trainer test (fewer compilations).
FIXED_ROWS = PackingConfig(token_budget=320, row_granularity=320, rows_per_device=2)
COST = CostModel.for_width(LM.d_model)
DATA = DigitsConfig()


def _close(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        tol = 1e-5 * np.abs(y).max() + 1e-7
        assert np.abs(x - y).max() <= tol, (jax.tree_util.keystr(path), np.abs(x - y).max(), tol)


SPLIT = "2(2x1)+4(4x1)"


def _config(run_ahead: int = 0):
    """The flowtrain quick config on these small models (10 optimizer steps: the horizon of
    the sides below, so the System's sides are the same objects and share compilations)."""
    from configs.flowtrain import get_config

    c = get_config("quick")
    return dataclasses.replace(
        c, vit=VIT, model=LM, packing=FIXED_ROWS, optim=OptimConfig(warmup_steps=1),
        train=dataclasses.replace(c.train, warmup_rounds=0, rounds=5, block_steps=2,
                                  batch_size=8, eval_examples=8),
        flow=dataclasses.replace(c.flow, run_ahead=run_ahead, pool_capacity=4, attention="xla"))


@pytest.fixture(scope="module")
def meshes():
    """The meshes of ``setup``'s sides, named as ``jaxflow.flow.meshes.resolve_meshes`` does."""
    full = make_mesh({"data": 8})
    roles = role_meshes({"encoder": 2, "backbone": 4})
    return {"monolithic": full, f"encoder/{SPLIT}": roles["encoder"],
            f"backbone/{SPLIT}": roles["backbone"]}


@pytest.fixture(scope="module")
def setup():
    full = make_mesh({"data": 8})
    roles = role_meshes({"encoder": 2, "backbone": 4})
    mono = make_sides(_config(), full, full, AttentionBackend.XLA)
    dec = make_sides(_config(), roles["encoder"], roles["backbone"], AttentionBackend.XLA)
    enc_state, bb_state = mono.init(jax.random.key(0))
    samples = step_samples(DATA, seed=0, step=0, batch_size=12)
    return mono, dec, enc_state, bb_state, samples


def test_decoupled_grads_equal_monolithic(setup):
    mono, dec, enc_state, bb_state, samples = setup
    denom = np.float32(sum(s.loss_mask.sum() for s in samples))
    # Monolithic: one program on 8 devices.
    patches = encoder_patches(samples, VIT, 8)
    rows = layout_rows(samples, "packed", encoder_image_base(samples, patches), packing=PACK,
                       cost=COST, row_multiple=8).rows
    loss_m, _, g_enc_m, g_bb_m = jax.jit(functools.partial(monolithic_grads, mono))(
        enc_state.params, bb_state.params, put_rows(patches.arrays(), mono.enc.mesh),
        put_rows(rows, mono.bb.mesh), denom)
    # Decoupled: encoder (2 devices) -> host pool entries -> backbone (4 devices) -> vjp.
    enc_params = jax.device_put(enc_state.params, dec.enc.param_shardings)
    bb_params = jax.device_put(bb_state.params, dec.bb.param_shardings)
    patches_e = encoder_patches(samples, VIT, 2)
    flat, vjp_fn = jax.jit(functools.partial(encoder_forward, dec))(
        enc_params, put_rows(patches_e.arrays(), dec.enc.mesh))
    flat = np.asarray(flat)
    buffer = embedding_buffer(pool_entries(samples, patches_e, flat), LM.d_model, 64)
    base, _ = pooled_image_base(samples)
    rows_d = layout_rows(samples, "packed", base, packing=PACK, cost=COST, row_multiple=4).rows
    loss_d, _, g_bb_d, g_emb = jax.jit(functools.partial(backbone_grads, dec))(
        bb_params, put_replicated(buffer, dec.bb.mesh), put_rows(rows_d, dec.bb.mesh), denom)
    cot = scatter_cotangent(samples, patches_e, np.asarray(g_emb), flat.shape)
    g_enc_d = jax.jit(encoder_grads)(vjp_fn, put_replicated(cot, dec.enc.mesh))
    assert abs(float(loss_d) - float(loss_m)) <= 1e-5 * abs(float(loss_m))
    _close(g_bb_d, g_bb_m)
    _close(g_enc_d, g_enc_m)
    # Guard against a vacuous pass: the encoder really receives gradient.
    assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g_enc_m)) > 1e-6


def test_strict_trainer_has_no_staleness_and_run_ahead_does(setup, meshes):
    """Through the System (the decoupled arm) and, for run_ahead=1, the trainer itself."""
    _, dec, enc_state, bb_state, _ = setup
    steps = [(k, step_samples(DATA, seed=0, step=k, batch_size=8)) for k in range(3)]
    system = FlowTrainSystem("decoupled", SPLIT)
    state = system.start(_config(0), meshes, enc_state, bb_state)
    assert state.sides is dec  # the System's sides are the run's: shared compilations
    strict, out = system.step(state, steps)
    st0 = [r["staleness"] for r in out["results"]]
    e, b = dec.place(enc_state, bb_state)  # fresh buffers: steps donate their input
    ahead = DecoupledTrainer(dec, e, b, packing=FIXED_ROWS, cost=COST, run_ahead=1,
                             pool_capacity=4)
    st1 = [r["staleness"] for r in ahead.run(steps)]
    assert st0 == [0, 0, 0]
    assert st1[0] == 0 and max(st1) == 1
    assert out["pool"]["max_occupancy"] <= 4 and out["pool"]["puts"] == 24
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(
        jax.tree.leaves(strict.enc.params), jax.tree.leaves(ahead.enc_state.params)))
    assert diff > 1e-4  # stale encoder gradients change the result far beyond f32 round-off


def test_flowtrain_system_step_is_the_trainers_and_equals_monolithic(setup, meshes):
    """``FlowTrainSystem.step`` (decoupled arm) is bit for bit a ``DecoupledTrainer`` run on the
    same state; the monolithic_packed arm from the same parameters has the same losses (f32
    tolerance of the module docstring) and zero staleness."""
    _, dec, enc_state, bb_state, _ = setup
    config = _config(0)
    systems = {m: FlowTrainSystem(m, SPLIT if m == "decoupled" else None)
               for m in ("decoupled", "monolithic_packed")}
    for name, system in systems.items():
        assert check_system(system, name) == []
    with pytest.raises(ValueError, match="mode='decoupled' split=None"):
        FlowTrainSystem("decoupled")
    steps = [(k, step_samples(DATA, seed=0, step=10 + k, batch_size=8)) for k in range(2)]
    host = host_copy(enc_state), host_copy(bb_state)
    state = systems["decoupled"].start(config, meshes, *host)
    assert is_system_state(state) and len(jax.tree.leaves(state)) == len(jax.tree.leaves(host))
    new, out = systems["decoupled"].step(state, steps)
    e, b = dec.place(*host)
    trainer = DecoupledTrainer(dec, e, b, packing=FIXED_ROWS, cost=COST, pool_capacity=4)
    rows = trainer.run(steps)
    for x, y in zip(jax.tree.leaves((new.enc, new.bb)),
                    jax.tree.leaves((trainer.enc_state, trainer.bb_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [float(r["metrics"]["loss"]) for r in out["results"]] == [
        float(r["metrics"]["loss"]) for r in rows]
    mono, mono_out = systems["monolithic_packed"].step(
        systems["monolithic_packed"].start(config, meshes, *host), steps)
    for r_d, r_m in zip(out["results"], mono_out["results"]):
        loss_d, loss_m = float(r_d["metrics"]["loss"]), float(r_m["metrics"]["loss"])
        assert abs(loss_d - loss_m) <= 1e-5 * abs(loss_m), (loss_d, loss_m)
        assert r_m["staleness"] == 0
    accuracy = systems["decoupled"].evaluate(new)["heldout_accuracy"]
    assert 0.0 <= accuracy <= 1.0
