"""The engine's pool layout: padded to 128 lanes where decode runs the TPU kernel, else as before.

``jaxflow.rollout.pages.pool_head_dim`` picks the pools' last axis: on CPU (``auto`` / ``xla``)
the model's head_dim, so nothing changes; with the TPU kernel (here in interpret mode) 128 lanes,
so the kernel pads nothing per call. An engine with padded pools must draw what the same engine
with unpadded pools (padded per call inside the kernel's wrapper) draws: the kernel sees the same
zero-padded arrays either way, so tokens and log-probs are equal bit for bit. The compile gate
(``tests/aot/test_rollout_pool_layout_gate.py``) checks the compiled TPU program.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import PRESETS, SamplingConfig, Transformer
from jaxflow.rollout import RolloutEngine
from jaxflow.rollout import engine as engine_module
from jaxflow.rollout.engine import EngineConfig
from jaxflow.rollout.pages import pool_head_dim

TINY = dataclasses.replace(PRESETS["tiny"], n_layers=1)  # head_dim 16
PROMPTS = np.array([[3, 4, 5, 6, 0], [7, 8, 0, 0, 0]], np.int32)
LENGTHS = np.array([4, 2], np.int32)
SAMPLING = SamplingConfig(max_new_tokens=3, temperature=1.0)


def _shape(**kw):
    args = dict(n_heads=4, n_kv_heads=2, head_dim=64, rows=4, num_pages=9, page_size=8,
                pages_per_seq=2, dtype=jnp.float32)
    return pool_head_dim(**(args | kw))


def test_pool_head_dim_pads_only_for_the_tpu_kernel():
    assert _shape() == 64  # auto on CPU: xla
    assert _shape(backend="xla") == 64
    assert _shape(backend="tpu", interpret=True) == 128
    assert _shape(backend="gpu", interpret=True) == 64  # the GPU kernel takes 64 lanes
    assert _shape(head_dim=128, backend="tpu", interpret=True) == 128
    assert _shape(head_dim=192, backend="tpu", interpret=True) == 256
    with pytest.raises(ValueError, match="runs on tpu only"):
        _shape(backend="tpu")  # the kernel off its platform, not in interpret mode


def _engine(split, **kw):
    graphdef, state = split
    config = EngineConfig(slots=2, page_size=4, num_pages=8, prefill_chunk=4, max_seq_len=8,
                          narrow_tables=False, **kw)
    return RolloutEngine(graphdef, state, config, SAMPLING)


def test_padded_pools_draw_what_per_call_padding_draws(monkeypatch):
    split = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    keys = jax.random.split(jax.random.key(1), len(LENGTHS))
    cpu = _engine(split)
    assert cpu.pools.k[0].shape[-1] == TINY.head_dim == cpu.pool_head_dim  # CPU: unchanged
    padded = _engine(split, attention="tpu", interpret=True)
    assert padded.pools.k[0].shape[-1] == 128 and padded.page_bytes == 128 // 16 * cpu.page_bytes
    got = padded.generate(PROMPTS, LENGTHS, keys)
    for pool in padded.pools.k + padded.pools.v:  # written, and zeros past head_dim
        assert np.abs(np.asarray(pool[..., :16])).max() > 0
        np.testing.assert_array_equal(np.asarray(pool[..., 16:]), 0.0)
    monkeypatch.setattr(engine_module, "pool_head_dim", lambda **kw: kw["head_dim"])
    per_call = _engine(split, attention="tpu", interpret=True)
    assert per_call.pools.k[0].shape[-1] == 16
    want = per_call.generate(PROMPTS, LENGTHS, keys)
    assert np.asarray(want.mask).sum() == 2 * SAMPLING.max_new_tokens
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
