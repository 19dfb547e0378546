"""Id policy, fixed-capacity dedup (overflow is an error), routing, placement plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings import (
    CapacityOverflowError,
    ShardedEmbeddings,
    TableSpec,
    apply_id_policy,
    check_ids_host,
    dedup,
    make_sparse_optimizer,
    plan_tables,
)
from jaxflow.embeddings.host import HostTable, retrieve
from jaxflow.embeddings.routing import SENTINEL, bucket_by_owner
from jaxflow.mesh import make_mesh


def test_dedup_unique_inverse_and_count():
    keys = jnp.array([7, 3, SENTINEL, 7, 9, 3, SENTINEL], jnp.int32)
    uniq, inv, n = dedup(keys, capacity=4)
    assert int(n) == 3
    np.testing.assert_array_equal(uniq, [3, 7, 9, SENTINEL])
    np.testing.assert_array_equal(inv, [1, 0, -1, 1, 2, 0, -1])
    _, _, n = dedup(keys, capacity=2)
    assert int(n) == 3  # > capacity: the caller must raise


def test_bucket_by_owner_positions():
    # shard_rows 10, 3 shards: keys 2, 5 -> shard 0; 21 -> shard 2; shard 1 gets nothing
    uniq = jnp.array([2, 5, 21, SENTINEL], jnp.int32)
    send, slot, dropped = bucket_by_owner(uniq, 10, 3, 2)
    np.testing.assert_array_equal(send, [[2, 5], [-1, -1], [1, -1]])
    np.testing.assert_array_equal(slot, [0, 1, 4, -1])
    assert int(dropped) == 0
    _, _, dropped = bucket_by_owner(uniq, 10, 3, 1)
    assert int(dropped) == 1


def test_id_policy():
    ids = jnp.array([[0, 4, 5, -1], [12, -3, 3, -1]], jnp.int32)
    out, bad = apply_id_policy(ids, 5, "error")
    np.testing.assert_array_equal(out, [[0, 4, -1, -1], [-1, -1, 3, -1]])
    assert int(bad) == 3  # 5, 12, -3
    out, bad = apply_id_policy(ids, 5, "hash_modulo")
    np.testing.assert_array_equal(out, [[0, 4, 0, -1], [2, -1, 3, -1]])
    assert int(bad) == 1  # -3 is bad under any policy
    with pytest.raises(ValueError, match=r"id 5 outside \[0, 5\)"):
        check_ids_host("t", np.array([[0, 5]]), 5, "error")
    check_ids_host("t", np.array([[0, 5]]), 5, "hash_modulo")


def test_plan_layout_and_errors():
    specs = [TableSpec("r", 10, 4), TableSpec("t0", 3, 4, "table_wise", owner=1),
             TableSpec("t1", 5, 4, "table_wise", owner=1), TableSpec("x", 6, 2, "replicated")]
    plan = plan_tables(specs, 4)
    g = plan.group("sharded_d4")
    assert g.shard_rows == 3 + 8  # ceil(10/4) row-wise + both table-wise tables on shard 1
    np.testing.assert_array_equal(plan.global_rows("r")[:4], [0, 1, 2, 11])
    np.testing.assert_array_equal(plan.global_rows("t1"), 11 + 3 + 3 + np.arange(5))
    assert plan.group("replicated_d2").replicated
    with pytest.raises(ValueError, match="owner=9"):
        plan_tables([TableSpec("t", 3, 4, "table_wise", owner=9)], 4)
    with pytest.raises(ValueError, match="placement='column'"):
        TableSpec("t", 3, 4, "column")


@pytest.fixture(scope="module")
def small():
    mesh = make_mesh({"data": 8})
    specs = [TableSpec("strict", 64, 4), TableSpec("hashed", 16, 4, id_policy="hash_modulo")]
    emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer("sgd", 0.1), capacity=4)
    return mesh, emb


def put(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def test_lookup_overflow_raises_and_policy_applies(small):
    mesh, emb = small
    state = emb.init(0)
    tables, _ = emb.to_dense(state)
    ids = {"strict": np.tile(np.arange(8, dtype=np.int32)[:, None], (1, 1)),
           "hashed": np.tile(np.array([[3, 19, 35, -1]], np.int32), (8, 1))}
    out = emb.lookup(state, put(mesh, ids))  # 2 distinct keys per device (group) <= 4
    np.testing.assert_allclose(out["hashed"][0], 3 * tables["hashed"][3], rtol=1e-6)
    np.testing.assert_allclose(out["strict"][:, :], tables["strict"][:8], rtol=1e-6)
    many = dict(ids, strict=np.arange(8 * 5, dtype=np.int32).reshape(8, 5))  # 5 + 1 > 4
    with pytest.raises(CapacityOverflowError, match="capacity 4"):
        emb.lookup(state, put(mesh, many))
    bad = dict(ids, strict=np.full((8, 1), 64, np.int32))
    with pytest.raises(ValueError, match="id_policy='error'"):
        emb.lookup(state, put(mesh, bad))


def test_host_retrieve_overflow_raises():
    spec = TableSpec("h", 10, 2)
    table = HostTable(spec, make_sparse_optimizer("sgd", 0.1), np.zeros((10, 2), np.float32))
    retrieve({"h": table}, {"h": np.array([[1, 2, 2, -1]])}, capacity=2)
    with pytest.raises(CapacityOverflowError):
        retrieve({"h": table}, {"h": np.array([[1, 2, 3]])}, capacity=2)
    with pytest.raises(ValueError, match="id 10 outside"):
        retrieve({"h": table}, {"h": np.array([[10]])}, capacity=2)
