"""ChangeTracker on sharded params inside the 8-device mesh; receiver sharded differently."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import sync
from jaxflow.sync.tracker import next_power_of_two
from tests.test_sync_trees import tree_bits


def _trainer_trees():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)

    def put(array, spec):
        return jax.device_put(jnp.asarray(array), NamedSharding(mesh, spec))

    master = {
        "w": rng.standard_normal((16, 12)).astype(np.float32) * 0.02,
        "b": rng.standard_normal(12).astype(np.float32),
        "emb": rng.standard_normal((10, 8)).astype(np.float32),
        "frozen": rng.standard_normal((8, 4)).astype(np.float32),
    }
    specs = {"w": P("data", "model"), "b": P("model"), "emb": P(None, "data"),
             "frozen": P(("data", "model"))}
    old = {k: put(v.astype(jnp.bfloat16), specs[k]) for k, v in master.items()}
    old["step"] = jnp.int32(3)
    new_host = {k: np.asarray(v).copy() for k, v in old.items() if k != "step"}
    w = new_host["w"].reshape(-1).view(np.uint16)
    w[[0, 5, 77, 100, 191]] += 1
    w[[50]] = 0x7FC3  # a NaN payload
    new_host["b"][[3, 11]] = -new_host["b"][[3, 11]]  # b is replicated over "data"
    new_host["emb"].reshape(-1).view(np.uint16)[:] ^= 1  # every element
    new = {k: put(v, specs[k]) for k, v in new_host.items()}
    new["step"] = jnp.int32(4)
    return mesh, old, new


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_tracker_payload_applies_to_differently_sharded_receiver(backend):
    _, old, new = _trainer_trees()
    tracker = sync.ChangeTracker(old, backend=backend, interpret=True, min_capacity=4)
    counts = tracker.observe(new)
    assert counts == {"['b']": 2, "['emb']": 80, "['frozen']": 0, "['step']": 1, "['w']": 6}
    diffs = tracker.diffs(new)
    np.testing.assert_array_equal(diffs[4].positions, [0, 5, 50, 77, 100, 191])
    for codec in ("auto", "entropy", "coo", "dense"):
        payload = tracker.encode(new, base_version=2, version=3, codec=codec)
        # the same payload as a stateless encode, base digest included
        assert payload == sync.encode(old, new, base_version=2, version=3, codec=codec)
    receiver_mesh = jax.make_mesh((8,), ("x",))
    receiver = {
        "w": jax.device_put(old["w"], NamedSharding(receiver_mesh, P("x"))),
        "b": np.asarray(old["b"]),
        "emb": jax.device_put(old["emb"], NamedSharding(receiver_mesh, P(None, "x"))),
        "frozen": old["frozen"],
        "step": jnp.int32(3),
    }
    wire = tracker.encode(new, base_version=2, version=3).to_bytes()
    out = sync.apply(sync.Payload.from_bytes(wire), receiver, version=2)
    assert tree_bits(out) == tree_bits(new)
    assert out["w"].sharding == receiver["w"].sharding
    tracker.commit(new)
    assert sum(tracker.observe(new).values()) == 0


def test_unknown_backend_rejected():
    _, old, _ = _trainer_trees()
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        sync.ChangeTracker(old, backend="cuda")


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [1, 1, 2, 4, 4, 8, 1024]
    assert next_power_of_two(3, minimum=128) == 128


def test_apply_on_device_keeps_sharding_and_is_bit_exact():
    _, old, new = _trainer_trees()
    for codec in ("auto", "coo", "dense"):
        payload = sync.encode(old, new, base_version=0, version=1, codec=codec)
        out = sync.apply(payload, old, version=0, on_device=True)
        assert tree_bits(out) == tree_bits(new)
        assert out["w"].sharding == old["w"].sharding
        assert out["emb"].sharding == old["emb"].sharding


def test_tracker_and_device_apply_on_auto_axis_mesh():
    from jax.sharding import AxisType
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto, AxisType.Auto))
    sharding = NamedSharding(mesh, P("a", "b"))
    x = np.random.default_rng(0).standard_normal((8, 8)).astype(jnp.bfloat16)
    y = x.copy()
    y.view(np.uint16)[0, :3] += 1
    y.view(np.uint16)[5, 5] = 0x7FC3
    old, new = {"w": jax.device_put(x, sharding)}, {"w": jax.device_put(y, sharding)}
    tracker = sync.ChangeTracker(old)
    assert tracker.observe(new) == {"['w']": 4}
    out = sync.apply(tracker.encode(new, base_version=0, version=1), old, version=0,
                     on_device=True)
    assert tree_bits(out) == tree_bits(new)
    assert out["w"].sharding == sharding
