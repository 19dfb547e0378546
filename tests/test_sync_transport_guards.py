"""Transports under hostile or broken input: the TCP server caps frames by what its replica
expects and one bad peer never stops it serving the others; the storage channel recovers from
a damaged manifest by itself."""

import threading
import time

import jax
import numpy as np
import pytest

from jaxflow.sync import PayloadError, Replica, SyncSender, to_bf16, tree_digest
from jaxflow.sync import payload as fmt
from jaxflow.sync.diff import tree_layout
from jaxflow.sync.transport import ReplicaServer, StorageChannel, TcpLink, storage, tcp
from tests.test_sync_transport import trainer_tree, trajectory


@pytest.fixture
def server():
    srv = ReplicaServer(Replica(to_bf16(trainer_tree())), timeout_s=5).start()
    yield srv
    srv.stop()


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def test_default_frame_cap_is_the_replicas_expected_payload_size(server):
    treedef, _, specs = tree_layout(server.replica.params)
    assert server.max_payload_bytes == fmt.max_payload_bytes(treedef, specs)
    tree_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(server.replica.params))
    assert tree_bytes < server.max_payload_bytes < 4 * tree_bytes + (1 << 16)


def test_huge_frame_refused_before_allocation_and_server_keeps_serving(server):
    before = server.replica.digest()
    with tcp.Channel.connect(server.address, kinds=tcp.KINDS, timeout_s=5) as ch:
        ch.send(b"VERQ")
        assert ch.recv()[0] == b"VERS"  # authenticated: the payload limit applies
        ch.sock.sendall(tcp.HEADER.pack(b"DATA", (1 << 34) - 1))
        assert ch.sock.recv(1) == b""  # the server hung up on this peer
    assert server.errors[-1] == repr(tcp.FrameError(
        f"DATA frame of {(1 << 34) - 1} bytes exceeds max_payload_bytes="
        f"{server.max_payload_bytes}"))
    with tcp.Channel.connect(server.address, kinds=tcp.KINDS, timeout_s=5) as ch:  # control too
        ch.sock.sendall(tcp.HEADER.pack(b"VERQ", tcp.CONTROL_BYTES + 1))
        assert ch.sock.recv(1) == b""
    assert "VERQ frame of" in server.errors[-1] and "exceeds the VERQ limit" in server.errors[-1]
    sender = SyncSender(trainer_tree(), codec="auto")
    sender.publish(trajectory(1)[0])
    assert sender.sync(TcpLink(*server.address, timeout_s=5)) == (1, sender.digest())
    assert server.replica.digest() != before


def test_stalled_peer_does_not_block_the_others(server):
    sender = SyncSender(trainer_tree(), codec="entropy")
    sender.publish(trajectory(1)[0])
    data = sender.plan(0)[0]
    stalled = tcp.Channel.connect(server.address, kinds=tcp.KINDS, timeout_s=5)
    try:  # announces a payload, sends half, then stalls with the connection open
        stalled.sock.sendall(tcp.HEADER.pack(b"DATA", len(data)) + data[: len(data) // 2])
        t0 = time.monotonic()
        assert sender.sync(TcpLink(*server.address, timeout_s=5)) == (1, sender.digest())
        assert time.monotonic() - t0 < 4  # well before the server's 5 s timeout ended it
    finally:
        stalled.close()
    _wait_for(lambda: any("closed after" in e for e in server.errors))
    assert server.replica.version == 1


def test_peer_that_crashes_the_handler_ends_only_its_own_link(server, monkeypatch):
    sender = SyncSender(trainer_tree(), codec="auto")
    sender.publish(trajectory(1)[0])
    real = server.replica.receive
    calls = []

    def explode_once(data, **kw):
        calls.append(len(data))
        if len(calls) == 1:
            raise MemoryError("simulated allocation failure")
        return real(data, **kw)

    monkeypatch.setattr(server.replica, "receive", explode_once)
    with pytest.raises(OSError):
        sender.sync(TcpLink(*server.address, timeout_s=5))
    assert server.errors[-1] == "MemoryError('simulated allocation failure')"
    assert server.replica.version == 0
    assert sender.sync(TcpLink(*server.address, timeout_s=5)) == (1, sender.digest())


def test_concurrent_links_are_serialised(server):
    sender = SyncSender(trainer_tree(), codec="gap")
    for tree in trajectory(2):
        sender.publish(tree)
    results, refusals = [], []

    def sync():
        try:
            results.append(sender.sync(TcpLink(*server.address, timeout_s=5)))
        except PayloadError as e:
            refusals.append(str(e))

    threads = [threading.Thread(target=sync) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    # Each link reads the version first; a racing one may send a chain the replica already
    # applied (refused, replica unchanged) -- never a corrupt replica.
    assert server.replica.version == 2 and server.replica.digest() == sender.digest()
    assert results and all(r == (2, sender.digest()) for r in results)
    assert len(results) + len(refusals) == 3
    assert all("rejected a payload" in e for e in refusals), refusals


# -- storage ---------------------------------------------------------------------------------

def _published(tmp_path, n, **kw):
    sender = SyncSender(trainer_tree(), codec="auto")
    channel = StorageChannel(str(tmp_path / "kv"), **kw)
    channel.write(sender)
    for tree in trajectory(n):
        sender.publish(tree)
        channel.write(sender)
    return sender, channel


def test_truncated_manifest_recovers_from_the_last_good_one(tmp_path):
    sender, channel = _published(tmp_path, 2)
    good = channel.kv.read(storage.MANIFEST).result().value
    channel.kv.write(storage.MANIFEST, bytes(good)[: len(good) // 2]).result()
    replica = Replica(to_bf16(trainer_tree()))
    assert channel.pull(replica) == 2 and replica.digest() == sender.digest()
    key, why = channel.recovered
    assert key.startswith(storage.HISTORY) and "manifest unreadable (JSONDecodeError" in why
    sender.publish(trajectory(3)[2])
    manifest = channel.write(sender)  # the writer is not wedged: it rewrites the manifest
    assert manifest["version"] == 3 and channel.read_manifest() == manifest
    assert channel.recovered is None
    assert channel.pull(replica) == 3 and replica.digest() == sender.digest()


def test_sealed_manifest_detects_a_parseable_but_altered_copy(tmp_path):
    sender, channel = _published(tmp_path, 1)
    raw = bytes(channel.kv.read(storage.MANIFEST).result().value)
    channel.kv.write(storage.MANIFEST, raw.replace(b'"version": 1', b'"version": 7')).result()
    assert channel.read_manifest()["version"] == 1
    assert "manifest seal mismatch" in channel.recovered[1]


def test_no_readable_manifest_refuses_pull_and_writer_starts_over(tmp_path):
    sender, channel = _published(tmp_path, 1, keep_manifests=2)
    for key in channel.kv.list().result():
        if key.startswith(storage.HISTORY.encode()) or key == storage.MANIFEST.encode():
            channel.kv.write(key, b'{"manifest": ').result()
    replica = Replica(to_bf16(trainer_tree()))
    with pytest.raises(PayloadError, match="replica stays at version 0: no readable manifest"):
        channel.pull(replica)
    assert replica.version == 0 and replica.digest() == tree_digest(to_bf16(trainer_tree()))
    manifest = channel.write(sender)
    assert manifest["steps"] == [] and manifest["dense"]["version"] == 1
    assert channel.pull(replica) == 1 and replica.digest() == sender.digest()


def test_manifest_history_is_pruned(tmp_path):
    _, channel = _published(tmp_path, 4, keep_manifests=2)
    keys = channel._history_keys()
    assert len(keys) == 2 and keys[-1].startswith(b"manifests/000000000005-")
