"""The TCP replica server drops slow and silent peers (whole-frame deadline, idle limit, eviction
when every slot is taken) so a real sync gets through; a receiver's malformed reply ends only
its own link in ``sync_all``."""

import socket
import threading
import time

import pytest

from jaxflow.sync import Replica, SyncSender, to_bf16
from jaxflow.sync.sync_sender import SyncAllError
from jaxflow.sync.transport import InProcessLink, ReplicaServer, TcpLink, tcp
from tests.test_sync_transport import trainer_tree, trajectory

SLOTS = 8


def make_server(**deadlines):
    return ReplicaServer(Replica(to_bf16(trainer_tree())), timeout_s=5, **deadlines).start()


def wait_for(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def published_sender():
    sender = SyncSender(trainer_tree(), codec="auto")
    sender.publish(trajectory(1)[0])
    return sender


class SlowLoris(threading.Thread):
    """A raw socket that sends a VERQ header one byte every ``every`` seconds until the server
    hangs up; ``closed_after``: seconds from connect to the hang-up."""

    def __init__(self, address, every=0.2):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(address, timeout=5)
        self.every, self.sent, self.closed_after = every, 0, None

    def run(self):
        t0, header = time.monotonic(), tcp.HEADER.pack(b"VERQ", 0)
        self.sock.settimeout(self.every)
        try:
            while time.monotonic() - t0 < 10:
                self.sock.send(header[self.sent % len(header):][:1])
                self.sent += 1
                try:
                    if self.sock.recv(1) == b"":
                        break  # the server hung up
                except socket.timeout:
                    continue
        except OSError:  # reset by the server
            pass
        self.closed_after = time.monotonic() - t0
        self.sock.close()


def fill_with_slow_peers(server):
    peers = []
    for _ in range(SLOTS):
        peers.append(SlowLoris(server.address))
        peers[-1].start()
        wait_for(lambda: server.open_connections == len(peers) and peers[-1].sent > 0)
    return peers


def test_slow_loris_peers_miss_the_frame_deadline_and_a_real_sync_gets_through():
    server = make_server(frame_deadline_s=0.6)
    try:
        peers = fill_with_slow_peers(server)
        sender = published_sender()
        t0 = time.monotonic()
        assert sender.sync(TcpLink(*server.address, timeout_s=5)) == (1, sender.digest())
        assert time.monotonic() - t0 < 3  # not held up by the server's 5 s read timeout
        for p in peers:
            p.join(timeout=4)
        assert all(p.closed_after is not None and p.closed_after < 3 for p in peers)
        assert all(p.sent < 15 for p in peers)  # none lasted to finish its 12-byte header twice
        dropped = [e for e in server.errors if e.startswith("DeadlineError(")]
        assert len(dropped) == SLOTS, server.errors
        assert any("frame not complete" in e and "frame_deadline_s=0.6" in e for e in dropped)
        wait_for(lambda: server.open_connections == 0, timeout=1)
        assert server.replica.version == 1
    finally:
        server.stop()


def test_a_real_sync_evicts_a_slow_peer_when_every_slot_is_taken():
    server = make_server(frame_deadline_s=30, idle_timeout_s=30)  # deadlines out of reach
    try:
        peers = fill_with_slow_peers(server)
        sender = published_sender()
        t0 = time.monotonic()
        assert sender.sync(TcpLink(*server.address, timeout_s=5)) == (1, sender.digest())
        assert time.monotonic() - t0 < 3
        assert len(server.errors) == 1 and "evicted for a new peer" in server.errors[0]
        assert f"all {SLOTS} slots taken" in server.errors[0]
        peers[0].join(timeout=2)  # the one quiet the longest (none completed a frame)
        assert peers[0].closed_after is not None
        assert all(p.closed_after is None for p in peers[1:])
    finally:
        server.stop()
    for p in peers:  # stop() hangs up on the rest
        p.join(timeout=3)
        assert p.closed_after is not None


def silent_peers(server, n=SLOTS):
    socks, before = [], server.open_connections
    for _ in range(n):
        socks.append(socket.create_connection(server.address, timeout=5))
        wait_for(lambda: server.open_connections == before + len(socks))
    return socks


def test_silent_connections_are_closed_after_the_idle_limit():
    server = make_server(idle_timeout_s=0.5)
    socks = silent_peers(server)
    try:
        t0 = time.monotonic()
        for sock in socks:
            sock.settimeout(3)
            assert sock.recv(1) == b""  # the server hung up
        assert time.monotonic() - t0 < 2
        idle = [e for e in server.errors if "no frame within idle_timeout_s=0.5" in e]
        assert len(idle) == SLOTS, server.errors
        wait_for(lambda: server.open_connections == 0, timeout=1)
        sender = published_sender()
        assert sender.sync(TcpLink(*server.address, timeout_s=5)) == (1, sender.digest())
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_silent_connections_filling_every_slot_do_not_block_syncs():
    server = make_server(idle_timeout_s=30)
    socks = silent_peers(server)
    try:
        sender = published_sender()
        link = TcpLink(*server.address, timeout_s=5)
        assert sender.sync(link) == (1, sender.digest())
        wait_for(lambda: server.open_connections == SLOTS - 1)  # the link hung up after its sync
        socks += silent_peers(server, 1)  # every slot silent again
        sender.publish(trajectory(2)[1])
        assert sender.sync(link) == (2, sender.digest())  # a second sync evicts the next oldest
        assert sum("evicted for a new peer" in e for e in server.errors) == 2
        for sock in socks[:2]:  # the oldest two went, the rest still wait
            sock.settimeout(2)
            assert sock.recv(1) == b""
        for sock in socks[2:]:  # 6 of the first 8, and the one added
            sock.settimeout(0.05)
            with pytest.raises(socket.timeout):
                sock.recv(1)
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_deadlines_must_be_positive():
    with pytest.raises(ValueError, match="frame_deadline_s=0; valid: a number > 0"):
        ReplicaServer(Replica(to_bf16(trainer_tree())), frame_deadline_s=0)


class BadReceiver(threading.Thread):
    """Answers VERQ with ``vers`` and DATA with ``ack``, raw (a receiver gone wrong)."""

    def __init__(self, vers: bytes, ack: bytes):
        super().__init__(daemon=True)
        self.vers, self.ack = vers, ack
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.address = self.listener.getsockname()[:2]
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                try:  # authenticated (it holds the job's secret), its replies malformed
                    channel = tcp.Channel.accept(conn, kinds=tcp.KINDS)
                    while True:
                        kind, _ = channel.recv(max_bytes=1 << 26)
                        channel.send(b"VERS" if kind == b"VERQ" else b"ACK ",
                                     self.vers if kind == b"VERQ" else self.ack)
                except OSError:  # the link hung up
                    continue
        self.listener.close()


GOOD_VERS = b'{"version": 0, "digest": "d"}'


@pytest.mark.parametrize("vers, ack, problem", [
    (b'{"version": 0, "digest": ', b"", "malformed VERS reply b'{\"version\": 0, \"digest\": ': not JSON"),
    (b"[0, \"d\"]", b"", "malformed VERS reply b'[0, \"d\"]': a JSON list, not an object"),
    (b'{"version": "zero", "digest": "d"}', b"", "version 'zero' is not an int"),
    (b'{"version": 0}', b"", "malformed VERS reply b'{\"version\": 0}': no 'digest'"),
    (GOOD_VERS, b'{"version": 1}', "malformed ACK reply b'{\"version\": 1}': no 'digest'"),
])
def test_a_malformed_reply_ends_only_its_own_link(vers, ack, problem):
    servers = [make_server(), make_server()]
    bad = BadReceiver(vers, ack)
    bad.start()
    try:
        sender = published_sender()
        links = [TcpLink(*servers[0].address, timeout_s=5), TcpLink(*bad.address, timeout_s=5),
                 TcpLink(*servers[1].address, timeout_s=5)]
        report = sender.sync_all(links)
        assert [r["ok"] for r in report] == [True, False, True]
        assert [r.get("version") for r in report] == [1, None, 1]
        error = report[1]["error"]
        assert error.startswith("FrameError: replica") and "\n" not in error
        assert f"replica 127.0.0.1:{bad.address[1]} sent a " in error and problem in error
        assert "valid: a JSON object" in error
        assert all(s.replica.version == 1 and s.replica.digest() == sender.digest()
                   for s in servers)
    finally:
        bad.stopped.set()
        bad.join(timeout=2)
        for s in servers:
            s.stop()


class BrokenLink:
    """A link that breaks the Link contract (raises a KeyError, not a link failure)."""

    name = "broken-link"

    def sync(self, plan):
        raise KeyError("version")

    def status(self):
        raise KeyError("version")


def test_a_link_raising_outside_the_contract_is_raised_after_the_others_synced():
    replicas = [Replica(to_bf16(trainer_tree())) for _ in range(2)]
    sender = published_sender()
    links = [InProcessLink(replicas[0]), BrokenLink(), InProcessLink(replicas[1])]
    with pytest.raises(SyncAllError, match=r"^sync_all: link 1 \(broken-link\) raised KeyError: "
                                           r"'version'; links synced: \[0, 2\]$") as info:
        sender.sync_all(links)
    assert [r["ok"] for r in info.value.report] == [True, False, True]
    assert [r.version for r in replicas] == [1, 1]
