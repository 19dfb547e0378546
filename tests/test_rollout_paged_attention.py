"""Paged decode attention == the static sampler's attention on a contiguous cache.

The XLA backend must be bit-identical to ``dot_product_attention`` over a contiguous cache that
holds the same tokens at the same slots (the static sampler's ``Attention.decode``), whatever the
pages' order in the pool, the garbage in unused slots / pages, and the contiguous cache's length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.models.attention import cache_causal_mask, dot_product_attention
from jaxflow.rollout.paged_attention import gather_pages, paged_attention

B, H, KVH, D = 4, 8, 2, 16
S, PPS, POOL = 8, 5, 32  # page size, pages per sequence, pages in the pool
LENGTHS = np.array([1, 17, 40, 8], np.int32)  # 1 token, page boundary + 1, full table, one page


def _problem(dtype, static_len=41, seed=0):
    """q, a contiguous cache [B, static_len, KVH, D] and the same tokens scattered over pages
    (a random page per logical page; every other slot of the pool holds garbage)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, H, D)).astype(np.float32)
    pool_k = (rng.normal(size=(KVH, POOL, S, D)) * 30).astype(np.float32)  # garbage
    pool_v = (rng.normal(size=(KVH, POOL, S, D)) * 30).astype(np.float32)
    table = rng.permutation(POOL)[: B * PPS].reshape(B, PPS).astype(np.int32)
    ck = np.zeros((B, static_len, KVH, D), np.float32)
    cv = np.zeros((B, static_len, KVH, D), np.float32)
    for b, n in enumerate(LENGTHS):
        k = rng.normal(size=(n, KVH, D)).astype(np.float32)
        v = rng.normal(size=(n, KVH, D)).astype(np.float32)
        ck[b, :n], cv[b, :n] = k, v
        ck[b, n:] = rng.normal(size=(static_len - n, KVH, D))  # stale slots (invalid)
        for t in range(n):
            pool_k[:, table[b, t // S], t % S] = k[t]
            pool_v[:, table[b, t // S], t % S] = v[t]
        used = -(-n // S)
        table[b, used:] = rng.integers(-5, 10 * POOL, PPS - used)  # unused entries: anything
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(pool_k), cast(pool_v), jnp.asarray(LENGTHS), jnp.asarray(table),
            cast(ck), cast(cv))


def _static_decode(q, ck, cv, lengths):
    """What ``Attention.decode`` computes for one token at slot length-1 of a contiguous cache."""
    slots = (lengths - 1)[:, None]
    key_valid = jnp.arange(ck.shape[1])[None, :] < lengths[:, None]
    return dot_product_attention(q[:, None], ck, cv, cache_causal_mask(slots, key_valid))[:, 0]


def test_gather_pages_is_the_contiguous_cache():
    q, pk, pv, lengths, table, ck, cv = _problem(jnp.float32, static_len=PPS * S)
    got = np.asarray(gather_pages(pk, table))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(got[b, :n], np.asarray(ck)[b, :n])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("static_len", [41, PPS * S, 64, 100])
def test_xla_paged_attention_bit_identical_to_static_decode(dtype, static_len):
    q, pk, pv, lengths, table, ck, cv = _problem(dtype, static_len=static_len)
    want = jax.jit(_static_decode)(q, ck, cv, lengths)
    got = jax.jit(lambda *a: paged_attention(*a, backend="xla", kv_len=static_len))(
        q, pk, pv, lengths, table)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (B, H, D)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))


def test_auto_is_xla_on_cpu_and_bad_input_is_named():
    q, pk, pv, lengths, table, *_ = _problem(jnp.float32)
    np.testing.assert_array_equal(paged_attention(q, pk, pv, lengths, table),
                                  paged_attention(q, pk, pv, lengths, table, backend="xla"))
    with pytest.raises(ValueError, match="'nope'"):
        paged_attention(q, pk, pv, lengths, table, backend="nope")
    with pytest.raises(ValueError, match="KVH dividing H"):
        paged_attention(q[:, :3], pk, pv, lengths, table)
    with pytest.raises(ValueError, match="lengths must be int"):
        paged_attention(q, pk, pv, lengths.astype(jnp.float32), table)
    with pytest.raises(ValueError, match="page_table must be int"):
        paged_attention(q, pk, pv, lengths, table[:2])
