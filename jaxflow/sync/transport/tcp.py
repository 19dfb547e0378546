"""TCP transport: a ReplicaServer holds a Replica; a TcpLink on the trainer syncs it.

Frames are ``kind (4 bytes) | length (u64 LE) | body``. One sync is one connection::

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

    python -m jaxflow.sync.transport.tcp --template=params.pkl --port-file=port.txt
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import socket
import struct
import sys
import threading
from typing import Callable, Mapping

from jaxflow.sync import payload as payload_format
from jaxflow.sync.diff import tree_layout
from jaxflow.sync.payload import PayloadError
from jaxflow.sync.replica import FRESH, Replica

HEADER = struct.Struct("<4sQ")
CHUNK_BYTES = 1 << 20
CONTROL_BYTES = 1 << 20  # VERQ / VERS / ACK / ERR bodies (small JSON)
_ERROR_CHARS = 1 << 14  # an ERR frame carries at most this much of the error message
KINDS = (b"VERQ", b"VERS", b"DATA", b"ACK ", b"ERR ")


class FrameError(ConnectionError):
    """A malformed or truncated frame."""


def send_frame(sock: socket.socket, kind: bytes, body: bytes | bytearray | memoryview = b"",
               *, chunk_bytes: int = CHUNK_BYTES) -> None:
    view = memoryview(body).cast("B")
    sock.sendall(HEADER.pack(kind, view.nbytes))
    for start in range(0, view.nbytes, chunk_bytes):
        sock.sendall(view[start: start + chunk_bytes])


def _recv_exact(sock: socket.socket, view: memoryview, chunk_bytes: int) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got: got + chunk_bytes])
        if n == 0:
            raise FrameError(f"connection closed after {got} of {view.nbytes} bytes")
        got += n


def recv_frame(sock: socket.socket, *, max_bytes: int | Mapping[bytes, int] = CONTROL_BYTES,
               chunk_bytes: int = CHUNK_BYTES) -> tuple[bytes, bytearray]:
    """Reads one frame. ``max_bytes``: the largest body accepted, or a per-kind mapping
    (kinds missing from it get ``CONTROL_BYTES``); checked before the body is allocated."""
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head), HEADER.size)
    kind, length = HEADER.unpack(head)
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}; valid: {KINDS}")
    limit = max_bytes.get(kind, CONTROL_BYTES) if isinstance(max_bytes, Mapping) else max_bytes
    if length > limit:
        what = "max_payload_bytes" if kind == b"DATA" else f"the {kind.decode().strip()} limit"
        raise FrameError(f"{kind.decode().strip()} frame of {length} bytes exceeds {what}="
                         f"{limit}")
    body = bytearray(length)
    _recv_exact(sock, memoryview(body), chunk_bytes)
    return kind, body


def _json(body) -> dict:
    return json.loads(bytes(body).decode())


class ReplicaServer:
    """Serves one Replica on ``host:port`` (port 0: any free port). ``start()`` runs it on a
    daemon thread; every connection gets its own thread (at most ``max_connections`` at a
    time), and replica updates are serialised by a lock.

    Args:
      max_payload_bytes: the largest DATA frame accepted; default: ``max_payload_bytes`` of
        the replica's tree (its size + the header bound), so a frame announcing more is
        refused before anything is allocated.
    """

    def __init__(self, replica: Replica, *, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 30.0, max_payload_bytes: int | None = None,
                 max_connections: int = 8):
        if max_payload_bytes is None:
            treedef, _, specs = tree_layout(replica.params)
            max_payload_bytes = payload_format.max_payload_bytes(treedef, specs)
        self.replica, self.timeout_s, self.max_payload_bytes = replica, timeout_s, max_payload_bytes
        self._limits = {b"DATA": int(max_payload_bytes)}
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self.errors: list[str] = []

    def start(self) -> "ReplicaServer":
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue  # every slot busy: leave new peers in the accept backlog
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                self._slots.release()
                continue
            except OSError:
                self._slots.release()
                return
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.timeout_s)
                try:
                    self._handle(conn)
                except Exception as e:  # noqa: BLE001 -- one peer's failure ends only its link
                    self.errors.append(repr(e))  # recorded before the connection closes
        finally:
            self._slots.release()

    def _status(self) -> bytes:
        return json.dumps({"version": self.replica.version,
                           "digest": self.replica.digest()}).encode()

    def _handle(self, conn: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                kind, body = recv_frame(conn, max_bytes=self._limits)
            except FrameError as e:
                if "after 0 of" in str(e):
                    return  # clean close between frames
                raise
            if kind == b"VERQ":
                with self._lock:
                    status = self._status()
                send_frame(conn, b"VERS", status)
            elif kind == b"DATA":
                with self._lock:
                    try:
                        self.replica.receive(body)
                        reply, status = b"ACK ", self._status()
                    except PayloadError as e:
                        reply, status = b"ERR ", json.dumps(
                            {"error": str(e)[:_ERROR_CHARS], "version": self.replica.version}).encode()
                del body
                send_frame(conn, reply, status)
            else:
                raise FrameError(f"unexpected frame {kind!r} from the sender")


class TcpLink:
    """The trainer's side of one ReplicaServer."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 30.0,
                 chunk_bytes: int = CHUNK_BYTES):
        self.address, self.timeout_s, self.chunk_bytes = (host, int(port)), timeout_s, chunk_bytes

    def _connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=self.timeout_s)

    def _ask(self, sock) -> tuple[int, str]:
        send_frame(sock, b"VERQ")
        kind, body = recv_frame(sock)
        if kind != b"VERS":
            raise FrameError(f"expected VERS, got {kind!r}")
        status = _json(body)
        return int(status["version"]), str(status["digest"])

    def status(self) -> tuple[int, str]:
        with self._connect() as sock:
            return self._ask(sock)

    def sync(self, plan: Callable[[int], list[bytes]]) -> tuple[int, str]:
        with self._connect() as sock:
            version, digest = self._ask(sock)
            for data in plan(version):
                send_frame(sock, b"DATA", data, chunk_bytes=self.chunk_bytes)
                kind, body = recv_frame(sock)
                reply = _json(body)
                if kind == b"ERR ":
                    raise PayloadError(f"replica {self.address} rejected a payload (still at "
                                       f"version {reply['version']}): {reply['error']}")
                if kind != b"ACK ":
                    raise FrameError(f"expected ACK, got {kind!r}")
                version, digest = int(reply["version"]), str(reply["digest"])
            return version, digest


def main(argv=None) -> None:
    """Runs a replica server process: loads a template tree (pickle of numpy leaves, written
    by the trainer), starts FRESH (a dense resync brings it up), prints its port."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--template", required=True)
    p.add_argument("--port-file", required=True)
    p.add_argument("--timeout-s", type=float, default=30.0)
    args = p.parse_args(argv)
    template = pickle.loads(pathlib.Path(args.template).read_bytes())
    server = ReplicaServer(Replica(template, version=FRESH), timeout_s=args.timeout_s)
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
