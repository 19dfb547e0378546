"""Gradient accumulation in the LM train step (``train.microbatches``,
:func:`jaxflow.train.lm_state.make_train_step`): k micro-batches give the single-batch step's
loss, metrics and updated parameters up to float32 rounding, on an 8-device FSDP mesh; and the
fused loss (``train.fused_loss``: the NLL by vocab tiles of the head, no [B, L, V] logits) gives
the logits loss's, with and without accumulation.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import configs.lm_pretrain as lm_config
from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import init_train_state
from jaxflow.train.pretrain import build_task, build_train_step, host_batch

TINY = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                         max_seq_len=32)


def _config(microbatches: int, fused_loss: bool = False):
    base = lm_config.get_config("quick")
    return dataclasses.replace(
        base, model=TINY, mesh=MeshConfig(axes=("data", "fsdp", "model"), shape=(1, -1, 1)),
        train=dataclasses.replace(base.train, batch_size=16, seq_len=32,
                                  microbatches=microbatches, fused_loss=fused_loss))


@pytest.fixture(scope="module")
def one_step():
    """{(k, fused): (metrics, params)} after one step from the same state and batch."""
    out = {}
    for k, fused in ((1, False), (2, False), (1, True), (2, True)):
        config = _config(k, fused)
        built = build_train_step(config, config.mesh.make())
        state, _ = init_train_state(built.fns, config.model, built.tx, jax.random.key(0))
        tokenizer, task = build_task(config)
        batch = jax.device_put(host_batch(config, task, tokenizer, 0), built.batch_sharding)
        state, metrics = built.train_step(state, batch)
        out[k, fused] = (jax.device_get(metrics), jax.device_get(state.params))
    return out


@pytest.mark.parametrize("pair", [((1, False), (2, False)), ((1, False), (1, True)),
                                  ((1, False), (2, True))], ids=["accumulated", "fused", "fused-accumulated"])
def test_step_equals_the_single_batch_logits_step(one_step, pair):
    (m1, p1), (m2, p2) = one_step[pair[0]], one_step[pair[1]]
    for key in ("loss", "token_accuracy", "tokens", "grad_norm"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-6, err_msg=key)
    moved = 0
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                   rtol=1e-5, atol=1e-6)
        moved += int(np.any(a != 0))
    assert moved > 0


def test_microbatches_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"train.microbatches=3 does not divide "
                                         r"train.batch_size=16"):
        _config(3)
