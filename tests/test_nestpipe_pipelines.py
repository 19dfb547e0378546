"""NestPipe pipelines on 8 devices with a real All2All == sync: dbp bit-identical; fwp (the
paper's per-micro-batch frozen window, on the CPU too), sync_accum (the whole-window schedule)
and clustering within f32 reorder tolerance, after one step, 10 steps and 50 steps; semi_sync
(one step stale) far outside it; the mesh path == one device; a shard that receives no ids works;
fwp's row All2All of micro-batch i+1 does not depend on micro-batch i's dense compute."""

import dataclasses

import jax
import numpy as np
import pytest

from configs.nestpipe import Config
from jaxflow.nestpipe import (
    NestPipeSystem,
    clone_tables,
    cluster_order,
    cluster_samples,
    intersection_slots,
    micro_batch_transfers,
    patch_intersection_rows,
    run_pipeline,
    shard_micro_batch_transfers,
)
from jaxflow.nestpipe.exactness import max_relative_diff, one_step_diffs, snapshot
from jaxflow.nestpipe.host_io import HostShards
from jaxflow.nestpipe.model import resolve_meshes
from jaxflow.nestpipe.pipelines import PIPELINES
from jaxflow.nestpipe.system import NestPipeState, UnknownPipelineError
from jaxflow.system import check_system, is_system_state

# tiny tables and a Zipf sampler: consecutive batches share most keys (a missing patch shows)
SMALL = Config(vocab_sizes=(60, 40, 25, 9), multi_hot=3, embed_dim=8, bottom=(16,), top=(16,),
               batch_size=64, micro_batches=4, steps=10, sparse_lr=0.1, dense_lr=1e-2, devices=8)
STEPS = 10
TOL_PER_STEP = 1e-6  # f32 relative, reordered batch sums
# K steps of reordered sums: at most K per-step errors if training does not amplify them
# (it does not on SMALL: fwp drifts 3.9e-7 in 50 steps, semi_sync 1.9; dev CPU, jax 0.10.2)
DRIFT_STEPS = 50
DRIFT_TOL = TOL_PER_STEP * DRIFT_STEPS


def test_the_session_has_8_devices():
    assert jax.device_count() >= 8, "tests/conftest.py must give 8 fake CPU devices"


def init(config):
    """The initial NestPipe state of ``config`` on its mesh."""
    return NestPipeSystem().init(config, resolve_meshes(config))


@pytest.fixture(scope="module")
def setup():
    return init(SMALL)


@pytest.fixture(scope="module")
def finals(setup):
    out, stats = {}, {}
    for p in ("sync", "dbp", "semi_sync", "fwp", "dbp+fwp", "sparse_dist", "sync_accum"):
        state, stats[p] = NestPipeSystem(p).train(setup, STEPS)
        out[p] = snapshot(state)
    return out, stats


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nestpipe_system_satisfies_the_protocol(setup):
    assert check_system(NestPipeSystem("dbp"), "nestpipe") == []
    assert is_system_state(setup) and isinstance(setup, NestPipeState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.dense = None
    # the tables and the dense state are the pytree's data; the runtime is static
    leaves = jax.tree.leaves(setup)
    assert any(x is setup.tables["c0"] for x in leaves)
    assert not any(x is setup.runtime for x in leaves)
    metrics = NestPipeSystem().evaluate(setup)
    assert set(metrics) == {"auc", "logloss"} and all(np.isfinite(v) for v in metrics.values())
    assert [p.name for p in NestPipeSystem().programs(SMALL, resolve_meshes(SMALL))] == [
        f"N{n}-{x}/{stage}" for n, x, stages in (
            (1, "per_micro_batch", ("route", "exchange", "compute", "patch")),
            (4, "per_micro_batch", ("route", "frozen", "patch")),
            (4, "window", ("route", "exchange", "compute"))) for stage in stages]
    with pytest.raises(UnknownPipelineError, match=r"^pipeline='async'; valid: sync, dbp, "):
        NestPipeSystem("async")
    fwp_only = init(dataclasses.replace(SMALL, pipelines=("fwp",)))
    with pytest.raises(UnknownPipelineError, match=r"pipeline='sync_accum': this state was built "
                       r"for .* valid: sync, dbp, semi_sync, sparse_dist, fwp, dbp\+fwp$"):
        NestPipeSystem("sync_accum").train(fwp_only, 1)


@pytest.mark.parametrize("pipeline", ["dbp", "dbp+fwp"])
def test_system_step_is_pure_and_equals_one_step_of_the_pipeline(setup, pipeline):
    before = snapshot(setup)
    state, metrics = NestPipeSystem(pipeline).step(setup, None, key=jax.random.key(1))
    assert_trees_equal(snapshot(setup), before)  # the input state is untouched
    assert int(state.dense.step) == 1 and int(setup.dense.step) == 0
    # the pipeline run directly on a copy of the tables, from the same dense state
    tables = clone_tables(setup.tables)
    dense, stats = run_pipeline(PIPELINES[pipeline][0], setup.runtime.parts(pipeline, tables),
                                setup.dense, 1)
    assert metrics == {"loss": stats["losses"][0]}
    assert_trees_equal(snapshot(state), snapshot(dataclasses.replace(setup, dense=dense,
                                                                     tables=tables)))
    # the next step reads batch 1 (the state's step count): two steps == a 2-step run
    two, _ = NestPipeSystem(pipeline).step(state, None, key=jax.random.key(2))
    assert_trees_equal(snapshot(two), snapshot(NestPipeSystem(pipeline).train(setup, 2)[0]))


def test_runs_on_an_8_device_mesh_with_every_owner_busy(setup, finals):
    assert setup.runtime.stages_for("sync").num_shards == 8
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(setup.dense))
    _, stats = finals
    assert len(stats["sync"]["owner_rows"]) == 8
    assert min(stats["sync"]["owner_rows"]) > 0  # keys really cross devices


def test_dbp_is_bit_identical_to_sync(finals):
    out, stats = finals
    assert_trees_equal(out["dbp"], out["sync"])
    assert stats["dbp"]["losses"] == stats["sync"]["losses"]
    assert stats["dbp"]["patched_rows"] > 10  # the overlap is real, so the patch mattered


def test_semi_sync_differs_far_beyond_tolerance(finals):
    out, _ = finals
    assert max_relative_diff(out["semi_sync"], out["sync"]) > 1e3 * TOL_PER_STEP * STEPS


def test_fwp_is_the_papers_schedule_on_the_cpu_too(setup):
    """fwp / dbp+fwp: per-micro-batch routing, clustering and All2All (the overlappable
    schedule) on this CPU as on GPU/TPU; the whole window routed once is sync_accum only."""
    parts_for = setup.runtime.parts
    for p in ("fwp", "dbp+fwp"):
        parts = parts_for(p, None)
        assert parts.stages.frozen_exchange == "per_micro_batch", p
        assert parts.stages.route_units == SMALL.micro_batches and parts.cluster, p
        assert not parts.stages.separate_exchange, p  # rows exchanged inside the window
    accum = parts_for("sync_accum", None)
    assert accum.stages.frozen_exchange == "window" and accum.stages.route_units == 1
    assert accum.stages.n == SMALL.micro_batches and not accum.cluster
    with pytest.raises(ValueError, match="sync_accum"):
        dataclasses.replace(SMALL, frozen_exchange="window")


def test_fwp_matches_sync_within_reorder_tolerance(finals):
    out, _ = finals
    for p in ("fwp", "sync_accum"):
        diff = max_relative_diff(out[p], out["sync"])
        assert diff <= TOL_PER_STEP * STEPS, (p, diff)


def test_fwp_50_step_drift_is_within_tolerance_and_a_stale_run_is_far_outside(setup):
    """The paper's schedule over 50 steps from the same start as sync: its reordered sums
    stay within DRIFT_TOL of sync's trajectory; a one-step-stale run (semi_sync) of the same
    50 steps differs by more than 1000x that tolerance."""
    out = {p: snapshot(NestPipeSystem(p).train(setup, DRIFT_STEPS)[0])
           for p in ("sync", "fwp", "semi_sync")}
    drift = max_relative_diff(out["fwp"], out["sync"])
    stale = max_relative_diff(out["semi_sync"], out["sync"])
    assert 0.0 < drift <= DRIFT_TOL, drift  # > 0: the sums really were reordered
    assert stale > 1e3 * DRIFT_TOL, stale


def test_fwp_one_step_error_is_within_tolerance_at_every_step(setup):
    for p in ("fwp", "sync_accum"):
        diffs = one_step_diffs(p, setup, 6)
        assert max(diffs) <= TOL_PER_STEP, (p, diffs)


def test_torchrec_sparse_dist_baseline_is_bit_identical_to_sync(finals):
    """TrainPipelineSparseDist-style: batch t+1's input routed during t, rows read after t's
    write back, so no staleness."""
    out, stats = finals
    assert_trees_equal(out["sparse_dist"], out["sync"])
    assert stats["sparse_dist"]["losses"] == stats["sync"]["losses"]
    assert stats["sparse_dist"]["patched_rows"] == 0


def test_dbp_fwp_is_bit_identical_to_fwp(finals):
    out, stats = finals
    assert_trees_equal(out["dbp+fwp"], out["fwp"])
    assert stats["dbp+fwp"]["patched_rows"] > 10


def test_mesh_all2all_matches_one_device(setup):
    """8 devices (keys routed to owners, rows back by All2All, dense grads AllReduced) vs a
    1-device mesh (no exchange): the same step up to the order of the batch sum."""
    one = init(dataclasses.replace(SMALL, devices=1))
    sync, diffs, s8, s1 = NestPipeSystem("sync"), [], setup, one
    for _ in range(3):
        s8, _ = sync.train(s8, 1)
        s1, _ = sync.train(s1, 1)
        diffs.append(max_relative_diff(snapshot(s8), snapshot(s1)))
        dense1 = jax.device_put(jax.device_get(s8.dense), jax.tree.map(lambda x: x.sharding, one.dense))
        s1 = dataclasses.replace(one, dense=dense1, tables=clone_tables(s8.tables))
    assert 0.0 < max(diffs) <= TOL_PER_STEP, diffs  # > 0: the sums really were split


def test_clustering_keeps_the_full_batch_update(setup):
    gen, fwp = setup.runtime.gen, NestPipeSystem("fwp")
    plain = dataclasses.replace(setup, runtime=init(dataclasses.replace(SMALL, cluster=False)).runtime)
    clustered, unclustered = fwp.train(setup, 1)[0], fwp.train(plain, 1)[0]
    assert max_relative_diff(snapshot(clustered), snapshot(unclustered)) <= TOL_PER_STEP
    sp = gen.batch(0, 256)["sparse"]
    for method in ("vote", "greedy"):
        order = cluster_samples(sp, 8, method)
        assert sorted(order.tolist()) == list(range(256))
        assert micro_batch_transfers(sp, 8, order) < micro_batch_transfers(sp, 8), method
    # on the mesh samples are clustered inside each device's shard only, all shards in one
    # vectorised pass that gives each shard exactly its own cluster_samples permutation
    for method in ("vote", "greedy"):
        order = cluster_order(sp, 8, 4, method)
        assert sorted(order.tolist()) == list(range(256))
        assert all(set(order[p * 32:(p + 1) * 32] // 32) == {p} for p in range(8))
        per_shard = np.concatenate([p * 32 + cluster_samples(
            {k: v[p * 32:(p + 1) * 32] for k, v in sp.items()}, 4, method) for p in range(8)])
        np.testing.assert_array_equal(order, per_shard)
        # rows moved as the mesh moves them: per device, per micro-batch dedup
        moved = shard_micro_batch_transfers(sp, 8, 4, order)
        assert moved == sum(micro_batch_transfers({k: v[order][p * 32:(p + 1) * 32]
                                                   for k, v in sp.items()}, 4)
                            for p in range(8))
        assert moved < shard_micro_batch_transfers(sp, 8, 4), method
    padded = {k: np.where(np.arange(v.size).reshape(v.shape) % 5 == 0, -1, v)
              for k, v in sp.items()}
    np.testing.assert_array_equal(cluster_order(padded, 8, 4), np.concatenate(
        [p * 32 + cluster_samples({k: v[p * 32:(p + 1) * 32] for k, v in padded.items()}, 4)
         for p in range(8)]))


def test_patch_copies_exactly_the_shared_rows(setup):
    src, dst, n = intersection_slots(np.array([1, 4, 7, 9]), np.array([0, 4, 9, 12]), 6)
    assert n == 2 and src[:2].tolist() == [1, 3] and dst[:2].tolist() == [1, 2]
    assert (dst[2:] == 6).all()  # padding slots are dropped by the scatter
    # on the mesh: prefetch batch 1 from the untouched tables, patch from a fake updated batch 0
    from jaxflow.nestpipe.pipelines import prefetch
    parts = setup.runtime.parts("sync", clone_tables(setup.tables))
    st, shards = parts.stages, HostShards(parts.stages, parts.tables)
    try:
        a, b = prefetch(parts, shards, 0, {}), prefetch(parts, shards, 1, {})
    finally:
        shards.close()
    rows = a.buf.rows + 1000.0  # marks every Active slot
    opt = {k: v + 1000.0 for k, v in a.buf.opt.items()}
    patched, copied = patch_intersection_rows(st, b.buf, a.buf, rows, opt)
    new, old, co = np.asarray(patched.rows), np.asarray(b.buf.rows), st.owner_capacity
    expect = 0
    for p in range(8):
        ia = a.buf.owner_ids[p][:a.buf.owner_counts[p]]
        ib = b.buf.owner_ids[p][:b.buf.owner_counts[p]]
        shared = np.isin(ib, ia)
        expect += int(shared.sum())
        blk_new, blk_old = new[p * co:(p + 1) * co], old[p * co:(p + 1) * co]
        np.testing.assert_array_equal(blk_new[:ib.size][shared], blk_old[:ib.size][shared] + 1000.0)
        np.testing.assert_array_equal(blk_new[:ib.size][~shared], blk_old[:ib.size][~shared])
    assert copied == expect > 0


def test_capacity_overflow_raises_never_drops(setup):
    from jaxflow.embeddings import CapacityOverflowError
    for field in ("owner_capacity", "bucket_capacity"):
        small = init(dataclasses.replace(SMALL, **{field: 2})).runtime
        with pytest.raises(CapacityOverflowError, match="capacity"):
            NestPipeSystem("sync").train(dataclasses.replace(setup, runtime=small), 1)


class OneOwnerData:
    """Every id of every table falls in shard 0's row block: shards 1..7 receive no ids."""

    def __init__(self, gen, rows_per_shard):
        self.gen, self.r = gen, rows_per_shard

    def batch(self, step, batch_size):
        b = self.gen.batch(step, batch_size)
        b["sparse"] = {k: np.where(v >= 0, v % self.r[k], -1).astype(np.int32)
                       for k, v in b["sparse"].items()}
        return b


def test_a_shard_with_no_ids_works(setup):
    gen, specs, tables0 = setup.runtime.gen, setup.runtime.specs, setup.tables
    st = setup.runtime.stages_for("sync")
    r = {s.name: st.plan.table(s.name).rows_per_shard for s in specs}
    out, stats = {}, {}
    for p in ("sync", "dbp", "fwp", "sync_accum"):
        parts = setup.runtime.parts(p, clone_tables(tables0))
        parts.gen = OneOwnerData(gen, r)
        dense, stats[p] = run_pipeline(PIPELINES[p][0], parts, setup.dense, 3)
        out[p] = snapshot(dataclasses.replace(setup, dense=dense, tables=parts.tables))
        assert stats[p]["owner_rows"][0] > 0 and stats[p]["owner_rows"][1:] == [0.0] * 7, p
        assert np.isfinite(stats[p]["losses"]).all()
    assert_trees_equal(out["dbp"], out["sync"])
    for p in ("fwp", "sync_accum"):
        assert max_relative_diff(out[p], out["sync"]) <= TOL_PER_STEP * 3, p
    for s in specs:  # rows outside shard 0's block never change; some inside do
        before, after = tables0[s.name].to_numpy()[0], out["sync"]["tables"][s.name][0]
        np.testing.assert_array_equal(after[r[s.name]:], before[r[s.name]:])
    assert any((out["sync"]["tables"][s.name][0] != tables0[s.name].to_numpy()[0]).any()
               for s in specs)


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            j = getattr(x, "jaxpr", x)
            if hasattr(j, "eqns"):
                yield j


def _contains(jaxpr, name):
    return any(e.primitive.name == name or any(_contains(j, name) for j in _subjaxprs(e))
               for e in jaxpr.eqns)


def _body_with(jaxpr, name):
    """The (sub-)jaxpr whose own equations include ``name``."""
    if any(e.primitive.name == name for e in jaxpr.eqns):
        return jaxpr
    for e in jaxpr.eqns:
        for j in _subjaxprs(e):
            found = _body_with(j, name)
            if found is not None:
                return found
    return None


def _all_to_alls_and_taint(jaxpr):
    """In program order, each all_to_all of the shard_map body and whether it depends
    (transitively) on a dot_general — i.e. on dense compute."""
    body = _body_with(jaxpr, "all_to_all")
    tainted, out = set(), []
    for eqn in body.eqns:
        dep = any(not hasattr(x, "val") and x in tainted for x in eqn.invars)
        if eqn.primitive.name == "all_to_all":
            out.append(dep)
        if dep or eqn.primitive.name == "dot_general" or any(
                _contains(j, "dot_general") for j in _subjaxprs(eqn)):
            tainted.update(eqn.outvars)
    return out


def test_frozen_window_row_exchange_is_independent_of_compute(setup, finals):
    """Micro-batch i+1's row All2All must not wait for i's dense compute (so XLA's async
    collectives can overlap them); the gradient All2Alls come after compute."""
    dense0 = setup.dense
    from jaxflow.nestpipe.pipelines import prefetch
    # fwp's schedule, the paper's (the same on the CPU)
    parts = setup.runtime.parts("fwp", clone_tables(setup.tables))
    overlap = parts.stages
    st = init(dataclasses.replace(SMALL, frozen_exchange="batched")).runtime.stages_for("fwp")
    assert overlap.frozen_exchange == "per_micro_batch" and st.frozen_exchange == "batched"
    shards = HostShards(overlap, parts.tables)
    try:
        pf = prefetch(parts, shards, 0, {})
    finally:
        shards.close()
    args = (dense0, pf.buf.rows, pf.buf.opt, pf.routed.owner_inverse, pf.routed.routing,
            pf.dev.ids, pf.dev.dense, pf.dev.label)
    flags = _all_to_alls_and_taint(jax.make_jaxpr(overlap._frozen)(*args).jaxpr)
    n = SMALL.micro_batches
    assert len(flags) == 2 * n, flags
    assert flags.count(False) == n and flags.count(True) == n, flags  # n row, n grad exchanges
    assert flags[:2] == [False, False]  # rows of micro-batch 1 issued before 0's grads exist
    # batched: one row All2All before any compute, one gradient All2All after it; the
    # same values moved in fewer collectives, so the step is bit-identical
    assert _all_to_alls_and_taint(jax.make_jaxpr(st._frozen)(*args).jaxpr) == [False, True]
    assert_trees_equal(overlap._frozen(*args), st._frozen(*args))


def test_sync_accum_is_the_whole_window_schedule(setup):
    """sync_accum routes the window as a whole: one routing, the row exchange as its own
    program (the collectives of sync), one gradient All2All after the N micro-batches' compute;
    one step of it equals fwp's (the per-micro-batch window) up to f32 summation order (same
    rows, same math)."""
    tables0, dense0, parts_for = setup.tables, setup.dense, setup.runtime.parts
    from jaxflow.nestpipe.pipelines import prefetch
    st = parts_for("sync_accum", None).stages
    assert st.frozen_exchange == "window" and st.separate_exchange and st.route_units == 1
    assert not parts_for("sync_accum", None).cluster  # cannot change a whole-window dedup
    results = []
    for pipeline in ("sync_accum", "fwp"):
        parts = parts_for(pipeline, clone_tables(tables0))
        shards = HostShards(parts.stages, parts.tables)
        try:
            pf = prefetch(parts, shards, 0, {})
        finally:
            shards.close()
        stages = parts.stages
        if stages.separate_exchange:
            emb = stages.exchange(pf.buf, pf.routed)
            jaxpr = jax.make_jaxpr(stages._compute)(dense0, pf.buf.rows, pf.buf.opt,
                                                    pf.routed.owner_inverse, pf.routed.routing,
                                                    emb, pf.dev.ids, pf.dev.dense, pf.dev.label)
            assert _all_to_alls_and_taint(jaxpr.jaxpr) == [True]  # the gradients only
        else:
            emb = None
        dense, rows, opt, loss = stages.compute(dense0, pf.buf, pf.routed, emb, pf.dev.ids,
                                                pf.dev.dense, pf.dev.label)
        # the owner buffers hold the same rows in the same order only up to their padding:
        # compare per row id
        from jaxflow.embeddings.routing import SENTINEL
        owner_ids = np.asarray(pf.buf.owner_ids)  # [P, Co] local rows per owner shard
        flat_rows = np.asarray(rows).reshape(owner_ids.size, -1)
        per_row = {(p, int(i)): flat_rows[p * owner_ids.shape[1] + j]
                   for p in range(owner_ids.shape[0]) for j, i in enumerate(owner_ids[p])
                   if i != SENTINEL}
        results.append((dense.params, per_row, float(loss)))
    (pw, rw, lw), (pm, rm, lm) = results
    assert abs(lw - lm) <= TOL_PER_STEP * abs(lm)
    assert max_relative_diff(pw, pm) <= TOL_PER_STEP
    assert sorted(rw) == sorted(rm)
    assert max_relative_diff([rw[k] for k in sorted(rw)], [rm[k] for k in sorted(rm)]) <= TOL_PER_STEP


