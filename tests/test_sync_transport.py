"""Transports deliver bit-exactly and survive a transfer killed mid-way (in-process on the
rollout sub-mesh, TCP over loopback, tensorstore file kvstore)."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.mesh import role_meshes
from jaxflow.sync import CODECS, FRESH, PayloadError, Replica, SyncSender, to_bf16, tree_digest
from jaxflow.sync.transport import InProcessLink, ReplicaServer, StorageChannel, TcpLink, tcp

# -- shared with test_sync_replicas / test_sync_rl: a small f32 trainer trajectory whose bf16
# casts change sparsely, as after small Adam steps.

def trainer_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"layer": {"w": rng.normal(size=(64, 48)).astype(np.float32),
                      "b": rng.normal(size=(48,)).astype(np.float32)},
            "embed": rng.normal(size=(32, 16)).astype(np.float32),
            "count": np.array([3, 1], np.int32)}


def trajectory(n: int, *, seed: int = 0, step: float = 1e-4) -> list[dict]:
    """n trees: each ~step-sized sign updates of the previous one (count bumps too)."""
    rng = np.random.default_rng(seed + 1)
    tree, out = trainer_tree(seed), []
    for _ in range(n):
        tree = {"layer": {k: v + step * np.sign(rng.normal(size=v.shape)).astype(np.float32)
                          for k, v in tree["layer"].items()},
                "embed": tree["embed"] + step * rng.normal(size=tree["embed"].shape
                                                           ).astype(np.float32),
                "count": tree["count"] + 1}
        out.append(tree)
    return out


@pytest.mark.parametrize("codec", CODECS)
def test_in_process_bit_exact_on_rollout_mesh(codec):
    rollout = role_meshes({"trainer": 4, "rollout": 4})["rollout"]
    shardings = jax.tree.map(lambda x: NamedSharding(
        rollout, P("data") if x.ndim == 2 else P()), trainer_tree())
    sender = SyncSender(trainer_tree(), codec=codec)
    replica = Replica(to_bf16(trainer_tree()), shardings=shardings)
    link = InProcessLink(replica)
    for tree in trajectory(3):
        stats = sender.publish(tree)
        assert sender.sync(link) == (stats.version, tree_digest(to_bf16(tree)))
    assert replica.version == 3
    w = replica.params["layer"]["w"]
    assert w.sharding == shardings["layer"]["w"] and set(w.devices()) == set(rollout.devices.flat)
    assert w.dtype == jax.numpy.bfloat16
    if codec != "dense":
        assert 0 < stats.changed_fraction < 0.5 and stats.ratio_vs_dense > 1


@pytest.fixture
def server():
    srv = ReplicaServer(Replica(to_bf16(trainer_tree())), timeout_s=5).start()
    yield srv
    srv.stop()


def test_tcp_bit_exact_in_small_chunks(server):
    sender = SyncSender(trainer_tree(), codec="entropy")
    link = TcpLink(*server.address, timeout_s=5, chunk_bytes=64)  # many chunks per payload
    for tree in trajectory(3):
        sender.publish(tree)
        assert sender.sync(link) == (sender.version, tree_digest(to_bf16(tree)))
    assert link.status() == (3, sender.digest()) and server.replica.version == 3


def test_tcp_killed_transfer_keeps_version_and_next_sync_recovers(server):
    sender = SyncSender(trainer_tree(), codec="auto")
    link = TcpLink(*server.address, timeout_s=5)
    trees = trajectory(2)
    sender.publish(trees[0])
    data = sender.plan(0)[0]
    before = server.replica.digest()
    with tcp.Channel.connect(server.address, kinds=tcp.KINDS, timeout_s=5) as ch:  # dies mid-payload
        ch.sock.sendall(tcp.HEADER.pack(b"DATA", len(data)) + data[: len(data) // 2])
    with tcp.Channel.connect(server.address, kinds=tcp.KINDS, timeout_s=5) as ch:  # corrupt payload
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        ch.send(b"VERQ")
        assert ch.recv()[0] == b"VERS"
        ch.send(b"DATA", bad)
        kind, body = ch.recv()
        assert kind == b"ERR " and json.loads(body)["version"] == 0
    assert link.status() == (0, before)
    assert any("closed after" in e for e in server.errors)
    sender.publish(trees[1])  # the replica missed a version too: chained catch-up
    assert sender.sync(link) == (2, tree_digest(to_bf16(trees[1])))
    assert sender.routes[-1] == "chain"


def test_tcp_refuses_oversized_frame():
    srv = ReplicaServer(Replica(to_bf16(trainer_tree())), timeout_s=5,
                        max_payload_bytes=100).start()
    try:
        sender = SyncSender(trainer_tree(), codec="dense")
        sender.publish(trajectory(1)[0])
        with pytest.raises(OSError):
            sender.sync(TcpLink(*srv.address, timeout_s=5))
        assert srv.replica.version == 0 and "exceeds max_payload_bytes" in srv.errors[-1]
    finally:
        srv.stop()


def test_storage_round_trip_chain_and_dense(tmp_path):
    sender = SyncSender(trainer_tree(), codec="auto")
    channel = StorageChannel(str(tmp_path / "kv"), dense_every=100)
    channel.write(sender)  # version 0: dense snapshot only
    follower = Replica(to_bf16(trainer_tree()))
    lagger = Replica(to_bf16(trainer_tree()))
    for tree in trajectory(3):
        sender.publish(tree)
        channel.write(sender)
        assert channel.pull(follower) == sender.version
        assert follower.digest() == sender.digest()
    assert [s["version"] for s in channel.read_manifest()["steps"]] == [1, 2, 3]
    assert channel.pull(lagger) == 3 and lagger.digest() == sender.digest()
    assert lagger.bytes_received < channel.read_manifest()["dense"]["bytes"]  # chained
    fresh = Replica(jax.tree.map(np.zeros_like, to_bf16(trainer_tree())), version=FRESH)
    assert channel.pull(fresh) == 3 and fresh.digest() == sender.digest()  # dense + chain


class _KilledWriter(StorageChannel):
    """A writer killed while writing a payload: half the bytes land, the manifest does not."""

    def _put(self, prefix, data):
        super()._put(prefix, data[: len(data) // 2])
        raise KeyboardInterrupt("killed mid-payload")


def test_storage_partial_write_invisible_then_recovers(tmp_path):
    sender = SyncSender(trainer_tree(), codec="auto")
    path = str(tmp_path / "kv")
    StorageChannel(path).write(sender)
    replica = Replica(to_bf16(trainer_tree()))
    trees = trajectory(2)
    sender.publish(trees[0])
    with pytest.raises(KeyboardInterrupt):
        _KilledWriter(path).write(sender)
    channel = StorageChannel(path)
    assert channel.read_manifest()["version"] == 0
    assert channel.pull(replica) == 0 and replica.digest() == tree_digest(to_bf16(trainer_tree()))
    sender.publish(trees[1])
    channel.write(sender)  # the restarted writer publishes both missing steps
    assert [s["version"] for s in channel.read_manifest()["steps"]] == [1, 2]
    assert channel.pull(replica) == 2 and replica.digest() == sender.digest()


def test_storage_corrupt_step_falls_back_to_dense(tmp_path):
    sender = SyncSender(trainer_tree(), codec="auto")
    channel = StorageChannel(str(tmp_path / "kv"), dense_every=1)
    channel.write(sender)
    replica = Replica(to_bf16(trainer_tree()))
    sender.publish(trajectory(1)[0])
    manifest = channel.write(sender)
    key = manifest["steps"][-1]["key"]
    data = bytearray(channel.kv.read(key).result().value)
    data[-1] ^= 1
    channel.kv.write(key, bytes(data)).result()
    assert channel.pull(replica) == 1 and replica.digest() == sender.digest()
    channel.kv.write(manifest["dense"]["key"], b"JFSYNC truncated").result()
    replica2 = Replica(to_bf16(trainer_tree()))
    with pytest.raises(PayloadError, match="stays at version 0"):
        channel.pull(replica2)
    assert replica2.version == 0 and replica2.digest() == tree_digest(to_bf16(trainer_tree()))
