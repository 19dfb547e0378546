"""NestPipe pipelines == sync: dbp bit-identical, fwp / clustering within f32 reorder tolerance,
semi_sync (one step stale) far outside it."""

import dataclasses

import jax
import numpy as np
import pytest

from configs.nestpipe import Config
from jaxflow.nestpipe import (clone_tables, cluster_samples, intersection_slots, micro_batch_transfers,
                              patch_intersection_rows, retrieve_rows, route_keys, run_pipeline)
from jaxflow.nestpipe.experiment import build, max_relative_diff, one_step_diffs, snapshot, train

# tiny tables and a Zipf sampler: consecutive batches share most keys (a missing patch shows)
SMALL = Config(vocab_sizes=(60, 40, 25, 9), multi_hot=3, embed_dim=8, bottom=(16,), top=(16,),
               batch_size=32, micro_batches=4, steps=10, sparse_lr=0.1, dense_lr=1e-2)
STEPS = 10
TOL_PER_STEP = 1e-6  # f32 relative, reordered batch sums


@pytest.fixture(scope="module")
def setup():
    return build(SMALL)


@pytest.fixture(scope="module")
def finals(setup):
    _, _, tables0, dense0, _, parts_for = setup
    out, stats = {}, {}
    for p in ("sync", "dbp", "semi_sync", "fwp", "dbp+fwp"):
        dense, tables, stats[p] = train(SMALL, p, tables0, dense0, parts_for, STEPS)
        out[p] = snapshot(dense, tables)
    return out, stats


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dbp_is_bit_identical_to_sync(finals):
    out, stats = finals
    assert_trees_equal(out["dbp"], out["sync"])
    assert stats["dbp"]["losses"] == stats["sync"]["losses"]
    assert stats["dbp"]["patched_rows"] > 10  # the overlap is real, so the patch mattered


def test_semi_sync_differs_far_beyond_tolerance(finals):
    out, _ = finals
    assert max_relative_diff(out["semi_sync"], out["sync"]) > 1e3 * TOL_PER_STEP * STEPS


def test_fwp_matches_sync_within_reorder_tolerance(finals):
    out, _ = finals
    diff = max_relative_diff(out["fwp"], out["sync"])
    assert diff <= TOL_PER_STEP * STEPS, diff


def test_fwp_one_step_error_is_within_tolerance_at_every_step(setup):
    _, _, tables0, dense0, _, parts_for = setup
    diffs = one_step_diffs("fwp", tables0, dense0, parts_for, STEPS)
    assert max(diffs) <= TOL_PER_STEP, diffs


def test_dbp_fwp_is_bit_identical_to_fwp(finals):
    out, _ = finals
    assert_trees_equal(out["dbp+fwp"], out["fwp"])


def test_clustering_keeps_the_full_batch_update(setup):
    gen, specs, tables0, dense0, _, parts_for = setup
    one = dataclasses.replace(SMALL, cluster=False)
    _, _, _, _, _, parts_plain = build(one)
    d_c, t_c, _ = train(SMALL, "fwp", tables0, dense0, parts_for, 1)
    d_p, t_p, _ = train(one, "fwp", tables0, dense0, parts_plain, 1)
    assert max_relative_diff(snapshot(d_c, t_c), snapshot(d_p, t_p)) <= TOL_PER_STEP
    sp = gen.batch(0, 256)["sparse"]
    for method in ("vote", "greedy"):
        order = cluster_samples(sp, 8, method)
        assert sorted(order.tolist()) == list(range(256))
        assert micro_batch_transfers(sp, 8, order) < micro_batch_transfers(sp, 8), method


def test_patch_copies_exactly_the_shared_rows(setup):
    _, specs, tables0, _, _, _ = setup
    src, dst, n = intersection_slots(np.array([1, 4, 7, 9]), np.array([0, 4, 9, 12]), 6)
    assert n == 2 and src[:2].tolist() == [1, 3] and dst[:2].tolist() == [1, 2]
    assert (dst[2:] == 6).all()  # padding slots are dropped by the scatter
    tables = {specs[0].name: tables0[specs[0].name]}
    ids = {specs[0].name: np.array([[0], [4], [9], [12]], np.int32)}
    pre = retrieve_rows(tables, route_keys(specs[:1], ids), capacity=6)
    name = specs[0].name
    active_rows = {name: jax.numpy.full((6, 8), 7.0)}
    active_opt = {name: {"accum": jax.numpy.full((6,), 3.0)}}
    patched, copied = patch_intersection_rows(pre, {name: np.array([1, 4, 7, 9])},
                                              active_rows, active_opt)
    assert copied == 2
    rows = np.asarray(patched.rows[name])
    np.testing.assert_array_equal(rows[[1, 2]], 7.0)
    np.testing.assert_array_equal(rows[[0, 3]], np.asarray(pre.rows[name])[[0, 3]])
    np.testing.assert_array_equal(np.asarray(patched.opt[name]["accum"])[[1, 2]], 3.0)


def test_a_shard_with_no_ids_works(setup):
    _, specs, tables0, dense0, _, parts_for = setup
    ids = {s.name: (2 * np.arange(12).reshape(4, 3) % s.vocab_size // 2 * 2).astype(np.int32)
           for s in specs}
    routed = route_keys(specs, ids, num_shards=2)
    assert all(c[1] == 0 and c[0] > 0 for c in routed.owner_counts.values())
    hb = retrieve_rows(tables0, routed, capacity=12)
    assert all(hb.rows[s.name].shape == (12, 8) for s in specs)
    # and a whole pipeline whose keys are bucketed over more owners than there are keys
    parts = parts_for("dbp", clone_tables(tables0))
    parts.num_shards = 1000
    run_pipeline("dbp", parts, dense0, 2)
