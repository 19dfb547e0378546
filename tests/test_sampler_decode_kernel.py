"""The static sampler's decode through a paged decode kernel (``jaxflow.models.decode_kernel``).

* CPU default: a sampler given a ``DecodeKernel`` lowers to the XLA sampler's very program (the
  kernel is inactive off TPU / GPU), so its draws are bit for bit the same.
* One layer's write + attention over the heads-major cache, the upstream kernels in Pallas
  interpret mode == the XLA reference over the [B, S, KVH, D] cache: the written caches equal
  exactly; the outputs within the paged-attention tolerances (``test_rollout_paged_attention``:
  f32 GPU kernel atol 1e-6; the TPU kernel rounds K/V to bf16, so on a bf16 cache
  |got - ref| <= 2^-7 * max|V|).
* The prefill's layer over the empty cache through the segment attention kernel (flash /
  splash in interpret mode) == the XLA reference: the written caches exactly, real prompt
  tokens' outputs within the f32 kernel tolerance; padding tokens' outputs differ (the kernel
  ran, not the reference). A capacity-dispatch MoE model's prefill keeps the reference.
* The whole sampler (prefill through flash, decode scan through the GPU paged kernel, both in
  interpret mode), f32, on a data x model mesh (rows over "data", heads over "model" in a
  shard_map): the same tokens as the XLA sampler, log-probs within 1e-5.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxflow.models import PRESETS, Transformer, make_sampler
from jaxflow.models import decode_kernel as decode_kernel_module
from jaxflow.models.attention import cache_causal_mask, dot_product_attention
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.kv_cache import write_heads_major, write_rows
from jaxflow.models.sampler import SamplingConfig
from jaxflow.rollout.paged_attention import paged_attention

TINY = PRESETS["tiny"]  # 4 heads, 2 K/V heads, head_dim 16
B, P, N = 4, 5, 6
LENGTHS = jnp.array([5, 3, 1, 4], jnp.int32)
PAGE = 8  # P + N = 11 slots -> 16 in the heads-major cache (2 pages per row)


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(nnx.jit(lambda: Transformer(TINY, rngs=nnx.Rngs(0)))())


@pytest.fixture(scope="module")
def prompts():
    tokens = jax.random.randint(jax.random.key(1), (B, P), 1, TINY.vocab_size, jnp.int32)
    return jnp.where(jnp.arange(P)[None] < LENGTHS[:, None], tokens, 0)


def _equal(a, b):
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


CONFIG = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=19)
KEY = jax.random.key(5)


def test_cpu_sampler_with_a_decode_kernel_is_the_xla_program(split_model, prompts):
    """Off TPU / GPU the kernel is inactive: the sampler lowers to the very same program."""
    graphdef, state = split_model
    kernel = DecodeKernel(paged_attention)
    assert not kernel.active()
    args = (state, prompts, LENGTHS, KEY)
    got = make_sampler(graphdef, CONFIG, decode_kernel=kernel).lower(*args).as_text()
    assert got == make_sampler(graphdef, CONFIG).lower(*args).as_text()


def _layer_problem(dtype):
    """A cache of 16 slots (2 pages) holding rows of 9, 1, 16 and 5 tokens after this step's
    write (row 3's new token is padding: not live), random q / k / v / earlier entries."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(7), 4)
    b, s, h, kvh, d = 4, 16, 4, 2, 16
    index = jnp.array([8, 0, 15, 5], jnp.int32)
    live = jnp.array([True, True, True, False])
    q = jax.random.normal(kq, (b, 1, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, 1, kvh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, 1, kvh, d), jnp.float32).astype(dtype)
    k_cache, v_cache = (x.astype(dtype) for x in jax.random.normal(kc, (2, b, s, kvh, d)))
    before = jnp.arange(s)[None, :] < index[:, None]
    key_valid = write_rows(before, live[:, None], index)
    return q, k, v, k_cache, v_cache, index, index[:, None], key_valid


@pytest.mark.parametrize("backend,dtype", [("gpu", jnp.float32), ("tpu", jnp.bfloat16)])
def test_layer_attention_through_the_kernel_matches_xla(backend, dtype):
    q, k, v, k_cache, v_cache, index, slots, key_valid = _layer_problem(dtype)
    want_k, want_v = write_rows(k_cache, k, index), write_rows(v_cache, v, index)
    want = dot_product_attention(q, want_k, want_v, cache_causal_mask(slots, key_valid))
    kernel = DecodeKernel(paged_attention, backend=backend, interpret=True, page_size=PAGE)
    width = kernel.stored_head_dim(q.shape[-1])
    assert width == (128 if backend == "tpu" else 16)

    heads_major = functools.partial(_heads_major, width=width)

    got, got_k, got_v = jax.jit(kernel.cache_attention)(
        q, k, v, heads_major(k_cache), heads_major(v_cache), index, slots, key_valid)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(heads_major(want_k)))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(heads_major(want_v)))
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-6 if dtype == jnp.float32 else 2.0**-7 * float(jnp.abs(want_v.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=0, atol=tol)


def _heads_major(x, *, width):
    """[B, S, KVH, D] -> [KVH, B, S, width] (zeros past D): the kernel's cache layout."""
    x = jnp.transpose(x, (2, 0, 1, 3))
    return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])


def _prefill_problem():
    """The sampler's prefill of one layer: an empty 16-slot cache, P = 5 new tokens per row,
    rows of 5, 3, 1 and 4 real tokens (right padding), random q / k / v (f32)."""
    kq, kk, kv = jax.random.split(jax.random.key(11), 3)
    b, s, h, kvh, d = 4, 16, 4, 2, 16
    q = jax.random.normal(kq, (b, P, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, P, kvh, d), jnp.float32)
    v = jax.random.normal(kv, (b, P, kvh, d), jnp.float32)
    index = jnp.zeros((b,), jnp.int32)
    valid = jnp.arange(P)[None, :] < LENGTHS[:, None]
    key_valid = write_rows(jnp.zeros((b, s), bool), valid, index)
    slots = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (b, P))
    return q, k, v, jnp.zeros((b, s, kvh, d)), index, slots, key_valid, valid


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_prefill_over_an_empty_cache_through_the_segment_kernel_matches_xla(backend):
    q, k, v, empty, index, slots, key_valid, valid = _prefill_problem()
    want_k, want_v = write_rows(empty, k, index), write_rows(empty, v, index)
    want = dot_product_attention(q, want_k, want_v, cache_causal_mask(slots, key_valid))
    kernel = DecodeKernel(paged_attention, backend=backend, interpret=True, page_size=PAGE)
    width = kernel.stored_head_dim(q.shape[-1])

    heads_major = functools.partial(_heads_major, width=width)

    got, got_k, got_v = jax.jit(kernel.prefill_attention)(
        q, k, v, heads_major(empty), heads_major(empty), index, slots, key_valid)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(heads_major(want_k)))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(heads_major(want_v)))
    assert got.shape == want.shape and got.dtype == want.dtype
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=0, atol=1e-6)
    # padding queries: the reference attends to the row's real tokens, the kernel to padding
    assert np.abs(np.asarray(got)[~real] - np.asarray(want)[~real]).max() > 0.1


def test_capacity_dispatch_moe_prefill_keeps_the_xla_reference():
    kernel = DecodeKernel(paged_attention, backend="gpu", interpret=True, page_size=PAGE)
    moe = dataclasses.replace(TINY, n_experts=4, n_experts_per_token=2, d_ff_expert=32)
    assert kernel.prefill_cache_attention(TINY) == kernel.prefill_attention
    assert kernel.prefill_cache_attention(moe) == kernel.prefill_attention  # dense MoE
    assert kernel.prefill_cache_attention(dataclasses.replace(moe, moe_impl="dispatch")) \
        == kernel.cache_attention


def test_heads_major_write_is_the_row_write_transposed():
    buffer = jnp.zeros((3, 5, 2, 4))
    new = jnp.arange(3 * 2 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 2, 4)
    index = jnp.array([0, 3, 1], jnp.int32)
    want = jnp.transpose(write_rows(buffer, new, index), (2, 0, 1, 3))
    got = write_heads_major(jnp.zeros((2, 3, 5, 8)), new, index)
    np.testing.assert_array_equal(np.asarray(got[..., :4]), np.asarray(want))
    assert not np.asarray(got[..., 4:]).any()


def test_sampler_through_the_gpu_kernel_interpret_on_a_mesh_matches_xla(split_model, prompts,
                                                                        monkeypatch):
    """Prefill (flash) + decode scan (the paged kernel) under a data 2 x model 2 mesh (the
    kernels per device on its rows and K/V heads, in shard_maps) draw the XLA sampler's
    tokens."""
    graphdef, state = split_model
    kernel = DecodeKernel(paged_attention, backend="gpu", interpret=True, page_size=PAGE)
    want = make_sampler(graphdef, CONFIG)(state, prompts, LENGTHS, KEY)
    calls = []

    def segment_attention(q, k, v, segment_ids, **kw):
        calls.append((q.shape, kw))
        return attention(q, k, v, segment_ids, **kw)

    attention = decode_kernel_module.segment_attention
    monkeypatch.setattr(decode_kernel_module, "segment_attention", segment_attention)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        got = make_sampler(graphdef, CONFIG, decode_kernel=kernel)(state, prompts, LENGTHS, KEY)
    # the prefill's attention: flash in interpret mode, once per layer (traced once)
    assert calls == [((B, P, TINY.n_heads, TINY.head_dim),
                      {"backend": "flash", "interpret": True})] * TINY.n_layers
    assert 0 < float(want.mask.sum()) < want.mask.size  # some rows stop at eos_id 19
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=0,
                               atol=1e-5)


def test_cache_length_is_whole_pages_in_blocks_the_kernel_can_read():
    kernel = DecodeKernel(paged_attention)  # pages of 64
    assert kernel.cache_length(1033) == 1152  # 18 pages (not 17: the TPU kernel reads 6 at once)
    assert kernel.cache_length(4096) == 4096
    assert kernel.cache_length(40) == 64  # a 128-token chunk would pad by more than 1/8
    assert DecodeKernel(paged_attention, page_size=PAGE).cache_length(P + N) == 16


def test_decode_kernel_validation(split_model):
    with pytest.raises(ValueError, match=r"backend='cuda'; valid: auto, tpu, gpu"):
        DecodeKernel(paged_attention, backend="cuda")
    with pytest.raises(ValueError, match="page_size=12: must be a multiple of 8"):
        DecodeKernel(paged_attention, page_size=12)
    with pytest.raises(ValueError, match="interpret=True.*not 'auto'"):
        DecodeKernel(paged_attention, interpret=True)
    with pytest.raises(TypeError, match="must be callable"):
        DecodeKernel("paged")
    with pytest.raises(TypeError, match="decode_kernel='tpu': must be a DecodeKernel or None"):
        make_sampler(split_model[0], SamplingConfig(), decode_kernel="tpu")
