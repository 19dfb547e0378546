"""Paged attention == the static sampler's attention on a contiguous cache; kernels == XLA.

The XLA backend must be bit-identical to ``dot_product_attention`` over a contiguous cache that
holds the same tokens at the same slots (the static sampler's ``Attention.decode``), whatever the
pages' order in the pool, the garbage in unused slots / pages, and the contiguous cache's length.

The upstream decode kernels run here in Pallas interpret mode (TPU: the TPU interpreter; GPU:
the generic one). Tolerances:
* f32, GPU kernel: atol 1e-6 (same f32 logits and softmax, reassociated by the online softmax;
  seen: 2.4e-7 on outputs of size ~1).
* f32, TPU kernel: the kernel rounds K and V to bf16 after loading them (its
  ``_maybe_dequantize``), so it is compared with the reference on bf16-rounded K/V, atol 1e-6
  (seen: 1.8e-7).
* bf16: |got - ref| <= 2^-7 * max|V|. The reference rounds each probability to bf16 before P.V
  (relative error <= u = 2^-8, so <= u * max|V| on the sum) and both round the output (<= u *
  max|V|); the kernels keep f32 probabilities. A wrong mask, scale or page gives O(1) errors.
The ragged TPU kernel does not run in the TPU interpreter of jax 0.10.2 (its reshaped VMEM refs:
``'ReshapeTransform' object has no attribute 'indices'``); its XLA reference is checked against
upstream's own ``ref_ragged_paged_attention`` and the decode path, and the kernel is compiled by
the gate (``tests/aot/test_rollout_paged_attention_gate.py``).
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.models.attention import cache_causal_mask, dot_product_attention
from jaxflow.rollout import paged_attention as pa
from jaxflow.rollout.paged_attention import gather_pages, paged_attention

B, H, KVH, D = 4, 8, 2, 16
S, PPS, POOL = 8, 5, 32  # page size, pages per sequence, pages in the pool
LENGTHS = np.array([1, 17, 40, 8], np.int32)  # 1 token, page boundary + 1, full table, one page


def _problem(dtype, static_len=41, seed=0, D=D):  # noqa: N803 (the module's shape name)
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
    with pytest.raises(ValueError, match="runs on tpu only.*valid here: auto, xla"):
        paged_attention(q, pk, pv, lengths, table, backend="tpu")
    with pytest.raises(ValueError, match="'nope'"):
        paged_attention(q, pk, pv, lengths, table, backend="nope")
    with pytest.raises(ValueError, match="KVH dividing H"):
        paged_attention(q[:, :3], pk, pv, lengths, table)
    with pytest.raises(ValueError, match="lengths must be int"):
        paged_attention(q, pk, pv, lengths.astype(jnp.float32), table)
    with pytest.raises(ValueError, match="page_table must be int"):
        paged_attention(q, pk, pv, lengths, table[:2])


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_decode_kernels_match_xla_f32_interpret(backend, monkeypatch):
    q, pk, pv, lengths, table, *_ = _problem(jnp.float32)
    # TPU: page tables of 3 rows per kernel call (rows 0-2, then 3), as a long context's would be
    monkeypatch.setattr(pa, "TPU_SMEM_TABLE", 4 * PPS * 3)
    got = paged_attention(q, pk, pv, lengths, table, backend=backend, interpret=True)
    if backend == "tpu":  # the kernel computes with bf16 K/V (see the module docstring)
        pk, pv = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (pk, pv))
    want = paged_attention(q, pk, pv, lengths, table, backend="xla")
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_decode_kernels_match_xla_bf16_interpret(backend):
    q, pk, pv, lengths, table, *_ = _problem(jnp.bfloat16)
    got = paged_attention(q, pk, pv, lengths, table, backend=backend, interpret=True)
    want = paged_attention(q, pk, pv, lengths, table, backend="xla")
    assert got.dtype == jnp.bfloat16
    tol = 2.0**-7 * float(jnp.abs(pv.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=0, atol=tol)


@pytest.mark.parametrize("backend", ["xla", "tpu", "gpu"])
def test_free_slots_of_length_0_give_zeros(backend):
    q, pk, pv, lengths, table, *_ = _problem(jnp.float32)
    lengths = lengths.at[1].set(0)
    got = np.asarray(paged_attention(q, pk, pv, lengths, table, backend=backend,
                                     interpret=backend != "xla"))
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.isfinite(got).all() and np.abs(got[[0, 2, 3]]).max() > 0


def _pallas_operand_widths(fn, *args) -> set[int]:
    """The last-axis sizes of every array operand of the pallas_calls ``fn`` traces to."""
    widths = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                widths.update(v.aval.shape[-1] for v in eqn.invars if v.aval.ndim >= 3)
        for sub in jax.extend.core.subjaxprs(jaxpr):
            walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return widths


def test_tpu_kernel_at_head_dim_64_runs_in_the_padded_layout():
    """head_dim 64 (which upstream's Mosaic blocks reject): the TPU kernel sees 128 lanes and
    gives the XLA reference's result (f32, bf16-rounded K/V as above; atol 1e-6)."""
    q, pk, pv, lengths, table, *_ = _problem(jnp.float32, D=64)
    fn = lambda *a: paged_attention(*a, backend="tpu", interpret=True)  # noqa: E731
    assert _pallas_operand_widths(fn, q, pk, pv, lengths, table) == {128}
    got = fn(q, pk, pv, lengths, table)
    pk, pv = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (pk, pv))
    want = paged_attention(q, pk, pv, lengths, table, backend="xla")
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "tpu", "gpu"])
def test_a_pool_stored_padded_gives_the_unpadded_result(backend):
    """The padded layout (pools of 128 lanes, zeros past q's 64): every backend returns what it
    returns on the unpadded pool, bit for bit (xla slices, the kernels pad q / see zeros)."""
    q, pk, pv, lengths, table, *_ = _problem(jnp.float32, D=64)
    if backend == "tpu":
        pk, pv = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (pk, pv))
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, 64)])  # noqa: E731
    run = lambda k, v: paged_attention(q, k, v, lengths, table, backend=backend,  # noqa: E731
                                       interpret=backend != "xla")
    got, want = run(pad(pk), pad(pv)), run(pk, pv)
    assert got.shape == q.shape and np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"D=64\] \(or D=128, the padded layout\)"):
        paged_attention(q, pk[..., :32], pv[..., :32], lengths, table, backend=backend)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernels_under_a_mesh_split_heads_over_model(backend):
    """Under ``jax.set_mesh`` the kernel runs per device on its own heads (model axis of 2)."""
    q, pk, pv, lengths, table, *_ = _problem(jnp.float32)
    if backend == "tpu":
        pk, pv = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (pk, pv))
    want = paged_attention(q, pk, pv, lengths, table, backend="xla")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("model",))
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda *a: paged_attention(*a, backend=backend, interpret=True))
        text = fn.lower(q, pk, pv, lengths, table).as_text()
        got = fn(q, pk, pv, lengths, table)
    assert "shard_map" in text or "manual" in text
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def _ragged(dtype, seed=1, d=128):
    """A ragged batch over the combined pool: a decode row (1 query, 17 tokens), a chunk of 5
    continuing a 4-token prefix, a fresh 3-token prefill, then one unused row; 2 padding
    query tokens. D = 128: the ragged kernel's lane width (64: its padded layout)."""
    rng = np.random.default_rng(seed)
    h, kvh, s, pool = 4, 2, 8, 24
    q = jnp.asarray(rng.normal(size=(11, h, d)), dtype)
    kp, vp = (jnp.asarray(rng.normal(size=(kvh, pool, s, d)), dtype) for _ in range(2))
    table = jnp.asarray(rng.permutation(pool)[:16].reshape(4, 4), jnp.int32)
    cu = jnp.asarray([0, 1, 6, 9, 9], jnp.int32)
    kv_lens = jnp.asarray([17, 9, 3, 0], jnp.int32)
    return q, kp, vp, kv_lens, table, cu, jnp.asarray([3], jnp.int32)


def test_combined_pool_round_trip():
    _, kp, vp, *_ = _ragged(jnp.float32)
    kv = pa.combine_kv_pages(kp, vp)
    assert kv.shape == (24, 8, 4, 128)
    np.testing.assert_array_equal(kv[:, :, 2], kp[1])  # K of head 1
    np.testing.assert_array_equal(kv[:, :, 3], vp[1])
    k, v = pa.split_kv_pages(kv)
    np.testing.assert_array_equal(k, kp)
    np.testing.assert_array_equal(v, vp)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_xla_matches_upstream_reference(dtype):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    q, kp, vp, kv_lens, table, cu, n = _ragged(dtype)
    kv = pa.combine_kv_pages(kp, vp)
    got = pa.ragged_paged_attention(q, kv, kv_lens, table, cu, n)  # auto: xla on CPU
    want = ref_ragged_paged_attention(q, kv, kv_lens, table, cu, n, sm_scale=128**-0.5)
    assert got.shape == q.shape and got.dtype == jnp.dtype(dtype)
    # upstream's reference: same f32 logits and softmax, with repeated K/V heads and an additive
    # mask (reassociated sums: f32 atol 1e-6; bf16 as the decode kernels, 2^-7 * max|V|)
    tol = 1e-6 if dtype == jnp.float32 else 2.0**-7 * float(jnp.abs(vp.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got[:9], np.float32), np.asarray(want, np.float32),
                               rtol=0, atol=tol)
    np.testing.assert_array_equal(np.asarray(got[9:], np.float32), 0.0)  # padding queries


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_decode_batch_is_paged_decode(dtype):
    """A ragged batch of one query per row is the decode path, bit for bit (same arithmetic)."""
    q, kp, vp, _, table, *_ = _ragged(dtype)
    lengths = jnp.asarray([17, 9, 3, 30], jnp.int32)
    dec = paged_attention(q[:4], kp, vp, lengths, table, backend="xla")
    rag = pa.ragged_paged_attention(q[:4], pa.combine_kv_pages(kp, vp), lengths, table,
                                    jnp.arange(5, dtype=jnp.int32), jnp.asarray([4], jnp.int32),
                                    backend="xla")
    np.testing.assert_array_equal(np.asarray(rag, np.float32), np.asarray(dec, np.float32))


def test_ragged_bad_input_is_named():
    q, kp, vp, kv_lens, table, cu, n = _ragged(jnp.float32)
    kv = pa.combine_kv_pages(kp, vp)
    with pytest.raises(ValueError, match="cu_q_lens must be int32 \\[5\\]"):
        pa.ragged_paged_attention(q, kv, kv_lens, table, cu[:4], n)
    with pytest.raises(ValueError, match="backend 'gpu'; valid: auto, xla, tpu"):
        pa.ragged_paged_attention(q, kv, kv_lens, table, cu, n, backend="gpu")


def test_tpu_ragged_at_head_dim_64_runs_in_the_padded_layout(monkeypatch):
    """head_dim 64: the ragged kernel sees 128 lanes (q and an unpadded pool padded, a pool
    stored padded as it is) with the true D^-0.5 scale, and the output loses the padded lanes.
    The kernel does not run in jax 0.10.2's TPU interpreter (module docstring): the wrapper is
    run around upstream's ``ref_ragged_paged_attention`` in its place and must give the XLA
    reference (f32, atol 1e-6); the gate compiles the kernel itself at these widths."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as upstream

    q, kp, vp, kv_lens, table, cu, n = _ragged(jnp.float32, d=64)
    kv = pa.combine_kv_pages(kp, vp)
    args = (kv_lens, table, cu, n)
    assert _pallas_operand_widths(lambda *a: pa.tpu_ragged_paged_attention(q, *a), kv, *args) == {128}
    seen = []

    def kernel(q, kv_pages, *rest, sm_scale, **blocks):
        seen.append((q.shape[-1], kv_pages.shape[-1], sm_scale))
        return upstream.ref_ragged_paged_attention(q, kv_pages, *rest, sm_scale=sm_scale)

    monkeypatch.setattr(upstream, "ragged_paged_attention", kernel)
    want = np.asarray(pa.ragged_paged_attention(q, kv, *args, backend="xla"))
    padded_kv = jnp.pad(kv, [(0, 0)] * 3 + [(0, 64)])
    np.testing.assert_array_equal(  # the xla reference cuts a padded pool: same result
        np.asarray(pa.ragged_paged_attention(q, padded_kv, *args, backend="xla")), want)
    for pool in (kv, padded_kv):
        got = np.asarray(pa.tpu_ragged_paged_attention(q, pool, *args))
        assert got.shape == (9, 4, 64)  # upstream's reference returns the real tokens only
        np.testing.assert_allclose(got, want[:9], rtol=0, atol=1e-6)
    assert seen == [(128, 128, 64**-0.5)] * 2
    with pytest.raises(ValueError, match=r"D=64\] \(or D=128, the padded layout\)"):
        pa.ragged_paged_attention(q, kv[..., :32], *args)
