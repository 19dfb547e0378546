"""The rollout job's control socket and the replica servers under hostile peers: only peers with
the job's secret are answered, only the trainer's session may roll, publish and stop the job,
a malformed request is an ERR reply (the job keeps serving), a silent peer stalls nobody, and
a forged payload is never applied. Each case runs in-process on 127.0.0.1 with a fake worker
(no JAX program runs)."""

import json
import socket
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow import job_auth
from jaxflow.errors import DataError
from jaxflow.rl.remote import protocol as P
from jaxflow.rl.remote.server import RolloutService
from jaxflow.sync import Replica, SyncSender, to_bf16
from jaxflow.sync.payload import FRESH, PayloadError
from jaxflow.sync.transport import ReplicaServer, TcpLink, frames
from jaxflow.sync.transport.frames import Channel

SECRET = b"k" * 32
KEY = [0, 7]
PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


class FakeWorker:
    """What RolloutService needs from a RolloutWorker; ``generate`` returns zeros (2 per prompt)
    and refuses prompts longer than 8 characters as the tokenizer would."""

    def __init__(self):
        self.spec = SimpleNamespace(sampler="engine", group_size=2)
        self.fns = SimpleNamespace(abstract_params=lambda: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), PARAMS))
        self.param_shardings = None
        self.prompts_seen = []

    def generate(self, params, prompts, key, *, version=-1, replica=None):
        for p in prompts:
            if len(p) > 8:
                raise DataError(f"prompt {p[:20]!r} is {len(p)} tokens; valid: at most 8")
        self.prompts_seen.append(list(prompts))
        rows = 2 * len(prompts)
        return (np.zeros((rows, 9), np.int32), np.zeros(rows, np.int32),
                np.zeros((rows, 3), np.int32), np.zeros((rows, 3), np.float32),
                np.zeros((rows, 3), np.float32), np.zeros(rows, np.float32),
                np.zeros((rows, 3), np.int32))


@pytest.fixture
def service():
    svc = RolloutService(FakeWorker(), timeout_s=60, start_timeout_s=60, log=lambda m: None,
                         secret=SECRET, max_connections=3, handshake_timeout_s=0.6)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.serve()), daemon=True)
    thread.start()
    yield svc, thread, result
    svc._stop.set()
    svc.replica_server.stop()
    svc._sock.close()


def connect(svc, secret=SECRET, session=None):
    return Channel.connect(svc.address, kinds=P.KINDS, timeout_s=5, secret=secret,
                           session=session)


def ask(ch, kind, obj=None):
    ch.send(kind, b"" if obj is None else json.dumps(obj).encode())
    k, body = ch.recv(1 << 24)
    return k, (json.loads(body) if k != b"BTCH" else body)


def trainer(svc):
    """A trainer session: RSET, a full sync of PARAMS at version 0; returns (channel, digest)."""
    ch = connect(svc)
    assert ask(ch, b"RSET", {"origin": "o", "version": 0})[0] == b"OK  "
    sender = SyncSender(to_bf16(PARAMS), version=0)
    link = TcpLink(*svc.replica_server.address, timeout_s=5, secret=SECRET, session=ch.session)
    assert sender.sync(link) == (0, sender.digest())
    return ch, sender.digest()


def closed_without_answer(sock):
    sock.settimeout(5)
    try:
        data = sock.recv(1 << 16)
    except ConnectionResetError:
        return True
    return data == b"" or data.startswith(frames.HEADER.pack(frames.DENY, 0)[:4])


def test_no_secret_no_answer(service):
    svc, thread, _ = service
    with socket.create_connection(svc.address, timeout=5) as raw:  # a bare STAT
        raw.sendall(frames.HEADER.pack(b"STAT", 0))
        assert closed_without_answer(raw)
    with pytest.raises(job_auth.AuthError, match="refused this connection: authentication failed"):
        ask(connect(svc, secret=b"w" * 32), b"STAT")  # the wrong secret: DENY, no status
    for kind in (b"DONE", b"RSET"):  # nor can it stop or reset the job
        with pytest.raises(job_auth.AuthError):
            ask(connect(svc, secret=b"w" * 32), kind, {"origin": "x", "version": 0})
    assert thread.is_alive() and svc.trainer is None
    ch, digest = trainer(svc)
    assert ask(ch, b"STAT")[1]["digest"] == digest


def test_frames_cannot_be_replayed_or_moved(service):
    svc, thread, _ = service
    ch = connect(svc)
    sent = []
    real = ch.sock.sendall
    ch.sock = SimpleNamespace(sendall=lambda b: (sent.append(bytes(b)), real(b)),
                              recv_into=ch.sock.recv_into, close=ch.sock.close)
    assert ask(ch, b"STAT")[0] == b"OK  "
    frame = b"".join(sent)
    real(frame)  # the same frame again on its connection: the sequence number differs
    with pytest.raises(job_auth.AuthError, match="authentication failed"):
        ch.recv()
    other = connect(svc)  # the recorded frame on another connection: other nonces
    other.sock.sendall(frame)
    with pytest.raises(job_auth.AuthError, match="authentication failed"):
        other.recv()
    assert thread.is_alive()


@pytest.mark.parametrize("request_, problem", [
    ({"version": 0, "digest": "d", "prompts": ["ab"], "key": [[0, 1]]}, "ROLL key"),
    ({"version": 0, "digest": "d", "prompts": ["ab"], "key": [0, 2 ** 40]}, "ROLL key"),
    ({"version": 0, "digest": "d", "prompts": [3, "ab"], "key": KEY}, "ROLL prompt 3 is not a string"),
    ({"version": 0, "digest": "d", "prompts": "ab", "key": KEY}, "ROLL prompts 'ab'"),
    ({"version": True, "digest": "d", "prompts": ["ab"], "key": KEY}, "ROLL version True"),
    ({"version": 0, "digest": "d", "prompts": ["ab"]}, "lacks ['key']"),
    ({"version": 0, "prompts": ["a" * 100], "digest": "DIGEST", "key": KEY}, "is 100 tokens"),
    ({"version": 5, "prompts": ["ab"], "digest": "DIGEST", "key": KEY}, "replica is at version 0"),
    ("not json", "not JSON"),
    ([1, 2], "not a JSON object"),
])
def test_malformed_roll_is_an_error_reply_and_the_job_keeps_serving(service, request_, problem):
    svc, thread, _ = service
    ch, digest = trainer(svc)
    body = request_ if isinstance(request_, str) else json.dumps(request_).replace("DIGEST", digest)
    ch.send(b"ROLL", body.encode())
    kind, reply = ch.recv()
    assert kind == b"ERR " and problem in json.loads(reply)["error"], reply
    assert "\n" not in json.loads(reply)["error"]
    kind, batch = ask(ch, b"ROLL", {"version": 0, "digest": digest, "prompts": ["ab"], "key": KEY})
    assert kind == b"BTCH" and svc.worker.prompts_seen == [["ab"]]
    assert thread.is_alive()


def test_only_the_trainer_session_rolls_and_stops_the_job(service):
    svc, thread, result = service
    ch, digest = trainer(svc)
    other = connect(svc)  # holds the secret, another session
    for kind in (b"DONE", b"ROLL"):
        k, reply = ask(other, kind, {"version": 0, "digest": digest, "prompts": ["a"], "key": KEY})
        assert k == b"ERR " and f"{kind.decode()} refused" in reply["error"]
    assert thread.is_alive()
    assert ask(ch, b"DONE")[0] == b"OK  "
    thread.join(timeout=5)
    assert not thread.is_alive() and result["rollouts_served"] == 0


def test_silent_peers_stall_nobody_and_are_hung_up(service):
    svc, thread, _ = service
    silent = [socket.create_connection(svc.address, timeout=5) for _ in range(3)]  # every slot
    hello_only = connect(svc)  # said hello, never a frame
    t0 = time.monotonic()
    ch, digest = trainer(svc)
    assert ask(ch, b"STAT")[0] == b"OK  "
    assert time.monotonic() - t0 < 3
    for s in silent:
        assert closed_without_answer(s)
    assert closed_without_answer(hello_only.sock)
    assert any("no verified frame within 0.6 s" in e or "evicted" in e for e in svc.errors)


def test_forged_payload_from_a_peer_without_the_secret_is_never_applied():
    server = ReplicaServer(Replica(to_bf16(PARAMS)), timeout_s=5, secret=SECRET).start()
    try:
        forged = SyncSender(to_bf16(PARAMS), version=2 ** 62)
        with pytest.raises(job_auth.AuthError, match="authentication failed"):
            forged.sync(TcpLink(*server.address, timeout_s=5, secret=b"w" * 32))
        with socket.create_connection(server.address, timeout=5) as raw:  # no hello at all
            frames.send_frame(raw, b"DATA", forged.dense_payload())
            assert closed_without_answer(raw)
        assert server.replica.version == 0 and server.owner is None
        real = SyncSender(to_bf16(PARAMS), version=0)
        real.publish(jax.tree.map(lambda x: x + 1, PARAMS), version=1)
        assert real.sync(TcpLink(*server.address, timeout_s=5, secret=SECRET)) == (1, real.digest())
    finally:
        server.stop()


def test_versions_are_bound_to_the_writing_session():
    server = ReplicaServer(Replica(to_bf16(PARAMS)), timeout_s=5, secret=SECRET).start()
    try:
        a = SyncSender(to_bf16(PARAMS), version=0)
        link_a = TcpLink(*server.address, timeout_s=5, secret=SECRET)
        a.publish(jax.tree.map(lambda x: x + 1, PARAMS), version=3)
        assert a.sync(link_a) == (3, a.digest())
        b = SyncSender(jax.tree.map(lambda x: x * 0, to_bf16(PARAMS)), version=3)  # another session
        with pytest.raises(PayloadError, match="version 3 from session .* is not newer than the "
                                               "replica's version 3 written by session"):
            TcpLink(*server.address, timeout_s=5, secret=SECRET).sync(lambda v: [b.dense_payload()])
        assert server.replica.digest() == a.digest()
        a.publish(jax.tree.map(lambda x: x + 2, PARAMS), version=4)
        assert a.sync(link_a) == (4, a.digest())  # the owner goes on
    finally:
        server.stop()


def test_exclusive_replica_takes_payloads_only_from_the_bound_session():
    server = ReplicaServer(Replica(to_bf16(PARAMS), version=FRESH), timeout_s=5, secret=SECRET,
                           exclusive=True).start()
    try:
        sender = SyncSender(to_bf16(PARAMS), version=2 ** 62)
        with pytest.raises(PayloadError, match="takes payloads only from the trainer session"):
            sender.sync(TcpLink(*server.address, timeout_s=5, secret=SECRET))
        assert server.replica.version == FRESH
    finally:
        server.stop()


def test_a_trainer_with_another_secret_fails_at_once_with_one_line(service):
    from jaxflow.rl.remote.client import RemoteRollout

    svc, thread, _ = service
    trainer_side = RemoteRollout([svc.address], spec=None, task=SimpleNamespace(max_prompt_len=4),
                                 tokenizer=None, config=None, timeout_s=60, secret=b"w" * 32,
                                 log=lambda m: None)
    t0 = time.monotonic()
    with pytest.raises(job_auth.AuthError, match="refused this connection: authentication failed"):
        trainer_side._retrying("the first sync", trainer_side._connect_links)  # no 60 s retry
    assert time.monotonic() - t0 < 5 and thread.is_alive()
