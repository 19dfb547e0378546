"""TCP transport: a ReplicaServer holds a Replica; a TcpLink on the trainer syncs it.

Frames are ``kind (4 bytes) | length (u64 LE) | body | MAC`` (``jaxflow.sync.transport.frames``:
a hello each way first, then every frame carries an HMAC of the job's secret over the two
nonces, the link's session, the direction, the sequence number and the frame; a peer without
the secret is answered DENY and dropped before anything it sent is parsed, and its first frame
may not exceed ``CONTROL_BYTES``). One sync is one connection::

    link -> server   HELO <nonce, session>      server -> link  HELO <nonce>
    link -> server   VERQ                       server -> link  VERS {"version", "digest"}
    link -> server   DATA <payload>  (repeat)   server -> link  ACK  {"version", "digest"}
                                                          or    ERR  {"error", "version"}

Payload bodies are written as memoryview slices of ``chunk_bytes`` (no whole-payload copies)
and read with ``recv_into`` into one buffer of the announced size. The server refuses, before
allocating anything, a DATA frame above what its replica can expect (``max_payload_bytes``:
by default ``payload.max_payload_bytes`` of the replica's tree, i.e. tree size + header bound)
and any other frame above ``CONTROL_BYTES``; every socket operation has a timeout. Each
connection is served on its own thread (replica updates serialised by a lock), and whatever
one peer sends (a bad frame, a stall, an exception) ends only that peer's connection. A
connection that dies mid-DATA leaves the replica untouched (nothing is applied before the
whole payload arrived and its checksum verified).

Versions are bound to the session that wrote them (a link's random session id): a payload from
another session is applied only when it is newer than the replica (``exclusive=True``, as the
rollout job runs it: only from the session its control socket bound with ``bind``).

Slow or silent peers cannot hold the server's slots (``jaxflow.sync.transport.tcp_guard``):
a frame must be complete within ``frame_deadline_s`` of its first byte (plus its length at
``min_bytes_per_s``), a connection must start its next frame within ``idle_timeout_s``, and
when every slot is busy a new peer evicts the quietest connection (one that never completed a
frame first, then the longest quiet), so a real sync gets through. On the trainer's side a
reply that is not the expected JSON object is a :class:`FrameError` naming the replica and
what is wrong with the reply, so ``SyncSender.sync_all`` reports that link and goes on.

    python -m jaxflow.sync.transport.tcp --template=params.pkl --port-file=port.txt
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import select
import socket
import sys
import threading
import time
from typing import Callable, Mapping

from jaxflow import job_auth
from jaxflow.job_auth import TAG_BYTES, AuthError, FrameMac
from jaxflow.sync import payload as payload_format
from jaxflow.sync.diff import tree_layout
from jaxflow.sync.payload import Payload, PayloadError
from jaxflow.sync.replica import FRESH, Replica
from jaxflow.sync.transport import frames, tcp_guard
from jaxflow.sync.transport.frames import CHUNK_BYTES, CONTROL_BYTES, HEADER, HELLO, HELLO_BYTES, Channel, FrameError
from jaxflow.sync.transport.tcp_guard import DeadlineError, Peer, PeerTable

KINDS = (b"VERQ", b"VERS", b"DATA", b"ACK ", b"ERR ")
_ERROR_CHARS = 1 << 14  # an ERR frame carries at most this much of the error message


def send_frame(sock: socket.socket, kind: bytes, body: bytes | bytearray | memoryview = b"",
               *, chunk_bytes: int = CHUNK_BYTES, mac: FrameMac | None = None) -> None:
    """One frame (``frames.send_frame``)."""
    frames.send_frame(sock, kind, body, chunk_bytes=chunk_bytes, mac=mac)


def recv_frame(sock: socket.socket, *, max_bytes: int | Mapping[bytes, int] = CONTROL_BYTES,
               chunk_bytes: int = CHUNK_BYTES, kinds: tuple[bytes, ...] = KINDS,
               mac: FrameMac | None = None) -> tuple[bytes, bytearray]:
    """Reads one frame of ``kinds`` (``frames.recv_frame``; default: the sync protocol's)."""
    return frames.recv_frame(sock, max_bytes=max_bytes, chunk_bytes=chunk_bytes, kinds=kinds,
                             mac=mac)


def parse_header(head: bytes | bytearray, max_bytes: int | Mapping[bytes, int],
                 kinds: tuple[bytes, ...] = KINDS) -> tuple[bytes, int]:
    """(kind, body length) of a frame header (``frames.parse_header``)."""
    return frames.parse_header(head, max_bytes, kinds)


_REPLY_FIELDS = {b"VERS": ("version", "digest"), b"ACK ": ("version", "digest"),
                 b"ERR ": ("version", "error")}


def parse_reply(kind: bytes, body, replica: str) -> dict:
    """The JSON object of a VERS / ACK / ERR reply from ``replica`` (a name for messages),
    checked: ``version`` an int, ``digest`` / ``error`` a string.

    Raises:
      FrameError: one line naming the replica, the reply kind, a short excerpt of the body and
        what is wrong (not UTF-8 JSON, not an object, a field missing or of the wrong type).
    """
    fields = _REPLY_FIELDS[kind]
    valid = "valid: a JSON object {" + ", ".join(
        f'"{f}": {"int" if f == "version" else "str"}' for f in fields) + "}"

    def bad(problem: str) -> FrameError:
        return FrameError(f"replica {replica} sent a malformed {kind.decode().strip()} reply "
                          f"{bytes(body[:80])!r}: {problem}; {valid}")

    try:
        reply = json.loads(bytes(body).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(reply, dict):
        raise bad(f"a JSON {type(reply).__name__}, not an object")
    for field in fields:
        if field not in reply:
            raise bad(f"no {field!r}")
        value, want = reply[field], (int if field == "version" else str)
        if isinstance(value, bool) or not isinstance(value, want):
            raise bad(f"{field} {value!r} is not {'an int' if want is int else 'a string'}")
    return reply


class ReplicaServer:
    """Serves one Replica on ``host:port`` (port 0: any free port). ``start()`` runs it on a
    daemon thread; every connection gets its own thread (at most ``max_connections`` at a
    time), and replica updates are serialised by a lock.

    Args:
      timeout_s: the limit on each socket operation inside a frame and on each reply sent.
      max_payload_bytes: the largest DATA frame accepted; default: ``max_payload_bytes`` of
        the replica's tree (its size + the header bound), so a frame announcing more is
        refused before anything is allocated.
      max_connections: connections served at once; when all are taken, a new peer evicts a
        slow one (``tcp_guard.PeerTable``) or waits in the accept backlog.
      idle_timeout_s: a connection whose next frame has not started this many seconds after
        it was accepted or after the previous reply is closed (default 30 s).
      frame_deadline_s: a frame (header and body) must be complete this many seconds after
        its first byte, plus ``length / min_bytes_per_s`` for its body, else the connection
        is closed (default 30 s), so a peer trickling bytes cannot hold a slot.
      min_bytes_per_s: the slowest transfer the body allowance and eviction accept (default
        1 MiB/s).
      secret: the job secret (default: ``jaxflow.job_auth.job_secret(host)``; a non-loopback
        ``host`` without one is refused with an AuthError).
      exclusive: payloads only from the session given to :meth:`bind` (the rollout job's
        trainer); otherwise the first session binds and another one may only move the replica
        to a newer version.

    ``errors`` lists, as ``repr`` strings, why each dropped connection ended (a
    ``tcp_guard.DeadlineError`` for a slow, silent or evicted peer, an AuthError for a peer
    without the secret).
    """

    def __init__(self, replica: Replica, *, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 30.0, max_payload_bytes: int | None = None,
                 max_connections: int = 8, idle_timeout_s: float = tcp_guard.IDLE_TIMEOUT_S,
                 frame_deadline_s: float = tcp_guard.FRAME_DEADLINE_S,
                 min_bytes_per_s: float = tcp_guard.MIN_BYTES_PER_S, secret: bytes | None = None,
                 exclusive: bool = False):
        tcp_guard.check_deadlines(idle_timeout_s, frame_deadline_s, min_bytes_per_s)
        self._secret = job_auth.job_secret(host, secret)  # before anything listens
        if max_payload_bytes is None:
            treedef, _, specs = tree_layout(replica.params)
            max_payload_bytes = payload_format.max_payload_bytes(treedef, specs)
        self.replica, self.timeout_s, self.max_payload_bytes = replica, timeout_s, max_payload_bytes
        self.idle_timeout_s, self.frame_deadline_s = idle_timeout_s, frame_deadline_s
        self.min_bytes_per_s, self.exclusive = min_bytes_per_s, exclusive
        self.owner: bytes | None = None  # the session the replica's version is bound to
        self._limits = {b"DATA": int(max_payload_bytes)}
        self._peers = PeerTable(max_connections, min_bytes_per_s=min_bytes_per_s)
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.errors: list[str] = []

    @property
    def lock(self) -> threading.Lock:
        """Held while the replica is read or updated (hold it to read or swap ``replica``)."""
        return self._lock

    @property
    def open_connections(self) -> int:
        """Connections being served now."""
        return len(self._peers)

    def bind(self, session: bytes | None) -> None:
        """Binds the replica's versions to ``session`` (call under ``lock``)."""
        self.owner = session

    def start(self) -> "ReplicaServer":
        """Serve on a daemon thread; returns the server."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: join the thread, close the socket and every peer connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()
        self._peers.close_all()

    def serve_forever(self) -> None:
        """Accept and serve peers until ``stop`` (blocks)."""
        while not self._stop.is_set():
            try:
                pending, _, _ = select.select([self._sock], [], [], 0.2)
            except (OSError, ValueError):
                return  # the listening socket was closed
            if not pending or not self._peers.make_room(timeout=0.2):
                continue  # every slot busy with fast peers: leave the new one in the backlog
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, socket.timeout):
                continue
            except OSError:
                return
            peer = Peer(conn, timeout_s=self.timeout_s)
            self._peers.add(peer)
            threading.Thread(target=self._serve_connection, args=(peer,), daemon=True).start()

    def _serve_connection(self, peer: Peer) -> None:
        try:
            with peer.conn:
                try:
                    self._handle(peer)
                except Exception as e:  # noqa: BLE001 -- one peer's failure ends only its link
                    self.errors.append(repr(e))  # recorded before the connection closes
        finally:
            self._peers.remove(peer)

    def _status(self) -> bytes:
        return json.dumps({"version": self.replica.version,
                           "digest": self.replica.digest()}).encode()

    def _recv(self, peer: Peer, limits: int | Mapping[bytes, int], kinds: tuple[bytes, ...],
              mac: FrameMac | None) -> tuple[bytes, bytearray] | None:
        """One frame (and its MAC, verified) within the idle limit and the frame deadline;
        None on a clean close between frames; AuthError (after a DENY) for a bad MAC."""
        head = memoryview(bytearray(HEADER.size))
        got = peer.recv_into(head, peer.quiet_since + self.idle_timeout_s, lambda: (
            f"idle connection: no frame within idle_timeout_s={self.idle_timeout_s:g}"),
            within_frame=False)
        if got == 0:
            return None
        first_byte = time.monotonic()
        deadline, allowance = first_byte + self.frame_deadline_s, ""

        def late(total: int) -> Callable[[], str]:
            return lambda: (f"frame not complete {time.monotonic() - first_byte:.2f}s after its "
                            f"first byte: {got} of {total} bytes, deadline frame_deadline_s="
                            f"{self.frame_deadline_s:g}{allowance}")

        def fill(view: memoryview) -> None:
            nonlocal got
            while got < view.nbytes:
                n = peer.recv_into(view[got: got + CHUNK_BYTES], deadline, late(view.nbytes))
                if n == 0:
                    raise FrameError(f"connection closed after {got} of {view.nbytes} bytes")
                got += n

        fill(head)
        kind, length = parse_header(head, limits, kinds)
        deadline += length / self.min_bytes_per_s
        allowance = f" + {length} body bytes at min_bytes_per_s={self.min_bytes_per_s:.0f}"
        body = bytearray(length)
        got = 0
        fill(memoryview(body))
        if mac is not None:
            tag, got = bytearray(TAG_BYTES), 0
            fill(memoryview(tag))
            if not mac.verify(bytes(head), body, tag):
                frames.deny(peer.conn)
                raise AuthError(f"peer {job_auth.peer_name(peer.conn)}: {kind.decode().strip()} "
                                "frame dropped unread, its MAC does not match this job's secret")
        return kind, body

    def _hello(self, peer: Peer) -> FrameMac | None:
        """The server side of the hello; the connection's MACs (None: closed before it)."""
        frame = self._recv(peer, HELLO_BYTES, (HELLO,), None)
        if frame is None:
            return None
        client_nonce, session = job_auth.parse_client_hello(frame[1])
        nonce, hello = job_auth.server_hello()
        peer.conn.settimeout(self.timeout_s)
        send_frame(peer.conn, HELLO, hello)
        self._peers.done_serving(peer)
        return FrameMac(self._secret, client_nonce, nonce, session, client=False)

    def _refusal(self, payload: Payload, session: bytes) -> str | None:
        """Why a verified payload from ``session`` may not be applied (None: it may)."""
        if self.exclusive and session != self.owner:
            return (f"payload from session {session.hex()[:8]} refused: the replica takes "
                    f"payloads only from the trainer session its control socket bound "
                    f"({self.owner.hex()[:8] if self.owner else 'none yet'})")
        if self.owner not in (None, session) and payload.version <= self.replica.version:
            return (f"payload version {payload.version} from session {session.hex()[:8]} is "
                    f"not newer than the replica's version {self.replica.version} written by "
                    f"session {self.owner.hex()[:8]}: refused (versions are bound to their session)")
        return None

    def _data(self, body: bytearray, session: bytes) -> tuple[bytes, bytes]:
        with self._lock:
            try:
                if self.exclusive or self.owner not in (None, session):
                    refusal = self._refusal(Payload.from_bytes(body), session)
                    if refusal is not None:
                        raise PayloadError(refusal)
                self.replica.receive(body)
                self.owner = session
                return b"ACK ", self._status()
            except PayloadError as e:
                return b"ERR ", json.dumps({"error": str(e)[:_ERROR_CHARS],
                                            "version": self.replica.version}).encode()

    def _handle(self, peer: Peer) -> None:
        conn = peer.conn
        mac = self._hello(peer)
        authenticated = False
        while mac is not None and not self._stop.is_set():
            # until one frame verified, a frame may not exceed CONTROL_BYTES: a peer without
            # the secret cannot make the server allocate a payload-sized buffer
            frame = self._recv(peer, self._limits if authenticated else CONTROL_BYTES, KINDS, mac)
            if frame is None:
                return  # clean close between frames
            authenticated, (kind, body) = True, frame
            self._peers.start_serving(peer)
            conn.settimeout(self.timeout_s)
            if kind == b"VERQ":
                with self._lock:
                    status = self._status()
                send_frame(conn, b"VERS", status, mac=mac)
            elif kind == b"DATA":
                reply, status = self._data(body, mac.session)
                del body
                send_frame(conn, reply, status, mac=mac)
            else:
                raise FrameError(f"unexpected frame {kind!r} from the sender")
            self._peers.done_serving(peer)


class TcpLink:
    """The trainer's side of one ReplicaServer. A reply that is not what the protocol says
    (not JSON, not an object, a version that is not an int, no digest) is a FrameError naming
    this replica and the problem: it ends this sync only.

    ``secret``: the job secret (default ``job_auth.job_secret(host)``); ``session``: the
    session id every connection of this link presents (default: a new random one), to which
    the replica binds the versions this link writes."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 30.0,
                 chunk_bytes: int = CHUNK_BYTES, secret: bytes | None = None,
                 session: bytes | None = None):
        self.address, self.timeout_s, self.chunk_bytes = (host, int(port)), timeout_s, chunk_bytes
        self._secret = job_auth.job_secret(host, secret)
        self.session = session or job_auth.new_session()

    @property
    def name(self) -> str:
        """``host:port`` of the replica."""
        return f"{self.address[0]}:{self.address[1]}"

    def _connect(self) -> Channel:
        return Channel.connect(self.address, kinds=KINDS, timeout_s=self.timeout_s,
                               secret=self._secret, session=self.session)

    def _ask(self, channel: Channel) -> tuple[int, str]:
        channel.send(b"VERQ")
        kind, body = channel.recv()
        if kind != b"VERS":
            raise FrameError(f"replica {self.name}: expected VERS, got {kind!r}")
        status = parse_reply(kind, body, self.name)
        return status["version"], status["digest"]

    def status(self) -> tuple[int, str]:
        """Ask the replica for its (version, digest)."""
        with self._connect() as channel:
            return self._ask(channel)

    def sync(self, plan: Callable[[int], list[bytes]]) -> tuple[int, str]:
        """Send ``plan(replica version)``'s payloads, each acknowledged; returns the new (version, digest)."""
        with self._connect() as channel:
            version, digest = self._ask(channel)
            for data in plan(version):
                channel.send(b"DATA", data, chunk_bytes=self.chunk_bytes)
                kind, body = channel.recv()
                if kind not in (b"ACK ", b"ERR "):
                    raise FrameError(f"replica {self.name}: expected ACK, got {kind!r}")
                reply = parse_reply(kind, body, self.name)
                if kind == b"ERR ":
                    raise PayloadError(f"replica {self.address} rejected a payload (still at "
                                       f"version {reply['version']}): {reply['error']}")
                version, digest = reply["version"], reply["digest"]
            return version, digest


__all__ = ["CHUNK_BYTES", "CONTROL_BYTES", "HEADER", "KINDS", "AuthError", "Channel",
           "DeadlineError", "FrameError", "ReplicaServer", "TcpLink", "parse_header", "parse_reply",
           "recv_frame", "send_frame"]


def main(argv=None) -> None:
    """Runs a replica server process: loads a template tree (pickle of numpy leaves, written
    by the trainer), starts FRESH (a dense resync brings it up), prints its port."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--template", required=True)
    p.add_argument("--port-file", required=True)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--idle-timeout-s", type=float, default=tcp_guard.IDLE_TIMEOUT_S)
    p.add_argument("--frame-deadline-s", type=float, default=tcp_guard.FRAME_DEADLINE_S)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--secret-file", help="the job secret (default: JAXFLOW_JOB_SECRET[_FILE], "
                   "or this user's host secret on a loopback --host)")
    args = p.parse_args(argv)
    try:
        secret = job_auth.read_secret_file(args.secret_file) if args.secret_file else None
        secret = job_auth.job_secret(args.host, secret)
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    template = pickle.loads(pathlib.Path(args.template).read_bytes())
    server = ReplicaServer(Replica(template, version=FRESH), host=args.host, secret=secret,
                           timeout_s=args.timeout_s,
                           idle_timeout_s=args.idle_timeout_s,
                           frame_deadline_s=args.frame_deadline_s)
    tmp = pathlib.Path(args.port_file + ".tmp")
    tmp.write_text(str(server.address[1]))
    tmp.rename(args.port_file)  # the parent never reads a half-written port
    print(f"replica serving on {server.address}", flush=True)
    try:
        server.serve_forever()  # ends when the parent kills the process
    finally:
        for e in server.errors:
            print(f"dropped connection: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
