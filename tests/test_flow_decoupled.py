"""Decoupled encoder/backbone gradients == monolithic gradients for the same samples.

Tolerance (f32): the two paths sum the same terms in a different order and on different meshes
(encoder on 2 devices, backbone on 4, monolithic on 8), so round-off differs; we require
max |g_dec - g_mono| <= 1e-5 * max |g_mono| + 1e-7 per parameter leaf. One-step-stale encoder
training (run_ahead=1) must differ from strict training by far more than that.
"""

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
from jaxflow.flow.steps import backbone_grads, build_sides, encoder_forward, encoder_grads, monolithic_grads
from jaxflow.flow.vit import ViTConfig
from jaxflow.mesh import make_mesh, role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

VIT = ViTConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, out_dim=32)
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


@pytest.fixture(scope="module")
def setup():
    full = make_mesh({"data": 8})
    roles = role_meshes({"encoder": 2, "backbone": 4})
    mono = build_sides(VIT, LM, full, full, OptimConfig(warmup_steps=1), 10)
    dec = build_sides(VIT, LM, roles["encoder"], roles["backbone"], OptimConfig(warmup_steps=1), 10)
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


def test_strict_trainer_has_no_staleness_and_run_ahead_does(setup):
    _, dec, enc_state, bb_state, _ = setup
    steps = [(k, step_samples(DATA, seed=0, step=k, batch_size=8)) for k in range(3)]

    def train(run_ahead):
        e, b = dec.place(enc_state, bb_state)  # fresh buffers: steps donate their input
        tr = DecoupledTrainer(dec, e, b, packing=FIXED_ROWS, cost=COST, run_ahead=run_ahead,
                              pool_capacity=4)
        out = tr.run(steps)
        return tr, [r["staleness"] for r in out]

    strict, st0 = train(0)
    ahead, st1 = train(1)
    assert st0 == [0, 0, 0]
    assert st1[0] == 0 and max(st1) == 1
    assert strict.pool.stats()["max_occupancy"] <= 4
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(
        jax.tree.leaves(strict.enc_state.params), jax.tree.leaves(ahead.enc_state.params)))
    assert diff > 1e-4  # stale encoder gradients change the result far beyond f32 round-off
