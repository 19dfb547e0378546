"""Pallas embedding bag == its reference in interpret mode (forward and table gradient).

Both kernel layouts run: "tpu" (HBM table, SMEM ids, double-buffered row DMAs, in-place
gradient row updates) and "gpu" (Triton row loads, atomic_add gradient scatter), at every
embedding dim class the compile gate builds: narrower than 128 lanes (16, 64), not a multiple
of 8 (100), 136 (TPU: whole rows; GPU: a masked second column block) and 256 (TPU: two
128-lane column blocks); bf16 tables through the TPU 8-row DMA windows, with row counts that
are and are not a multiple of 8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.embeddings.pooling import pool_bags
from pallas_kernels import dispatch
from pallas_kernels.embedding_bag import (
    EmbeddingBagBlockSizes,
    embedding_bag,
    embedding_bag_reference,
    unsupported_reason,
)

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}
# 10 bags in blocks of 8 and 136 columns in blocks of 128: 2 x 2 programs, both ragged.
LAYOUTS = {"tpu": EmbeddingBagBlockSizes(block_b=8, block_d=128),
           "gpu": EmbeddingBagBlockSizes(platform="gpu", block_b=8, block_d=128)}
SMALL = LAYOUTS["tpu"]
DIM = 136


def inputs(dtype, n_bags=10, bag_len=3, vocab=23, dim=DIM):
    table = jax.random.normal(jax.random.key(0), (vocab, dim), jnp.float32).astype(dtype)
    ids = jax.random.randint(jax.random.key(1), (n_bags, bag_len), -1, vocab)
    ids = ids.at[2].set(-1)  # an empty bag
    ids = ids.at[3].set(jnp.array([5, 5, 7]))  # a repeated id inside one bag
    return table, ids


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype,mode", [(jnp.float32, "sum"), (jnp.bfloat16, "mean")])
def test_forward_matches_reference(dtype, mode, layout):
    table, ids = inputs(dtype)
    got = embedding_bag(table, ids, mode=mode, block_sizes=LAYOUTS[layout], interpret=True)
    want = embedding_bag_reference(table, ids, mode)
    assert got.dtype == dtype and got.shape == (10, DIM)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), 0)


@pytest.mark.parametrize("layout,mode", [("tpu", "mean"), ("gpu", "sum")])
def test_gradient_matches_reference(layout, mode):
    table, ids = inputs(jnp.float32)
    w = jax.random.normal(jax.random.key(2), (10, DIM))
    loss = lambda f: (lambda t: jnp.sum(f(t) * w))
    got = jax.grad(loss(lambda t: embedding_bag(t, ids, mode=mode, block_sizes=LAYOUTS[layout],
                                                interpret=True)))(table)
    want = jax.grad(loss(lambda t: embedding_bag_reference(t, ids, mode)))(table)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(want)).sum() > 0


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
@pytest.mark.parametrize("dim", [16, 64, 100, 256])
def test_every_dim_forward_and_gradient(layout, dim):
    """Forward (sum) and table gradient (mean) == the reference at the dims of the gate."""
    table, ids = inputs(jnp.float32, n_bags=9, vocab=21, dim=dim)
    bs = LAYOUTS[layout]
    got = embedding_bag(table, ids, block_sizes=bs, interpret=True)
    np.testing.assert_allclose(got, embedding_bag_reference(table, ids), rtol=1e-6, atol=1e-6)
    w = jax.random.normal(jax.random.key(2), (9, dim))
    loss = lambda f: (lambda t: jnp.sum(f(t) * w))
    g = jax.grad(loss(lambda t: embedding_bag(t, ids, mode="mean", block_sizes=bs,
                                              interpret=True)))(table)
    want = jax.grad(loss(lambda t: embedding_bag_reference(t, ids, "mean")))(table)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(want)).sum() > 0


#: TPU layout with 8-id chunks: a 21-id bag is walked in 3 chunks (padded to 24).
CHUNKED = EmbeddingBagBlockSizes(block_b=8, block_d=128, block_l=8)


@pytest.mark.parametrize("dtype,mode", [(jnp.float32, "sum"), (jnp.bfloat16, "mean")])
def test_long_bags_are_tiled_over_the_bag(dtype, mode):
    """Bags longer than block_l (tiled in chunks, the output accumulated across them) ==
    the reference, forward and table gradient; a repeated id spans two chunks."""
    table, _ = inputs(dtype, vocab=23, dim=64)
    ids = jax.random.randint(jax.random.key(1), (9, 21), -1, 23)
    ids = ids.at[2].set(-1).at[5].set(jnp.array([3] * 10 + [4] * 11))  # empty; 3 in chunks
    # 0-1 and 4 in chunks 1-2
    got = embedding_bag(table, ids, mode=mode, block_sizes=CHUNKED, interpret=True)
    want = embedding_bag_reference(table, ids, mode)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    if dtype != jnp.float32:
        return
    w = jax.random.normal(jax.random.key(2), (9, 64))
    loss = lambda f: (lambda t: jnp.sum(f(t) * w))
    g = jax.grad(loss(lambda t: embedding_bag(t, ids, mode=mode, block_sizes=CHUNKED,
                                              interpret=True)))(table)
    want_g = jax.grad(loss(lambda t: embedding_bag_reference(t, ids, mode)))(table)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want_g)[[3, 4]]).sum() > 0


def test_chunk_and_block_l_bounds():
    assert [CHUNKED.chunk(n) for n in (3, 8, 9, 300)] == [3, 8, 8, 8]
    assert EmbeddingBagBlockSizes().chunk(257) == 128
    with pytest.raises(ValueError, match=r"block_l=512; valid: a power of two in \[8, 256\]"):
        EmbeddingBagBlockSizes(block_l=512)


def test_column_blocks_per_platform():
    """TPU splits columns only into 128-multiples that divide the dim; GPU masks a tail."""
    tpu, gpu = LAYOUTS["tpu"], LAYOUTS["gpu"]
    assert [tpu.columns(d) for d in (16, 64, 100, 128, 136, 256)] == [16, 64, 100, 128, 136, 128]
    assert EmbeddingBagBlockSizes(block_d=64).columns(256) == 256  # 64 lanes: whole rows
    assert [gpu.columns(d) for d in (16, 100, 136, 256)] == [16, 128, 128, 128]


@pytest.mark.parametrize("vocab", [24, 23])
def test_bf16_row_windows(vocab):
    """TPU layout, bf16: rows read from aligned 8-row DMA windows (23 rows: padded to 24)."""
    table, ids = inputs(jnp.bfloat16, n_bags=9, vocab=vocab, dim=64)
    ids = ids.at[4].set(jnp.array([vocab - 1, 0, 7]))  # the last row, the first, a window edge
    got = embedding_bag(table, ids, mode="mean", block_sizes=SMALL, interpret=True)
    want = embedding_bag_reference(table, ids, "mean")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)


def test_unsupported_dtype_refused_and_pooling_falls_back():
    table, ids = inputs(jnp.float16, n_bags=4, dim=8)
    assert unsupported_reason(jnp.float32) is None and unsupported_reason(jnp.bfloat16) is None
    assert "not float16" in unsupported_reason(jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 tables, not float16"):
        embedding_bag(table, ids, interpret=True)
    got = pool_bags(table, ids, "sum", backend="pallas")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pool_bags(table, ids, "sum")))
    with pytest.raises(dispatch.KernelUnavailable, match="not float16"):
        pool_bags(table, ids, "sum", backend="pallas_forced")


def test_validation_messages():
    table, ids = inputs(jnp.float32)
    with pytest.raises(ValueError, match="ids must be int32"):
        embedding_bag(table, ids[0], interpret=True)
    with pytest.raises(ValueError, match="mode='max'"):
        embedding_bag(table, ids, mode="max", interpret=True)


def test_block_sizes_validate_and_default_per_platform():
    assert EmbeddingBagBlockSizes.get_default("gpu").platform == "gpu"
    assert EmbeddingBagBlockSizes.get_default("tpu").platform == "tpu"
    with pytest.raises(ValueError, match="platform 'npu'"):
        EmbeddingBagBlockSizes(platform="npu")
    with pytest.raises(ValueError, match="block_b=12"):
        EmbeddingBagBlockSizes(block_b=12)


def test_pooling_backend_pallas_matches_xla():
    table, ids = inputs(jnp.float32, n_bags=4, dim=8)
    got = pool_bags(table, ids, "mean", backend="pallas_forced")
    np.testing.assert_allclose(got, pool_bags(table, ids, "mean"), rtol=1e-6, atol=1e-6)


def test_sharded_lookup_with_pallas_pooling():
    """The kernel inside the shard_map lookup (interpret mode) == the XLA pooling path."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxflow.embeddings import ShardedEmbeddings, TableSpec, make_sparse_optimizer
    from jaxflow.mesh import make_mesh

    mesh = make_mesh({"data": 8})
    specs = [TableSpec("a", 40, 8, "row_wise", "mean")]
    opt = make_sparse_optimizer("sgd", 0.1)
    ids = {"a": np.random.default_rng(0).integers(-1, 40, size=(8, 3)).astype(np.int32)}
    ids = jax.device_put(ids, NamedSharding(mesh, P("data")))
    outs = []
    for backend in ("xla", "pallas_forced"):
        emb = ShardedEmbeddings(specs, mesh, opt, capacity=4, pooling_backend=backend)
        outs.append(np.asarray(emb.lookup(emb.init(0), ids)["a"]))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-7)
