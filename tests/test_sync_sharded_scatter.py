"""The replica scatter's kernel on multi-chip replicas: per shard in a shard_map == XLA's scatter.

A leaf sharded over a mesh gets, per device, the updates that land in its shard (as row-major
positions inside the shard, :func:`jaxflow.sync.receiver.shard_update_lists`), and each device
runs ``sync_scatter_apply`` on its own shard (Pallas interpret mode here, on fake CPU devices).
The result must be the XLA path's bits exactly: both are integer writes of the same uint16
patterns (NaN payloads, signed zeros and all), new values ("coo") and wrapping deltas ("gap").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import sync
from jaxflow.sync import receiver
from tests.test_sync_trees import bf16_from_bits

SHAPE = (16, 64)  # one 128-lane tile per shard at every layout below (interpret-mode cost)
LAYOUTS = [  # (mesh shape, axis names, leaf spec)
    ((2,), ("x",), P("x")),  # rows over 2 devices: each shard a contiguous range
    ((4,), ("x",), P(None, "x")),  # columns over 4: every shard's updates interleave
    ((2, 4), ("data", "model"), P("data", "model")),  # blocks over 8 devices
    ((2, 4), ("data", "model"), P(None, "model")),  # replicated over "data": equal lists
]


def _trees(seed: int = 0):
    """bf16 (old, new): sparse changes incl. special bit patterns, and a leaf left alone."""
    rng = np.random.default_rng(seed)
    old_bits = rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16)
    new_bits = old_bits.copy()
    flat = new_bits.reshape(-1)
    where = rng.choice(flat.size, 150, replace=False)
    flat[where] = rng.integers(0, 1 << 16, where.size, dtype=np.uint16)
    flat[where[:6]] = [0x7FC1, 0xFFFF, 0x8000, 0x0000, 0x7F80, 0x0001]  # NaN payloads, +-0, inf
    same = rng.integers(0, 1 << 16, (8, 8), dtype=np.uint16)
    return ({"w": bf16_from_bits(old_bits), "same": bf16_from_bits(same)},
            {"w": bf16_from_bits(new_bits), "same": bf16_from_bits(same)})


def _bits(x) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.uint16))


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("codec", ["coo", "gap"])
def test_sharded_kernel_scatter_equals_the_xla_scatter(codec, layout, monkeypatch):
    axes, names, spec = LAYOUTS[layout]
    mesh = jax.make_mesh(axes, names)
    old, new = _trees(layout)
    payload = sync.encode(old, new, base_version=0, version=1, codec=codec)
    sharding = {"w": NamedSharding(mesh, spec), "same": NamedSharding(mesh, P())}
    params = {k: jax.device_put(jnp.asarray(v), sharding[k]) for k, v in old.items()}
    calls = []
    real = receiver._sharded_kernel_scatter
    monkeypatch.setattr(receiver, "_sharded_kernel_scatter",
                        lambda *a, **kw: calls.append(kw["spec"]) or real(*a, **kw))
    want = sync.apply(payload, params, version=0, on_device=True, scatter="xla")
    assert not calls
    got = sync.apply(payload, params, version=0, on_device=True, scatter="pallas",
                     interpret=True)
    assert calls == [spec]  # the kernel ran for the changed, sharded leaf (once)
    assert got["w"].sharding == params["w"].sharding
    np.testing.assert_array_equal(_bits(got["w"]), _bits(want["w"]))
    np.testing.assert_array_equal(_bits(got["w"]), np.asarray(new["w"]).view(np.uint16))
    assert got["same"] is params["same"]


def test_shard_update_lists_are_each_shards_own_ascending_positions():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))  # shards [8, 16]
    pos = np.array([0, 15, 16, 63, 64 + 17, 8 * 64, 1023], np.int64)
    vals = np.arange(1, pos.size + 1, dtype=np.uint16)
    p_all, v_all = receiver.shard_update_lists(sharding, SHAPE, pos, vals)
    assert p_all.shape == (2, 4, 128) and p_all.sharding.spec == P("data", "model", None)
    p_all, v_all = np.asarray(p_all), np.asarray(v_all)
    # global (row, col) -> shard (row // 8, col // 16), local row-major (row % 8) * 16 + col % 16
    assert p_all[0, 0, :4].tolist() == [0, 15, -1, -1] and v_all[0, 0, :2].tolist() == [1, 2]
    assert p_all[0, 1, :3].tolist() == [0, 16 + 1, -1] and v_all[0, 1, :2].tolist() == [3, 5]
    assert p_all[0, 3, :2].tolist() == [15, -1] and v_all[0, 3, 0] == 4
    assert p_all[1, 0, :2].tolist() == [0, -1] and v_all[1, 0, 0] == 6
    assert p_all[1, 3, :2].tolist() == [127, -1] and v_all[1, 3, 0] == 7
    assert (p_all[0, 2] == -1).all() and (p_all[1, 1:3] == -1).all()
