"""Host-resident tables == device-resident sharded tables (with and without a dense
``TrainState``); checkpoint resume is exact."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, make_sparse_optimizer, make_train_step
from jaxflow.embeddings.checkpoint import EmbeddingCheckpointer
from jaxflow.embeddings.host import HostTable, make_host_train_step, retrieve, write_back
from jaxflow.mesh import make_mesh
from jaxflow.train.state import TrainState

B = 16
SPECS = [
    TableSpec("a", 40, 8, "row_wise", "sum"),
    TableSpec("b", 25, 8, "table_wise", "mean", id_policy="hash_modulo"),
    TableSpec("c", 12, 4, "replicated", "none"),
]
BAG = {"a": 2, "b": 3, "c": 2}


def batch(t):
    rng = np.random.default_rng(t)
    ids = {s.name: rng.integers(0, s.vocab_size * (3 if s.name == "b" else 1),
                                size=(B, BAG[s.name])).astype(np.int32) for s in SPECS}
    ids["a"][::3, 1] = -1
    w = {s.name: rng.standard_normal((B,) + ((BAG[s.name],) if s.pooling == "none" else ())
                                     + (s.dim,)).astype(np.float32) for s in SPECS}
    return ids, w


def loss_fn(params, outputs, w):
    b = next(iter(outputs.values())).shape[0]  # mean over the (local) batch
    return sum(jnp.sum(outputs[k] * w[k]) for k in outputs) / b, {}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 8})


def put(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def host_tables(opt, values, storage="memory", tmp=None):
    return {s.name: HostTable(s, opt, values[s.name], storage=storage,
                              path=None if tmp is None else tmp / s.name) for s in SPECS}


def run_host(tables, opt, steps, start=0):
    step_fn = make_host_train_step(SPECS, opt, loss_fn)
    for t in range(start, steps):
        ids, w = batch(t)
        hb = retrieve(tables, ids, capacity=48)
        _, rows, state, _ = step_fn({}, hb.rows, hb.opt, hb.inverse, jnp.int32(t + 1), w)
        write_back(tables, hb, rows, state)


@pytest.mark.parametrize("storage", ["memory", "tensorstore"])
def test_host_resident_matches_device_resident(mesh, tmp_path, storage):
    opt = make_sparse_optimizer("rowwise_adagrad", 0.1)
    emb = ShardedEmbeddings(SPECS, mesh, opt, capacity=48)
    state = {"emb": emb.init(3), "dense": {}}
    values, _ = emb.to_dense(state["emb"])
    tables = host_tables(opt, values, storage, tmp_path if storage == "tensorstore" else None)
    step = make_train_step(emb, loss_fn)
    for t in range(2):
        ids, w = batch(t)
        state, _ = step(state, put(mesh, ids), put(mesh, w))
    run_host(tables, opt, 2)
    dev_t, dev_o = emb.to_dense(state["emb"])
    for name, table in tables.items():
        host_t, host_o = table.to_numpy()
        np.testing.assert_allclose(host_t, dev_t[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(host_o["accum"], dev_o[name]["accum"], rtol=1e-5, atol=1e-8)


def test_resume_is_exact(mesh, tmp_path):
    """3 steps straight == 1 step, checkpoint, fresh objects, restore, 2 steps (bit-identical)."""
    opt = make_sparse_optimizer("adam", 0.05)
    emb = ShardedEmbeddings(SPECS, mesh, opt, capacity=48)
    step = make_train_step(emb, loss_fn, donate=False)

    def fresh():
        state = {"emb": emb.init(4), "dense": {}}
        return state, host_tables(opt, emb.to_dense(state["emb"])[0])

    def train(state, tables, start, stop):
        for t in range(start, stop):
            ids, w = batch(t)
            state, _ = step(state, put(mesh, ids), put(mesh, w))
        run_host(tables, opt, stop, start)
        return state

    straight, straight_host = fresh()
    straight = train(straight, straight_host, 0, 3)

    state, tables = fresh()
    state = train(state, tables, 0, 1)
    ckpt = EmbeddingCheckpointer(tmp_path / "ckpt")
    ckpt.save(1, state, tables)
    ckpt.close()

    like, resumed_host = fresh()  # different objects, initial values
    ckpt = EmbeddingCheckpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 1
    resumed = ckpt.restore(1, like, resumed_host)
    ckpt.close()
    assert int(resumed["emb"]["step"]) == 1
    resumed = train(resumed, resumed_host, 1, 3)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in straight_host:
        (ta, oa), (tb, ob) = straight_host[name].to_numpy(), resumed_host[name].to_numpy()
        np.testing.assert_array_equal(ta, tb)
        assert set(oa) == {"m", "v"}
        for k in oa:
            np.testing.assert_array_equal(oa[k], ob[k])


def test_host_resident_step_trains_the_same_dense_state(mesh):
    """With a dense ``TrainState`` beside the tables, the host-resident step == the
    device-resident step: params, optimizer state and step (a mean of per-sample terms: the
    host step's global-batch mean == the device step's mean of the 8 per-device means)."""
    opt = make_sparse_optimizer("rowwise_adagrad", 0.1)
    emb = ShardedEmbeddings(SPECS, mesh, opt, capacity=48)
    params = {"s": np.float32(0.5), "t": np.ones(8, np.float32)}

    def dense_loss(p, outputs, w):  # a mean of per-sample terms, as loss_fn
        base, _ = loss_fn(p, outputs, w)
        return p["s"] * base + jnp.mean(jnp.tanh(outputs["a"] @ p["t"])), {}

    tx = optax.adam(1e-2)
    replicated = NamedSharding(mesh, P())
    state = {"emb": emb.init(3),
             "dense": TrainState.create(tx, params, jax.tree.map(lambda _: replicated, params))}
    tables = host_tables(opt, emb.to_dense(state["emb"])[0])
    step = make_train_step(emb, dense_loss)
    host_step = make_host_train_step(SPECS, opt, dense_loss)
    dense = TrainState.create(tx, params)
    for t in range(2):
        ids, w = batch(t)
        state, _ = step(state, put(mesh, ids), put(mesh, w))
        hb = retrieve(tables, ids, capacity=48)
        dense, rows, st, _ = host_step(dense, hb.rows, hb.opt, hb.inverse, jnp.int32(t + 1), w)
        write_back(tables, hb, rows, st)
    assert int(dense.step) == int(state["dense"].step) == 2
    for a, b in zip(jax.tree.leaves((dense.params, dense.opt_state)),
                    jax.tree.leaves((state["dense"].params, state["dense"].opt_state)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    dev_t, _ = emb.to_dense(state["emb"])
    for name, table in tables.items():
        np.testing.assert_allclose(table.to_numpy()[0], dev_t[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_signal_stop_in_run_steps_saves_the_embedding_checkpoint(mesh, tmp_path):
    """``run_steps`` with an ``EmbeddingCheckpointer``: a SIGTERM during step 2 stops the run
    after it with a checkpoint of step 2 in the embedding layout, which restores exactly."""
    import os
    import signal

    from jaxflow import signals
    from jaxflow.train.loop import run_steps

    opt = make_sparse_optimizer("rowwise_adagrad", 0.1)
    emb = ShardedEmbeddings(SPECS, mesh, opt, capacity=48)
    step = make_train_step(emb, loss_fn, donate=False)

    def advance(state, t):
        ids, w = batch(t)
        return step(state, put(mesh, ids), put(mesh, w))

    def step_fn(state, t):
        if t == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 2: the loop finishes it
        return advance(state, t)

    fresh = {"emb": emb.init(5), "dense": {}}
    ckpt = EmbeddingCheckpointer(tmp_path / "ckpt", save_every=100)
    restore_handlers = signals.install()
    try:
        with pytest.raises(signals.RunStopped) as stopped:
            run_steps(step_fn, fresh, steps=5, checkpointer=ckpt)
    finally:
        restore_handlers()
    assert stopped.value.step == 2
    two = advance(advance(fresh, 0)[0], 1)[0]
    ckpt = EmbeddingCheckpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 2
    restored = ckpt.restore(2, fresh)
    ckpt.close()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(two), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
