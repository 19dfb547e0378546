"""The on-device sync path (jaxflow.sync.device_diff, SyncSender(path="device"), the device
receiver) makes the same payload bytes and the same replica bits as the host numpy path."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import sync
from jaxflow.sync import device_diff
from jaxflow.sync.encoder import dense_payload_size
from jaxflow.sync.replica import Replica, resolve_path
from jaxflow.sync.sync_sender import SyncSender
from jaxflow.sync.weight_sync import SyncConfig, WeightSync
from tests.test_sync_trees import adversarial_pair, tree_bits


def _f32_trees(seed: int = 0):
    """fp32 master weights, one small step (some bf16 values flip), an int counter."""
    rng = np.random.default_rng(seed)
    p0 = {"w": rng.standard_normal((256, 40)).astype(np.float32) * 0.05,
          "b": 1.0 + 0.05 * rng.standard_normal(40).astype(np.float32),
          "special": np.array([0.0, -0.0, np.inf, -np.inf, 1e-39, 3.0], np.float32),
          "step": np.int32(3), "hot": rng.standard_normal(64).astype(np.float32)}
    p1 = dict(p0)
    p1["w"] = p0["w"] - 2e-5 * np.tanh(rng.standard_normal((256, 40))).astype(np.float32)
    p1["b"] = p0["b"] + 1e-3 * rng.standard_normal(40).astype(np.float32)
    p1["special"] = np.array([-0.0, 0.0, -np.inf, np.inf, -1e-39, 3.0], np.float32)
    p1["step"] = np.int32(4)
    p1["hot"] = -p0["hot"]  # every element: the auto codec's mask / dense fallback
    return p0, p1


def _jax(tree):
    return jax.tree.map(jnp.asarray, tree)


def _publishes(p0, steps, codec, path, **kw):
    sender = SyncSender(_jax(p0) if path == "device" else p0, codec=codec, path=path, **kw)
    out = [sender.dense_payload()]  # the first full publish (a fresh replica's resync)
    for v, params in enumerate(steps, start=1):
        stats = sender.publish(_jax(params) if path == "device" else params, version=v)
        out.append(sender.chain_from(v - 1)[0])
        assert stats.dense_bytes == len(sender.dense_payload())  # computed == encoded
        assert stats.path == path
    assert sender.base_digest() == sync.device_digest(sender.snapshot)  # lanes carried right
    return out, sender


@pytest.mark.parametrize("codec", sync.CODECS)
def test_device_sender_makes_the_host_payload_bytes_f32(codec):
    p0, p1 = _f32_trees()
    # publish 2 is all-unchanged (zero changes), 3 flips every "w" element's sign (all changed)
    p3 = dict(p1, w=-p1["w"])
    steps = [p1, p1, p3]
    host, _ = _publishes(p0, steps, codec, "host")
    device, sender = _publishes(p0, steps, codec, "device")
    assert host == device
    assert sender.snapshot["w"].dtype == jnp.bfloat16 and isinstance(sender.snapshot["w"], jax.Array)


def test_device_sender_makes_the_host_payload_bytes_adversarial_bf16():
    """NaN payloads, +-0, infs, subnormals, empty / 0-d leaves, ints, long gaps (auto: its
    entropy, mask and dense sections; the other codecs are covered on the f32 trees)."""
    old, new = adversarial_pair(3)
    host, _ = _publishes(old, [new, old], "auto", "host")
    device, _ = _publishes(old, [new, old], "auto", "device")
    assert host == device


def test_device_sender_with_the_pallas_compaction_and_a_sharded_tree():
    p0, p1 = _f32_trees(1)
    host, _ = _publishes(p0, [p1], "auto", "host")
    kernel, _ = _publishes(p0, [p1], "auto", "device", backend="pallas", interpret=True)
    assert kernel == host
    # sharded over one axis and replicated over the other, sharded over both, replicated
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    specs = {"w": P("a"), "hot": P("b"), "b": P(("a", "b"))}
    shard = lambda t: {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, specs.get(k, P())))
                       for k, v in t.items()}
    sender = SyncSender(shard(p0), codec="auto", path="device")
    stats = sender.publish(shard(p1), version=1)
    assert sender.chain_from(0)[0] == host[1]
    assert sender.snapshot["w"].sharding.is_equivalent_to(shard(p0)["w"].sharding, 2)
    # replicas of a shard send nothing: at most 6 bytes per change + capacity slack per shard
    assert stats.host_bytes < 6 * 1.125 * stats.changed + 6 * 16 * 8 * 3 + 200


def test_device_sender_moves_only_the_changes_to_the_host():
    p0, p1 = _f32_trees()
    p1 = dict(p1, hot=p0["hot"])  # no dense fallback: only compacted pairs cross
    host = SyncSender(_jax(p0), codec="entropy", path="host").publish(_jax(p1))
    dev = SyncSender(_jax(p0), codec="entropy", path="device").publish(_jax(p1))
    assert host.host_bytes == sum(np.asarray(x).nbytes for x in jax.tree.leaves(p1))
    changed = dev.changed
    assert 0 < changed < dev.elements // 4
    n_leaves = len(jax.tree.leaves(p1))
    # 6 bytes per change (int32 position + uint16 delta), capacity slack <= 12.5% or the
    # 128-slot minimum per leaf, 4 + 8 bytes of count and lanes per leaf, the int leaf whole
    assert dev.host_bytes <= 6 * max(1.125 * changed, 0) + 6 * 128 * 3 + 12 * n_leaves + 4
    assert dev.host_bytes < host.host_bytes / 4
    assert dev.payload_bytes == host.payload_bytes and dev.changed == host.changed


def test_capacity_rounding():
    assert device_diff.capacity_for(1) == 128
    assert device_diff.capacity_for(1000, 1) == 1024
    assert device_diff.capacity_for(1025, 1) == 1152  # steps of 2048 / 16
    for k in (129, 5000, 70001):
        assert k <= device_diff.capacity_for(k, 1) <= 1.125 * k + 1


def test_dense_payload_size_is_computed_from_shapes():
    old, new = adversarial_pair(1)
    treedef, _, specs = sync.diff.tree_layout(new)
    data = sync.encode(new, new, base_version=-1, version=12, codec="dense").to_bytes()
    assert dense_payload_size(treedef, specs, version=12) == len(data)


@pytest.mark.parametrize("codec", ["auto", "coo"])
def test_device_receiver_with_the_scatter_kernel_matches_the_host_receiver(codec):
    old, new = adversarial_pair(5)
    for tree in (old, new):  # the 200k-element leaf costs interpret-mode tiles, nothing new
        del tree["sparse"]
    payload = sync.encode(old, new, base_version=0, version=1, codec=codec)
    want = sync.apply(payload, old, version=0)
    device_old = _jax(old)
    for scatter in ("xla", "pallas"):
        got = sync.apply(payload, device_old, version=0, on_device=True, scatter=scatter,
                         interpret=True)
        assert tree_bits(got) == tree_bits(want) == tree_bits(new), scatter
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(got))
    with pytest.raises(ValueError, match="scatter='cuda'"):
        sync.apply(payload, device_old, version=0, scatter="cuda")


def test_device_replica_and_weight_sync_end_to_end():
    p0, p1 = _f32_trees(2)
    p2 = dict(p1, b=p1["b"] + 2e-3)
    mesh = jax.make_mesh((8,), ("x",))
    shardings = {k: NamedSharding(mesh, P()) for k in p0}
    ws = WeightSync(_jax(p0), shardings, SyncConfig(codec="auto", path="device"))
    assert ws.sender.path == "device" and ws.replicas[0].path == "device"
    for v, p in enumerate([p1, p2], start=1):
        record = ws.publish(_jax(p), version=v)
        assert record.bit_exact and record.stats.path == "device"
    assert tree_bits(ws.rollout_params()) == tree_bits(sync.to_bf16(p2))
    replica = Replica(sync.to_bf16(p0), path="device", scatter="pallas", interpret=True)
    replica.receive(ws.sender.chain_from(0)[0])
    replica.receive(ws.sender.chain_from(1)[0])
    assert replica.digest() == ws.sender.digest()
    with pytest.raises(ValueError, match="sync.path='gpu'"):
        SyncConfig(path="gpu")
    assert resolve_path("auto", _jax(p0)) == "host"  # CPU devices: the host default


def test_sync_imports_and_raw_codecs_work_without_zstandard():
    code = textwrap.dedent("""
        import sys
        sys.modules["zstandard"] = None  # any import of it raises ImportError
        import numpy as np
        import jaxflow.sync as sync
        from jaxflow.sync import baseline, entropy  # noqa: F401  (import without zstandard)
        from jaxflow.sync.bits import BF16
        old = {"w": np.arange(64, dtype=np.float32).astype(BF16)}
        new = {"w": old["w"].copy()}
        new["w"].view(np.uint16)[[3, 40]] += 1
        for codec in ("dense", "coo", "gap"):
            p = sync.Payload.from_bytes(sync.encode(old, new, base_version=0, version=1,
                                                    codec=codec).to_bytes())
            out = sync.apply(p, old, version=0)
            assert out["w"].view(np.uint16).tolist() == new["w"].view(np.uint16).tolist()
        try:
            sync.encode(old, new, base_version=0, version=1, codec="entropy")
        except ImportError as e:
            assert "zstandard" in str(e), e
            print("OK")
    """)
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    import os
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "OK"


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_device_path_programs_lower_with_the_kernels(platform, monkeypatch):
    """The sender's single-device compaction and the receiver's kernel scatter, exported for
    TPU and GPU from this CPU host with the Pallas kernels inside."""
    from jaxflow.sync import receiver
    from pallas_kernels import lowering
    from tests.test_lowering_gate import KERNEL_CALL, building_for

    leaf = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((256,), jnp.int32)
    vals = jax.ShapeDtypeStruct((256,), jnp.uint16)
    with building_for(platform, monkeypatch):
        programs = [
            (lambda o, n: device_diff._compact_leaf(o, n, capacity=256, values="deltas",
                                                    kernel=True, interpret=False), (leaf, leaf)),
            (lambda x, p, v: receiver._kernel_scatter(x, p, v, delta=True, interpret=False),
             (leaf, slots, vals)),
        ]
        for fn, args in programs:
            text = lowering.export_for(fn, *args, platform=platform).mlir_module()
            assert KERNEL_CALL[platform] in text
