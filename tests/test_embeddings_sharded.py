"""Sharded lookup and sparse update == the single-device dense reference; a dense
``TrainState`` beside the tables follows Adam on the global loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, make_sparse_optimizer, make_train_step
from jaxflow.embeddings.reference import reference_lookup, reference_step
from jaxflow.mesh import make_mesh
from jaxflow.train.state import TrainState

B = 16  # global batch: 2 per device on 8 devices
SPECS = [
    TableSpec("rw_sum", 50, 8, "row_wise", "sum"),
    TableSpec("rw_mean", 37, 8, "row_wise", "mean"),
    TableSpec("tw_seq", 20, 8, "table_wise", "none", owner=5),
    TableSpec("tw_sum", 23, 4, "table_wise", "sum"),
    TableSpec("rep_sum", 30, 4, "replicated", "sum"),
    TableSpec("rep_seq", 11, 4, "replicated", "none"),
    TableSpec("hashed", 13, 8, "row_wise", "mean", id_policy="hash_modulo"),
    # every id < 7 = rows per shard: shards 1..7 receive no ids for this table
    TableSpec("shard0_only", 50, 8, "row_wise", "sum"),
]
BAG = {"rw_sum": 1, "rw_mean": 3, "tw_seq": 2, "tw_sum": 2, "rep_sum": 3, "rep_seq": 2,
       "hashed": 2, "shard0_only": 2}


def make_ids(seed):
    rng = np.random.default_rng(seed)
    ids = {}
    for s in SPECS:
        hi = 7 if s.name == "shard0_only" else 1000 if s.id_policy == "hash_modulo" else s.vocab_size
        x = rng.integers(0, hi, size=(B, BAG[s.name]))
        x[rng.random(x.shape) < 0.25] = -1  # padding, incl. some empty bags
        ids[s.name] = x.astype(np.int32)
    ids["rep_seq"][:, 0] = 3  # duplicates across devices
    return ids


def loss_weights(seed):
    rng = np.random.default_rng(100 + seed)
    return {s.name: rng.standard_normal((B,) + ((BAG[s.name],) if s.pooling == "none" else ())
                                        + (s.dim,)).astype(np.float32) for s in SPECS}


def weighted_sum(outputs, weights):
    return sum(jnp.sum(outputs[k] * weights[k]) for k in outputs)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 8})


def put(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def test_lookup_matches_reference(mesh):
    emb = ShardedEmbeddings(SPECS, mesh, make_sparse_optimizer("sgd", 0.1), capacity=32)
    state = emb.init(0)
    tables, _ = emb.to_dense(state)
    ids = make_ids(0)
    out = emb.lookup(state, put(mesh, ids))
    ref = reference_lookup(SPECS, tables, ids)
    for name in ref:
        np.testing.assert_allclose(np.asarray(out[name]), np.asarray(ref[name]), rtol=1e-6,
                                   atol=1e-7, err_msg=name)


@pytest.mark.parametrize("opt_name", ["sgd", "rowwise_adagrad", "adam"])
def test_sparse_update_matches_dense_reference(mesh, opt_name):
    opt = make_sparse_optimizer(opt_name, 0.05)
    emb = ShardedEmbeddings(SPECS, mesh, opt, capacity=32)
    state = {"emb": emb.init(1), "dense": {}}
    tables, opt_state = emb.to_dense(state["emb"])

    def loss_fn(params, outputs, batch):
        return weighted_sum(outputs, batch), {}

    step = make_train_step(emb, loss_fn)
    for t in range(2):
        ids, w = make_ids(t), loss_weights(t)
        state, metrics = step(state, put(mesh, ids), put(mesh, w))
        assert int(metrics["overflow"]) == 0 and int(metrics["bad_ids"]) == 0
        # global loss = mean of the 8 per-device losses
        tables, opt_state = reference_step(SPECS, opt, tables, opt_state, t + 1, ids,
                                           lambda o: weighted_sum(o, w) / 8)
    got_t, got_o = emb.to_dense(state["emb"])
    for name in tables:
        np.testing.assert_allclose(got_t[name], tables[name], rtol=1e-5, atol=1e-6, err_msg=name)
        for k in opt_state[name]:
            np.testing.assert_allclose(got_o[name][k], opt_state[name][k], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}/{k}")
    # an untouched row stays bit-identical to its initial value
    init_t, _ = emb.to_dense(emb.init(1))
    np.testing.assert_array_equal(got_t["shard0_only"][7:], init_t["shard0_only"][7:])


def test_train_step_with_forced_kernel_matches_xla_pooling(mesh):
    """The step ``bench_embedding`` / ``dlrm_train`` run, with the Pallas bag kernel forced
    (interpret mode here), == the XLA pooling step: embedding dims 64 (narrower than 128 lanes,
    the case Mosaic refused) and 100 (not a multiple of 8), sum and mean bags."""
    specs = [TableSpec("d64", 40, 64, "row_wise", "sum"),
             TableSpec("d100", 24, 100, "row_wise", "mean")]
    rng = np.random.default_rng(3)
    ids = {s.name: rng.integers(-1, s.vocab_size, size=(B, 3)).astype(np.int32) for s in specs}
    w = {s.name: rng.standard_normal((B, s.dim)).astype(np.float32) for s in specs}

    def loss_fn(params, outputs, batch):
        return sum(jnp.sum(jnp.square(outputs[k] - batch[k])) for k in outputs), {}

    got = {}
    for backend in ("xla", "pallas_forced"):
        emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer("rowwise_adagrad", 0.1),
                                capacity=8, pooling_backend=backend)
        state, metrics = make_train_step(emb, loss_fn)({"emb": emb.init(0), "dense": {}},
                                                       put(mesh, ids), put(mesh, w))
        assert int(metrics["overflow"]) == 0
        got[backend] = (float(metrics["loss"]), emb.to_dense(state["emb"])[0])
    np.testing.assert_allclose(got["pallas_forced"][0], got["xla"][0], rtol=1e-6)
    fresh = ShardedEmbeddings(specs, mesh, make_sparse_optimizer("sgd", 0.1))
    init, _ = fresh.to_dense(fresh.init(0))
    for s in specs:
        np.testing.assert_allclose(got["pallas_forced"][1][s.name], got["xla"][1][s.name],
                                   rtol=1e-6, atol=1e-7, err_msg=s.name)
        assert np.abs(got["xla"][1][s.name] - init[s.name]).max() > 1e-4  # rows were updated


def test_dense_train_state_follows_adam_on_the_global_loss(mesh):
    """The dense part as a ``TrainState``: over 2 steps its params follow Adam (written out)
    on the gradient of the global loss (the mean of the 8 per-device losses, dense grads
    psum'd), its step counts, and the tables still follow the sparse reference."""
    specs = [SPECS[0], SPECS[4]]  # row-wise sum (D 8), replicated sum (D 4)
    opt = make_sparse_optimizer("rowwise_adagrad", 0.05)
    emb = ShardedEmbeddings(specs, mesh, opt, capacity=32)
    rng = np.random.default_rng(9)
    params = {"w": rng.standard_normal(12).astype(np.float32), "b": np.float32(0.1)}

    def loss_fn(p, outputs, batch):
        x = jnp.concatenate([outputs["rw_sum"], outputs["rep_sum"]], -1)
        return jnp.mean(jnp.square(x @ p["w"] + p["b"] - batch["y"])), {}

    tx = optax.adam(1e-2)
    replicated = NamedSharding(mesh, P())
    state = {"emb": emb.init(2),
             "dense": TrainState.create(tx, params, jax.tree.map(lambda _: replicated, params))}
    tables, opt_state = emb.to_dense(state["emb"])
    step = make_train_step(emb, loss_fn)
    ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v2 = {k: np.zeros_like(v) for k, v in ref.items()}
    for t in range(2):
        ids = {k: make_ids(t)[k] for k in ("rw_sum", "rep_sum")}
        y = rng.standard_normal(B).astype(np.float32)
        state, _ = step(state, put(mesh, ids), put(mesh, {"y": y}))

        def global_loss(p, outputs):
            return sum(loss_fn(p, {k: o[2 * i:2 * i + 2] for k, o in outputs.items()},
                               {"y": y[2 * i:2 * i + 2]})[0] for i in range(8)) / 8

        p32 = {k: jnp.asarray(v, jnp.float32) for k, v in ref.items()}
        g = jax.grad(global_loss)(p32, reference_lookup(specs, tables, ids))
        tables, opt_state = reference_step(specs, opt, tables, opt_state, t + 1, ids,
                                           lambda o, p32=p32, gl=global_loss: gl(p32, o))
        for k in ref:  # Adam, step t + 1
            gk = np.asarray(g[k], np.float64)
            m[k] = 0.9 * m[k] + 0.1 * gk
            v2[k] = 0.999 * v2[k] + 0.001 * gk ** 2
            mhat, vhat = m[k] / (1 - 0.9 ** (t + 1)), v2[k] / (1 - 0.999 ** (t + 1))
            ref[k] = ref[k] - 1e-2 * mhat / (np.sqrt(vhat) + 1e-8)
    dense = state["dense"]
    assert isinstance(dense, TrainState) and int(dense.step) == 2
    for k in ref:
        np.testing.assert_allclose(np.asarray(dense.params[k]), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert np.abs(ref[k] - np.asarray(params[k])).max() > 1e-3  # the params really moved
    got_t, _ = emb.to_dense(state["emb"])
    for name in tables:
        np.testing.assert_allclose(got_t[name], tables[name], rtol=1e-5, atol=1e-6, err_msg=name)
