"""Gradient accumulation in the LM train step (``train.microbatches``,
:func:`jaxflow.train.lm_state.make_train_step`): k micro-batches give the single-batch step's
loss, metrics and updated parameters up to float32 rounding, on an 8-device FSDP mesh.
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


def _config(microbatches: int):
    base = lm_config.get_config("quick")
    return dataclasses.replace(
        base, model=TINY, mesh=MeshConfig(axes=("data", "fsdp", "model"), shape=(1, -1, 1)),
        train=dataclasses.replace(base.train, batch_size=16, seq_len=32,
                                  microbatches=microbatches))


@pytest.fixture(scope="module")
def one_step():
    """{k: (metrics, params)} after one step from the same state and batch."""
    out = {}
    for k in (1, 2):
        config = _config(k)
        built = build_train_step(config, config.mesh.make())
        state, _ = init_train_state(built.fns, config.model, built.tx, jax.random.key(0))
        tokenizer, task = build_task(config)
        batch = jax.device_put(host_batch(config, task, tokenizer, 0), built.batch_sharding)
        state, metrics = built.train_step(state, batch)
        out[k] = (jax.device_get(metrics), jax.device_get(state.params))
    return out


def test_accumulated_step_equals_the_single_batch_step(one_step):
    (m1, p1), (m2, p2) = one_step[1], one_step[2]
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
