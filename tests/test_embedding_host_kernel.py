"""The fused host-kernel embedding step (``embeddings.fused_step``) == the XLA ``shard_map``
step on a one-device CPU mesh, and == the dense reference.

Tolerances: the first step's pooled outputs (hence its loss) are bit-identical (same sums in
the same order, straight from the same table). The updated rows agree to a few ulp (rtol 1e-6,
atol 1e-7): the kernel sums each row's gradient in batch order as XLA's scatter-add does (the
SGD kernel test below is exact against a sequential float32 loop), but the loss gradient
around it is compiled in a different program (XLA may rewrite ``x / B`` and fuse differently),
and row-wise Adagrad's ``mean(g^2)`` is a vectorised reduction in XLA, sequential here. Also:
the kernels' dedup (direct addressing and the sort path) and the backend switch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, host_kernel, make_sparse_optimizer
from jaxflow.embeddings.lookup import CapacityOverflowError
from jaxflow.embeddings.reference import reference_step
from jaxflow.embeddings.step import make_train_step, step_backend
from jaxflow.mesh import make_mesh
from jaxflow.train.state import TrainState

B = 12
SPECS = [
    TableSpec("a", 40, 8, "row_wise", "sum"),
    TableSpec("b", 25, 8, "table_wise", "mean", id_policy="hash_modulo"),
    TableSpec("c", 30, 4, "replicated", "sum"),
]
BAG = {"a": 3, "b": 2, "c": 4}


def batch(t):
    rng = np.random.default_rng(t)
    ids = {s.name: rng.integers(0, s.vocab_size * (3 if s.name == "b" else 1),
                                size=(B, BAG[s.name])).astype(np.int32) for s in SPECS}
    ids["a"][::3, 1] = -1
    ids["c"][1] = -1  # an empty bag
    w = {s.name: rng.standard_normal((B, s.dim)).astype(np.float32) for s in SPECS}
    return ids, w


def loss_fn(params, outputs, w):
    """Squared error: its gradient depends on the looked-up rows (as a real model's does)."""
    return sum(jnp.sum(jnp.square(outputs[k] - w[k])) for k in outputs) / B, {}


@pytest.fixture(scope="module")
def one():
    return make_mesh({"data": 1}, jax.devices()[:1])


def train(emb, backend, steps, loss=loss_fn, dense=None):
    """(final state, metrics per step, host (tables, opt) after each step)."""
    step = make_train_step(emb, loss, backend=backend)
    state = {"emb": emb.init(3), "dense": {} if dense is None else dense}
    metrics, snapshots = [], []
    for t in range(steps):
        ids, w = batch(t)
        state, m = step(state, ids, w)
        metrics.append(jax.device_get(m))
        snapshots.append(emb.to_dense(state["emb"]))
    return state, metrics, snapshots


@pytest.fixture(scope="module", params=["sgd", "rowwise_adagrad"])
def runs(request, one):
    """Both backends, 2 steps each, on the same tables and batches (compiled once per module)."""
    emb = ShardedEmbeddings(SPECS, one, make_sparse_optimizer(request.param, 0.1), capacity=64)
    return emb, train(emb, "auto", 2), train(emb, "xla", 2)


def test_fused_step_equals_xla_step(runs):
    emb, (fused, m_fused, _), (xla, m_xla, _) = runs
    assert step_backend(emb) == "host_kernel"
    np.testing.assert_array_equal(m_fused[0]["loss"], m_xla[0]["loss"])  # pooling: bit-identical
    for got, want in zip(m_fused, m_xla):
        assert set(got) == set(want)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
        for k in ("overflow", "bad_ids", "max_unique"):
            assert int(got[k]) == int(want[k]), k
    assert int(fused["emb"]["step"]) == 2
    for a, b in zip(jax.tree.leaves(fused["emb"]), jax.tree.leaves(xla["emb"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_fused_step_equals_reference(runs):
    emb, (_, _, snapshots), _ = runs
    tables, opt = emb.to_dense(emb.init(3))
    ids, w = batch(0)
    want_t, want_o = reference_step(SPECS, emb.optimizer, tables, opt, 1, ids,
                                    lambda out: loss_fn({}, out, w)[0])
    got_t, got_o = snapshots[0]
    for s in SPECS:  # sum order differs from the dense gradient's: float rounding only
        np.testing.assert_allclose(got_t[s.name], want_t[s.name], rtol=1e-6, atol=1e-6, err_msg=s.name)
        for k in want_o[s.name]:
            np.testing.assert_allclose(got_o[s.name][k], want_o[s.name][k], rtol=1e-5, atol=1e-8)


def test_fused_step_trains_the_dense_state(one):
    """A dense ``TrainState`` beside the tables: params and optimizer state as the XLA step's."""
    emb = ShardedEmbeddings(SPECS, one, make_sparse_optimizer("sgd", 0.05), capacity=64)

    def loss(params, outputs, w):
        return sum(jnp.sum(jnp.square(outputs[k] * params["s"][i] - w[k]))
                   for i, k in enumerate(sorted(outputs))) / B, {"norm": jnp.sum(params["s"])}

    def dense():
        return TrainState.create(optax.adam(1e-2), {"s": jnp.ones((3,))})

    fused, m_fused, _ = train(emb, "host_kernel", 2, loss, dense())
    xla, m_xla, _ = train(emb, "xla", 2, loss, dense())
    np.testing.assert_allclose(m_fused[-1]["norm"], m_xla[-1]["norm"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(xla)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_fused_step_counts_overflow_and_bad_ids(one):
    specs = [TableSpec("a", 40, 8, "row_wise", "sum")]
    emb = ShardedEmbeddings(specs, one, make_sparse_optimizer("sgd", 0.1), capacity=4)
    step = make_train_step(emb, lambda p, out, w: (jnp.sum(jnp.square(out["a"])), {}), backend="host_kernel")
    ids = {"a": np.array([[0, 1, 2], [3, 4, 41]], np.int32)}  # 5 distinct rows and one bad id
    _, m = step({"emb": emb.init(0), "dense": {}}, ids, {})
    assert int(m["overflow"]) == 1 and int(m["bad_ids"]) == 1 and int(m["max_unique"]) == 5
    with pytest.raises(CapacityOverflowError, match="capacity 4"):
        check_stats(m, 4)


def test_backend_switch(one):
    eight = make_mesh({"data": 8})
    adam = ShardedEmbeddings(SPECS, one, make_sparse_optimizer("adam", 0.1))
    sharded = ShardedEmbeddings(SPECS, eight, make_sparse_optimizer("sgd", 0.1))
    assert step_backend(adam) == "xla" and step_backend(sharded) == "xla+owner_kernel"
    assert step_backend(sharded, "xla") == "xla"
    with pytest.raises(ValueError, match="'host_kernel' unavailable: axis 'data' has 8 devices"):
        step_backend(sharded, "host_kernel")
    with pytest.raises(ValueError, match="optimizer 'adam'"):
        make_train_step(adam, loss_fn, backend="host_kernel")
    with pytest.raises(ValueError, match="backend 'numba'; valid: auto, xla, host_kernel"):
        step_backend(adam, "numba")


def test_owner_kernel_on_four_devices_equals_xla():
    """4 devices: the shard_map step with the owners' updates by the host kernel (row-wise
    sharded, table-wise and replicated groups, Adagrad) == the step in XLA, within rounding."""
    emb = ShardedEmbeddings(SPECS, make_mesh({"data": 4}, jax.devices()[:4]),
                            make_sparse_optimizer("rowwise_adagrad", 0.1), capacity=64)
    assert step_backend(emb) == "xla+owner_kernel"
    (kernel, m_kernel, _), (xla, m_xla, _) = train(emb, "auto", 2), train(emb, "xla", 2)
    np.testing.assert_array_equal(m_kernel[0]["loss"], m_xla[0]["loss"])
    assert int(m_kernel[-1]["max_unique"]) == int(m_xla[-1]["max_unique"])
    for a, b in zip(jax.tree.leaves(kernel["emb"]), jax.tree.leaves(xla["emb"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [50, 10**6])  # direct addressing; the sort path (rows >> ids)
def test_update_kernel_matches_numpy(rows):
    """Dedup + per-row accumulation + Adagrad against a numpy loop (np.add.at sums in order)."""
    rng = np.random.default_rng(rows)
    dim, n_bags, length = 4, 6, 3
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    accum = rng.random(rows).astype(np.float32)
    keys = rng.integers(0, 50, n_bags * length).astype(np.int32) * (rows // 50)
    keys[::4] = np.iinfo(np.int32).max
    desc, nb = host_kernel.bag_layout([(n_bags, length, False)])
    grad = rng.standard_normal((nb, dim)).astype(np.float32)
    want_t, want_a = table.copy(), accum.copy()
    valid = keys != np.iinfo(np.int32).max
    g = np.zeros((rows, dim), np.float32)
    np.add.at(g, keys[valid], grad[np.repeat(np.arange(nb), length)[valid]])
    uniq = np.unique(keys[valid])
    want_a[uniq] += np.mean(np.square(g[uniq]), axis=-1)
    want_t[uniq] -= np.float32(0.1) * g[uniq] / (np.sqrt(want_a[uniq])[:, None] + np.float32(1e-8))
    stats = np.zeros(2, np.int32)
    host_kernel.update_numpy(table, accum, keys, desc, grad, np.float32([0.1, 1e-8]),
                             np.int32([host_kernel.KIND_ADAGRAD, 100]), stats)
    assert list(stats) == [len(uniq), 0]
    np.testing.assert_allclose(table, want_t, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(accum, want_a, rtol=1e-6)


def test_sgd_kernel_sums_in_batch_order():
    """Mean bags, padding, repeated rows: the SGD update == a sequential float32 loop, bit for bit."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((20, 4)).astype(np.float32)
    keys = rng.integers(0, 6, 15).astype(np.int32)
    keys[[2, 6, 7, 8]] = np.iinfo(np.int32).max  # padding; bag 2 (the mean table's first) is empty
    desc, nb = host_kernel.bag_layout([(2, 3, False), (3, 3, True)])
    grad = rng.standard_normal((nb, 4)).astype(np.float32)
    want = table.copy()
    g = np.zeros_like(table)
    for i, k in enumerate(keys):
        if k < 20:
            b = i // 3
            count = max(1, int(np.sum(keys[b * 3:b * 3 + 3] < 20))) if b >= 2 else 1
            g[k] += grad[b] / np.float32(count) if b >= 2 else grad[b]
    touched = np.unique(keys[keys < 20])
    want[touched] = want[touched] - np.float32(0.5) * g[touched]
    pooled = np.zeros((nb, 4), np.float32)
    host_kernel.pool_numpy(table, keys, desc, pooled)
    np.testing.assert_array_equal(pooled[2], 0)  # the empty mean bag
    np.testing.assert_array_equal(pooled[0], table[keys[0]] + table[keys[1]])
    stats = np.zeros(2, np.int32)
    host_kernel.update_numpy(table, np.zeros(1, np.float32), keys, desc, grad, np.float32([0.5, 0]),
                             np.int32([host_kernel.KIND_SGD, 4]), stats)
    assert list(stats) == [len(touched), int(len(touched) > 4)]
    np.testing.assert_array_equal(table, want)
