"""The base-tree digest is computed where the leaves live (jaxpr outputs only per-leaf scalars,
no implicit transfer, a few bytes fetched), agrees across numpy / sharded layouts, detects the
changes it promises to, and makes a wrong ``version=`` or a stale replica refuse a delta."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import sync
from jaxflow.sync import digest
from jaxflow.sync.payload import FRESH
from tests.test_sync_format import _JAX_DTYPES, _to_jax, random_tree_pair
from tests.test_sync_trees import adversarial_pair, tree_bits

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def sharded_pair():
    """(numpy tree, the same tree as jax Arrays sharded over the 8-device mesh)."""
    mesh = jax.make_mesh((8,), ("x",))
    tree, _ = random_tree_pair(7, dtypes=_JAX_DTYPES, depth=2)
    tree["w"] = np.random.default_rng(0).integers(0, 1 << 16, (256, 64), np.uint16).view(BF16)
    return tree, _to_jax(tree, mesh)


def test_digest_function_outputs_only_per_leaf_scalars(sharded_pair):
    _, tree = sharded_pair
    leaves = tuple(jax.tree.leaves(tree))
    closed = jax.make_jaxpr(digest.leaf_lanes)(leaves)
    outs = closed.jaxpr.outvars
    assert len(outs) == len(leaves)
    assert all(o.aval.shape == (2,) and o.aval.dtype == jnp.uint32 for o in outs)

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    yield from primitives(sub)

    names = set(primitives(closed.jaxpr))
    assert not names & {"pure_callback", "io_callback", "debug_callback", "device_put"}, names


def test_digest_makes_no_host_transfer_of_leaf_data(sharded_pair, monkeypatch):
    _, tree = sharded_pair
    fetched = []
    real_get = jax.device_get

    def counting_get(x):
        fetched.append(sum(np.asarray(a).nbytes for a in jax.tree.leaves(x)))
        return real_get(x)

    monkeypatch.setattr(jax, "device_get", counting_get)
    with jax.transfer_guard("disallow"):  # any implicit transfer of a leaf would raise
        value = sync.device_digest(tree)
    n_leaves = len(jax.tree.leaves(tree))
    assert sum(fetched) == 8 * n_leaves  # two uint32 per leaf, nothing else
    assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)) > 100 * sum(fetched)
    assert len(value) == 32


def test_digest_same_for_numpy_and_sharded_layouts(sharded_pair):
    host, sharded = sharded_pair
    explicit = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    resharded = dict(sharded, w=jax.device_put(host["w"], NamedSharding(explicit, P("a", "b"))))
    one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[3]), host)
    expected = sync.device_digest(host)
    assert sync.device_digest(sharded) == sync.device_digest(resharded) == expected
    assert sync.device_digest(one_device) == expected


def test_digest_same_for_8_byte_dtypes_under_x64():
    tree = {"f": np.array([1.5, -2.25, np.nan], np.float64), "i": np.array([-3, 2**40]),
            "c": np.array([1 + 2j], np.complex128), "c64": np.array([1 - 2j, 3j], np.complex64)}
    with jax.enable_x64(True):
        on_device = {k: jnp.asarray(v) for k, v in tree.items()}
        assert on_device["f"].dtype == jnp.float64
        assert (digest.tree_lanes(on_device) == digest.tree_lanes(tree)).all()


def test_digest_detects_what_it_promises():
    rng = np.random.default_rng(1)
    base = {"a": rng.integers(0, 1 << 16, 257, np.uint16).view(BF16),
            "b": rng.standard_normal((3, 5)).astype(np.float32), "c": np.zeros((0,), np.int32)}
    seen = {sync.device_digest(base)}

    def variant(**leaves):
        tree = {**base, **leaves}
        value = sync.device_digest(tree)
        assert value not in seen, leaves.keys()
        seen.add(value)

    for i in range(0, 257, 16):  # every single-element change: guaranteed (bijective summand)
        bits = base["a"].view(np.uint16).copy()
        bits[i] ^= np.uint16(1 << (i % 16))
        variant(a=bits.view(BF16))
    variant(a=base["a"][::-1].copy())  # same values, permuted positions
    swapped = base["a"].copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    if swapped[0] != swapped[1]:
        variant(a=swapped)
    variant(b=base["b"].reshape(5, 3))  # same bits, another shape
    variant(b=base["b"].view(np.int32))  # same bits, another dtype
    variant(c=np.zeros((0, 1), np.int32))  # empty, another shape
    zero = base["b"].copy()
    zero[0, 0] = 0.0
    variant(b=zero)
    negative_zero = zero.copy()
    negative_zero[0, 0] = -0.0  # equal as floats, different bits
    variant(b=negative_zero)
    assert sync.device_digest({"x": base["a"]}) != sync.device_digest({"y": base["a"]})


@pytest.mark.parametrize("codec", ["entropy", "auto", "coo", "gap"])
def test_wrong_version_cannot_double_apply_a_delta(codec):
    old, new = adversarial_pair()
    payload = sync.Payload.from_bytes(sync.encode(old, new, base_version=0, version=1,
                                                  codec=codec).to_bytes())
    assert payload.base_digest == sync.device_digest(old)
    once = sync.apply(payload, adversarial_pair()[0], version=0)
    before = tree_bits(once)
    with pytest.raises(sync.PayloadError, match=(
            f"base digest mismatch: the payload was encoded against a tree with digest "
            f"{payload.base_digest} \\(version 0\\), the receiver's tree at version 0 has "
            f"digest {sync.device_digest(new)}")):
        sync.apply(payload, once, version=0, inplace=True)  # says 0, holds 1
    assert tree_bits(once) == before == tree_bits(new)


def test_wrong_base_refused_on_sharded_receiver(sharded_pair):
    host, sharded = sharded_pair
    new = dict(host, w=(host["w"].view(np.uint16) + np.uint16(1)).view(BF16))
    payload = sync.encode(host, new, base_version=4, version=5, codec="entropy")
    stale = dict(sharded, w=jax.device_put(new["w"], sharded["w"].sharding))
    with jax.transfer_guard("disallow"), pytest.raises(sync.PayloadError,
                                                       match="base digest mismatch"):
        sync.apply(payload, stale, version=4, on_device=True)
    out = sync.apply(payload, sharded, version=4, on_device=True)
    assert tree_bits(out) == tree_bits(new) and out["w"].sharding == sharded["w"].sharding


def test_full_payloads_carry_no_base_digest_and_deltas_without_one_still_apply():
    old, new = adversarial_pair()
    dense = sync.encode(old, new, base_version=0, version=1, codec="dense")
    assert dense.is_full and dense.base_digest is None
    delta = sync.encode(old, new, base_version=0, version=1, codec="auto")
    legacy = dataclasses.replace(delta, base_digest=None)  # e.g. ChangeTracker.encode today
    assert tree_bits(sync.apply(legacy, old, version=0)) == tree_bits(new)


# -- replica versions -----------------------------------------------------------------------

def _versions(n):
    old, new = adversarial_pair()
    trees = [old]
    for _ in range(n):
        trees.append(jax.tree.map(lambda x: np.asarray(x).copy(), new))
        new = jax.tree.map(lambda x: (x.view(np.uint16) + np.uint16(1)).view(BF16)
                           if np.asarray(x).dtype == BF16 and np.ndim(x) else x, new)
    return trees


def test_replica_refuses_an_older_full_payload_unless_rollback():
    trees = _versions(3)
    sender = sync.SyncSender(trees[0], codec="auto")
    replica = sync.Replica(sync.to_bf16(trees[0]))
    v1_dense = None
    for v, tree in enumerate(trees[1:], start=1):
        sender.publish(tree, version=v)
        if v == 1:
            v1_dense = sender.dense_payload()
        replica.receive(sender.chain_from(v - 1)[0])
    assert replica.version == 3
    before = tree_bits(replica.params)
    with pytest.raises(sync.PayloadError, match="payload is version 1, older than the "
                                                "replica's version 3: refused \\(pass "
                                                "rollback=True to roll back\\)"):
        replica.receive(v1_dense)
    assert replica.version == 3 and tree_bits(replica.params) == before
    assert replica.receive(v1_dense, rollback=True) == 1
    assert tree_bits(replica.params) == tree_bits(sync.to_bf16(trees[1]))


def test_replica_refuses_an_older_delta_naming_both_versions():
    trees = _versions(2)
    sender = sync.SyncSender(trees[0], codec="entropy")
    replica = sync.Replica(sync.to_bf16(trees[0]))
    sender.publish(trees[1])
    step_1 = sender.chain_from(0)[0]
    sender.publish(trees[2])
    replica.receive(step_1)
    replica.receive(sender.chain_from(1)[0])
    before = tree_bits(replica.params)
    for rollback in (False, True):
        with pytest.raises(sync.PayloadError, match="payload applies to version 0, replica is "
                                                    "at 2 \\(payload: 0 -> 1\\) \\(an older "
                                                    "payload; only a full payload can roll"):
            replica.receive(step_1, rollback=rollback)
    assert replica.version == 2 and tree_bits(replica.params) == before


def test_replica_stale_params_refuse_a_delta_for_its_version():
    """A replica whose params silently differ from its version's tree refuses the delta."""
    trees = _versions(1)
    sender = sync.SyncSender(trees[0], codec="auto")
    sender.publish(trees[1])
    replica = sync.Replica(sync.to_bf16(trees[1]), version=0)  # claims 0, holds 1
    before = tree_bits(replica.params)
    with pytest.raises(sync.PayloadError, match="base digest mismatch"):
        replica.receive(sender.chain_from(0)[0])
    assert replica.version == 0 and tree_bits(replica.params) == before
    assert replica.receive(sender.dense_payload()) == 1  # a resync repairs it


def test_dense_resync_payload_is_based_on_fresh():
    sender = sync.SyncSender(_versions(0)[0], codec="auto", version=5)
    payload = sync.Payload.from_bytes(sender.dense_payload())
    assert (payload.base_version, payload.version, payload.is_full) == (FRESH, 5, True)
    fresh = sync.Replica(jax.tree.map(np.zeros_like, sender.snapshot), version=FRESH)
    assert fresh.receive(sender.dense_payload()) == 5
    assert fresh.receive(sender.dense_payload()) == 5  # same version again: accepted


def test_digest_lowers_for_tpu_and_cuda():
    from jax import export

    leaves = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((64, 32), jnp.bfloat16), ((), jnp.float32), ((0, 3), jnp.float16), ((5,), jnp.uint8),
        ((4,), jnp.bool_), ((3,), jnp.complex64), ((7,), jnp.float8_e4m3fn),
        ((6,), jnp.float4_e2m1fn), ((2, 2), jnp.int32)])
    exported = export.export(digest.leaf_lanes, platforms=("tpu", "cuda"))(leaves)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [((2,), jnp.uint32)] * 9


def test_sender_keeps_its_base_digest_current_from_the_diffs():
    """The sender advances its snapshot's lanes in O(changes) (bf16 leaves by lanes_delta,
    others recomputed); they must equal a full recomputation after every publish."""
    trees = [dict(t, counter=np.int64(v)) for v, t in enumerate(_versions(3))]
    sender = sync.SyncSender(trees[0], codec="entropy")
    for v in range(1, 4):
        base = sync.device_digest(sender.snapshot)
        assert sender.base_digest() == base
        sender.publish(trees[v])
        assert sync.Payload.from_bytes(sender.chain_from(v - 1)[0]).base_digest == base
    assert sender.base_digest() == sync.device_digest(sender.snapshot)
    np.testing.assert_array_equal(sender.state.lanes, digest.tree_lanes(sender.snapshot))
