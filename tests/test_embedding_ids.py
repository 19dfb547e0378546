"""Embedding ids on every path: integer dtypes only, 64-bit ids policed before any cast, and
hash_modulo giving the same rows on the sharded device lookup and the host-resident path."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, make_sparse_optimizer
from jaxflow.embeddings.host import HostTable, retrieve
from jaxflow.embeddings.reference import reference_lookup
from jaxflow.mesh import make_mesh

V, B, L = 40, 8, 2
PLACEMENTS = ("row_wise", "table_wise", "replicated")
POLICIES = ("error", "hash_modulo")
SPECS = [TableSpec(f"{pl}_{po}", V, 4, pl, "sum", id_policy=po) for pl in PLACEMENTS for po in POLICIES]
NAMES = [s.name for s in SPECS]
BIG = [2**31 + 3, 2**32 + 5, 2**40 + 7, 2**63 - 1]  # int32 would read rows 3, 5, 7, -1...


@pytest.fixture(scope="module")
def emb():
    mesh = make_mesh({"data": 8})
    e = ShardedEmbeddings(SPECS, mesh, make_sparse_optimizer("sgd", 0.1), capacity=16)
    return e, e.init(0)


def valid_ids(dtype=np.int32):
    ids = np.arange(B * L, dtype=np.int64).reshape(B, L) % V
    ids[0, 1] = -1
    return {n: ids.astype(dtype) for n in NAMES}


BAD_DTYPES = {
    "float 3.7": np.full((B, L), 3.7, np.float32),
    "float nan": np.full((B, L), np.nan, np.float32),
    "float -0.5": np.full((B, L), -0.5, np.float64),
    "bool True": np.ones((B, L), bool),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", list(BAD_DTYPES))
def test_non_integer_ids_are_rejected_in_every_placement_and_policy(emb, name, kind):
    e, state = emb
    ids = {**valid_ids(), name: BAD_DTYPES[kind]}
    with pytest.raises(TypeError, match=f"table '{name}': ids have dtype .*valid: an integer dtype"):
        e.lookup(state, ids)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_non_integer_device_ids_are_rejected_at_trace_time(emb, placement):
    e, state = emb
    name = f"{placement}_hash_modulo"
    ids = {**{n: jnp.asarray(v) for n, v in valid_ids().items()}, name: jnp.full((B, L), 3.7)}
    with pytest.raises(TypeError, match=f"table '{name}': ids have dtype float32"):
        e.lookup(state, ids)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_wide_ids_outside_the_vocabulary_raise_under_error(emb, placement, dtype):
    e, state = emb
    name = f"{placement}_error"
    ids = valid_ids(np.int64)
    ids[name] = ids[name].astype(dtype) if dtype == np.int64 else np.abs(ids[name]).astype(dtype)
    ids[name][3, 0] = 2**32 + 5
    with pytest.raises(ValueError, match=f"table '{name}': id 4294967301 outside \\[0, 40\\)"):
        e.lookup(state, ids)


def test_hash_modulo_of_wide_ids_matches_the_reference_and_the_host_path(emb):
    e, state = emb
    ids = valid_ids(np.int64)
    for name in NAMES:
        if name.endswith("hash_modulo"):
            ids[name][1:5, 0] = BIG
    ids["row_wise_hash_modulo"] = np.abs(ids["row_wise_hash_modulo"]).astype(np.uint64)
    ids["row_wise_hash_modulo"][5, 1] = 2**64 - 1
    out = e.lookup(state, ids)
    tables, _ = e.to_dense(state)
    hashed = {n: np.where(v.astype(object) >= 0, v.astype(object) % V, -1).astype(np.int32)
              for n, v in ids.items()}  # exact (Python ints), then int32
    ref = reference_lookup(SPECS, tables, hashed)
    for name in NAMES:
        np.testing.assert_allclose(np.asarray(out[name]), np.asarray(ref[name]), rtol=1e-6,
                                   atol=1e-7, err_msg=name)
    # host path: the same rows
    opt = make_sparse_optimizer("sgd", 0.1)
    for name in ("row_wise_hash_modulo", "replicated_hash_modulo"):
        spec = next(s for s in SPECS if s.name == name)
        host = {name: HostTable(spec, opt, tables[name])}
        batch = retrieve(host, {name: ids[name]}, capacity=B * L)
        expected = np.unique(hashed[name][hashed[name] >= 0])
        np.testing.assert_array_equal(batch.unique_ids[name], expected)


@pytest.mark.parametrize("kind", list(BAD_DTYPES))
def test_host_path_rejects_non_integer_ids(kind):
    spec = TableSpec("t", V, 4, "row_wise", "sum", id_policy="hash_modulo")
    host = {"t": HostTable(spec, make_sparse_optimizer("sgd", 0.1), np.zeros((V, 4), np.float32))}
    with pytest.raises(TypeError, match="table 't': ids have dtype"):
        retrieve(host, {"t": BAD_DTYPES[kind]}, capacity=B * L)


def test_host_path_range_checks_wide_ids_under_error():
    spec = TableSpec("t", V, 4, "row_wise", "sum")
    host = {"t": HostTable(spec, make_sparse_optimizer("sgd", 0.1), np.zeros((V, 4), np.float32))}
    ids = np.zeros((B, L), np.int64)
    ids[2, 1] = 2**32 + 5
    with pytest.raises(ValueError, match="id 4294967301 outside"):
        retrieve(host, {"t": ids}, capacity=B * L)
