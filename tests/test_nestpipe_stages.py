"""NestPipe's device stages one at a time (``jaxflow.nestpipe.device_stages``), on 8 devices:
route == the owners' distinct local rows, exchange == a gather of the host tables, forward ==
a dense reference, the accumulation of N micro-batch gradients == the gradient of the whole
batch, and the update == per-slot sums + row-wise Adagrad + Adam written out by hand, by both
owner-update backends (the fused host kernel == XLA within f32 rounding: XLA contracts SGD's
row update into an FMA and vectorises Adagrad's ``mean(g^2)``; the kernel's SGD == the float32
loop bit for bit)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings import TableSpec, make_sparse_optimizer
from jaxflow.embeddings.routing import SENTINEL, route_ids
from jaxflow.nestpipe.device_stages import (
    AXIS,
    accumulate_grads,
    apply_update,
    first,
    loss_and_grads,
    sample_loss_sum,
    window_grads,
)
from jaxflow.nestpipe.sharded import UPDATE_BACKENDS, MeshStages, OwnerBuffer, owner_update_backend
from jaxflow.train.state import TrainState
from pallas_kernels import dispatch

SPECS = [TableSpec("a", 40, 4, "row_wise", "sum"), TableSpec("b", 21, 4, "row_wise", "sum")]
B, BAG, F, LR = 64, 2, 3, 0.1
TOL = 1e-6  # f32 relative: reordered sums


def apply(params, dense, emb):
    """A small model mixing the features: logits f32[b] from dense [b, F] and emb [b, T, D]."""
    return dense @ params["w"] + jnp.tanh(jnp.einsum("btd,td->b", emb, params["u"]))


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]), (AXIS,))


def stages_for(mesh, micro_batches=1, frozen_exchange="per_micro_batch", update_backend="auto",
               optimizer="rowwise_adagrad"):
    return MeshStages(SPECS, mesh, make_sparse_optimizer(optimizer, LR), apply,
                      batch_size=B, multi_hot=BAG, micro_batches=micro_batches,
                      frozen_exchange=frozen_exchange, update_backend=update_backend)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = {s.name: rng.integers(-1, s.vocab_size, (B, BAG)).astype(np.int32) for s in SPECS}
    return ids, rng.standard_normal((B, F)).astype(np.float32), (rng.random(B) < 0.3).astype(np.float32)


def params(seed=1):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal(F), jnp.float32),
            "u": jnp.asarray(rng.standard_normal((len(SPECS), 4)), jnp.float32)}


def host_tables(seed=2):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal((s.vocab_size, s.dim)).astype(np.float32) for s in SPECS}


def group_array(st, tables):
    """The group's [P * shard_rows, D] array: row ``key`` holds the table row that key names."""
    out = np.zeros((st.num_shards * st.group.shard_rows, st.dim), np.float32)
    for name, t in tables.items():
        out[st.plan.global_rows(name)] = t
    return out


def test_route_gives_each_owner_the_distinct_rows_asked_of_it(mesh):
    st = stages_for(mesh)
    ids, _, _ = batch()
    routed = st.route(st.shard(ids))
    asked = [set() for _ in range(8)]
    for s in SPECS:
        keys = st.plan.global_rows(s.name)[ids[s.name][ids[s.name] >= 0]]
        for k in keys:
            asked[k // st.group.shard_rows].add(int(k % st.group.shard_rows))
    for q in range(8):
        n = int(routed.owner_counts[q])
        assert routed.owner_ids[q][:n].tolist() == sorted(asked[q]), q
        assert (routed.owner_ids[q][n:] == SENTINEL).all()
    assert int(routed.stats["overflow"]) == 0 and min(routed.owner_counts) > 0


def test_exchange_returns_the_rows_of_every_unique_key_and_forward_matches_a_reference(mesh):
    st = stages_for(mesh)
    ids, dense, label = batch()
    tables = host_tables()
    g = group_array(st, tables)
    routed = st.route(st.shard(ids))
    co, rows = st.owner_capacity, np.zeros((8 * st.owner_capacity, st.dim), np.float32)
    for q in range(8):
        n = int(routed.owner_counts[q])
        rows[q * co:q * co + n] = g[q * st.group.shard_rows + routed.owner_ids[q][:n]]
    buf = OwnerBuffer(st.shard(rows), {}, routed.owner_ids, routed.owner_counts)
    unique = np.asarray(st.exchange(buf, routed))  # [P, C, D]
    keys = np.asarray(routed.routing.unique_keys)  # [P, C]
    ok = keys != SENTINEL
    np.testing.assert_array_equal(unique[ok], g[keys[ok]])
    np.testing.assert_array_equal(unique[~ok], 0.0)
    # forward of device 3 on its own samples == the dense lookup of the host tables
    p, b = 3, B // 8
    mine = slice(p * b, (p + 1) * b)
    r = jax.tree.map(lambda x: np.asarray(x)[p], routed.routing)
    got = sample_loss_sum(st.layout, apply, params(), jnp.asarray(unique[p]), r,
                          {k: v[mine] for k, v in ids.items()}, dense[mine], label[mine])
    pooled = np.stack([np.where((ids[s.name][mine] >= 0)[..., None],
                                tables[s.name][np.maximum(ids[s.name][mine], 0)], 0).sum(1)
                       for s in SPECS], axis=1)
    logits = apply(params(), dense[mine], jnp.asarray(pooled))
    want = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, label[mine])) / B
    np.testing.assert_allclose(float(got), float(want), rtol=TOL)


def test_accumulated_micro_batch_gradients_equal_the_whole_batch_gradient(mesh):
    """N micro-batches against the same unique rows (the whole-window schedule), their
    gradients accumulated == one forward-backward of the concatenated batch."""
    window = stages_for(mesh, micro_batches=4, frozen_exchange="window").layout
    whole = dataclasses.replace(window, micro_batches=1)
    ids, dense, label = batch(5)
    b = B // 8  # one device's window: 8 samples, 4 micro-batches of 2
    mine = {k: jnp.asarray(v[:b]) for k, v in ids.items()}
    routing = route_ids(window.plan, window.group, mine, window.capacity, window.bucket_capacity)
    unique = jnp.asarray(np.random.default_rng(6).standard_normal((window.capacity, window.dim)),
                         jnp.float32)
    args = (params(), unique, routing, mine, jnp.asarray(dense[:b]), jnp.asarray(label[:b]))
    loss_n, gp_n, ge_n = window_grads(window, apply, *args)
    loss_1, (gp_1, ge_1) = loss_and_grads(whole, apply, *args)
    np.testing.assert_allclose(float(loss_n), float(loss_1), rtol=TOL)
    for got, want in zip(jax.tree.leaves((gp_n, ge_n)), jax.tree.leaves((gp_1, ge_1)), strict=True):
        scale = float(np.max(np.abs(want)))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=TOL * scale)
    # N = 1 is the plain forward-backward, bit for bit
    loss_w, gp_w, ge_w = window_grads(whole, apply, *args)
    assert float(loss_w) == float(loss_1)
    for x, y in zip(jax.tree.leaves((gp_w, ge_w)), jax.tree.leaves((gp_1, ge_1))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_accumulate_grads_sums_in_micro_batch_order():
    """((m0 + m1) + m2): 1 + 1e8 rounds to 1e8 in f32, so the left fold gives 0 where any other
    order (or the exact sum) gives 1."""
    trees = [(jnp.float32(x), {"g": jnp.full((2,), x, jnp.float32)}) for x in (1.0, 1e8, -1e8)]
    loss, g = accumulate_grads(trees)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(g["g"]), [0.0, 0.0])
    assert float(accumulate_grads(trees[:1])[0]) == 1.0


def update_inputs(st, seed=7):
    """(rows [P*Co, D], accum [P*Co], owner inverse int32[P, P*Cb] (-1 = none), received
    gradients [P*P, Cb, D], dense gradients {name: [P, ...]}, losses [P]) for ``st``."""
    co, d, cb = st.owner_capacity, st.dim, st.bucket_capacity
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((8 * co, d)).astype(np.float32)
    accum = rng.random(8 * co).astype(np.float32)
    inverse = rng.integers(-1, co, (8, 8 * cb)).astype(np.int32)
    recv = rng.standard_normal((64, cb, d)).astype(np.float32)  # [P x P, Cb, D]
    g_params = {k: rng.standard_normal((8,) + v.shape).astype(np.float32) for k, v in params().items()}
    return rows, accum, inverse, recv, g_params, rng.random(8).astype(np.float32)


def update_program(mesh, st, rows, opt, inverse, recv, g_params, losses):
    """(Adam, ``apply_update`` jitted over every device of ``st``'s mesh, its arguments from a
    fresh Adam state)."""
    tx = optax.adam(1e-2)
    replicated = NamedSharding(mesh, P())
    state = TrainState.create(tx, params(), jax.tree.map(lambda _: replicated, params()))

    def local(state, rows, opt, inverse, g_params, recv, loss):
        return apply_update(st.layout, st.optimizer, state, rows, opt, inverse[0],
                            first(g_params), recv, loss[0])

    sh = P(AXIS)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), sh, sh, sh, sh, sh, sh),
                               out_specs=(P(), sh, sh, P()), check_vma=False))
    return tx, fn, (state, *st.shard((rows, opt, inverse, g_params, recv, losses)))


def run_update(mesh, st, *inputs):
    """(Adam, ``apply_update``'s outputs on every device of ``st``'s mesh)."""
    tx, fn, args = update_program(mesh, st, *inputs)
    return tx, fn(*args)


@pytest.mark.parametrize("update_backend", ["xla", "host_kernel"])
def test_update_equals_a_reference_update(mesh, update_backend):
    """Row gradients summed per owner slot, row-wise Adagrad at step 1 on the owner buffer,
    Adam on the sum of the devices' dense gradients; the loss summed over devices."""
    st = stages_for(mesh, update_backend=update_backend)
    assert st.update_backend == update_backend and st.layout.update_kernel == (update_backend == "host_kernel")
    co, d = st.owner_capacity, st.dim
    rows, accum, inverse, recv, g_params, losses = update_inputs(st)
    tx, (new_state, new_rows, new_opt, loss) = run_update(mesh, st, rows, {"accum": accum}, inverse,
                                                          recv, g_params, losses)
    # sparse: per device, per slot sums of the received gradients, then row-wise Adagrad
    want_rows, want_acc = rows.copy(), accum.copy()
    for q in range(8):
        g = np.zeros((co, d), np.float64)
        ok = inverse[q] >= 0
        np.add.at(g, inverse[q][ok], recv[q * 8:(q + 1) * 8].reshape(-1, d)[ok])
        blk = slice(q * co, (q + 1) * co)
        want_acc[blk] = accum[blk] + np.mean(g ** 2, axis=1)
        want_rows[blk] = rows[blk] - LR * g / (np.sqrt(want_acc[blk])[:, None] + 1e-8)
    np.testing.assert_allclose(np.asarray(new_opt["accum"]), want_acc, rtol=TOL, atol=1e-7)
    np.testing.assert_allclose(np.asarray(new_rows), want_rows, rtol=TOL, atol=1e-6)
    # dense: Adam's first step on the AllReduced gradient
    for k, p0 in params().items():
        g = g_params[k].astype(np.float64).sum(0)
        m, v = 0.1 * g, 0.001 * g ** 2
        step = 1e-2 * (m / 0.1) / (np.sqrt(v / 0.001) + 1e-8)
        np.testing.assert_allclose(np.asarray(new_state.params[k]), np.asarray(p0) - step,
                                   rtol=TOL, atol=1e-7)
    assert int(new_state.step) == 1 and new_state.tx is tx
    np.testing.assert_allclose(float(loss), losses.astype(np.float64).sum(), rtol=TOL)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_host_kernel_update_equals_the_xla_update(mesh, optimizer):
    """The fused host kernel against XLA on the same inputs, within f32 rounding (XLA contracts
    SGD's ``row - lr * g`` into an FMA and vectorises Adagrad's ``mean(g^2)``); SGD against the
    float32 loop (per-slot sums in request order, then the row update) bit for bit; slots no
    request names keep their values exactly."""
    xla, kernel = (stages_for(mesh, update_backend=b, optimizer=optimizer) for b in ("xla", "host_kernel"))
    rows, accum, inverse, recv, g_params, losses = update_inputs(xla, seed=11)
    inverse[inverse == xla.owner_capacity - 1] = -1  # every owner's last slot: asked by nobody
    opt = {"accum": accum} if optimizer == "rowwise_adagrad" else {}
    _, want = run_update(mesh, xla, rows, opt, inverse, recv, g_params, losses)
    _, got = run_update(mesh, kernel, rows, opt, inverse, recv, g_params, losses)
    jax.tree.map(np.testing.assert_array_equal, got[0].params, want[0].params)  # dense: unchanged path
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=TOL, atol=1e-7)
    if optimizer == "rowwise_adagrad":
        np.testing.assert_allclose(np.asarray(got[2]["accum"]), np.asarray(want[2]["accum"]), rtol=TOL)
    co, d = xla.owner_capacity, xla.dim
    if optimizer == "sgd":  # the kernel is the float32 loop bit for bit (XLA fuses row - lr * g
        seq = rows.copy()   # into one FMA: 1 ulp away from it on some rows)
        for q in range(8):
            g = np.zeros((co, d), np.float32)
            for i, slot in enumerate(inverse[q]):
                if slot >= 0:
                    g[slot] += recv[q * 8:(q + 1) * 8].reshape(-1, d)[i]
            seq[q * co:(q + 1) * co] -= np.float32(LR) * g
        np.testing.assert_array_equal(np.asarray(got[1]), seq)
    idle = np.ones((8, co), bool)
    for q in range(8):
        idle[q, inverse[q][inverse[q] >= 0]] = False
    assert idle[:, -1].all()  # slots nobody asked for come back untouched
    np.testing.assert_array_equal(np.asarray(got[1])[idle.reshape(-1)], rows[idle.reshape(-1)])
    assert not np.array_equal(np.asarray(got[1]), rows)


def test_update_kernel_only_in_programs_built_for_cpu(mesh, monkeypatch):
    """``auto`` builds the kernel into CPU programs; the same stages traced for a TPU target
    (``dispatch.backend_platform``, as the lowering gate does) update in XLA."""
    st = stages_for(mesh)
    rows, accum, inverse, recv, g_params, losses = update_inputs(st)
    inputs = (rows, {"accum": accum}, inverse, recv, g_params, losses)
    _, fn, args = update_program(mesh, st, *inputs)
    assert "jaxflow_embedding_fused_update" in fn.lower(*args).as_text()
    monkeypatch.setattr(dispatch, "backend_platform", lambda: "tpu")
    _, fn, args = update_program(mesh, st, *inputs)
    text = fn.lower(*args).as_text()
    assert "jaxflow_embedding_fused_update" not in text and "scatter" in text


def test_update_backend_choice_and_errors(mesh):
    assert UPDATE_BACKENDS == ("auto", "xla", "host_kernel")
    adagrad, adam = make_sparse_optimizer("rowwise_adagrad", LR), make_sparse_optimizer("adam", LR)
    assert owner_update_backend(mesh, adagrad) == "host_kernel"  # a CPU mesh of 8 devices
    assert owner_update_backend(mesh, adam) == "xla"  # auto: the kernel applies SGD / Adagrad only
    assert owner_update_backend(mesh, adagrad, "xla") == "xla"
    with pytest.raises(ValueError, match=r"^update_backend='pallas'; valid: auto, xla, host_kernel$"):
        stages_for(mesh, update_backend="pallas")
    with pytest.raises(ValueError, match=r"^update_backend='host_kernel' unavailable: optimizer 'adam'.*"
                                         r"valid: 'xla' or 'auto'$"):
        owner_update_backend(mesh, adam, "host_kernel")


def test_nestpipe_config_validates_update_backend():
    from configs import nestpipe

    assert nestpipe.UPDATE_BACKENDS == UPDATE_BACKENDS
    assert nestpipe.get_config("quick").update_backend == "auto"
    with pytest.raises(ValueError, match=r"^update_backend='gpu'; valid: auto, xla, host_kernel$"):
        dataclasses.replace(nestpipe.get_config("quick"), update_backend="gpu")
