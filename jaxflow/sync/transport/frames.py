"""Frames of jaxflow's TCP sockets and the authenticated channel built on them.

A frame is ``kind (4 bytes) | length (u64 LE) | body``; on an authenticated connection the
body is followed by a ``TAG_BYTES`` MAC (:class:`jaxflow.job_auth.FrameMac`). A connection
starts with ``HELO`` each way (client: nonce and session, server: its nonce); a server that
rejects a peer answers one unauthenticated ``DENY`` frame with the reason and hangs up.
:class:`Channel` is the blocking client side (and a simple server side for tests and small
servers); :class:`jaxflow.sync.transport.tcp.ReplicaServer` runs the server side under its own
deadlines.
"""

from __future__ import annotations

import socket
import struct
from typing import Mapping

from jaxflow import job_auth
from jaxflow.job_auth import TAG_BYTES, AuthError, FrameMac

HEADER = struct.Struct("<4sQ")
CHUNK_BYTES = 1 << 20
CONTROL_BYTES = 1 << 20  # control bodies (small JSON)
HELLO = b"HELO"
DENY = b"DENY"
HELLO_BYTES = 64  # the largest hello body read
#: what a server tells a peer whose first frame does not verify
DENIED = ("authentication failed: the frame's MAC does not match this job's secret; valid: the "
          "same --secret-file / JAXFLOW_JOB_SECRET on both ends")


class FrameError(ConnectionError):
    """A malformed or truncated frame."""


def send_frame(sock: socket.socket, kind: bytes, body: bytes | bytearray | memoryview = b"",
               *, chunk_bytes: int = CHUNK_BYTES, mac: FrameMac | None = None) -> None:
    """Writes one frame (with its MAC when ``mac`` is given), ``chunk_bytes`` at a time."""
    view = memoryview(body).cast("B")
    header = HEADER.pack(kind, view.nbytes)
    sock.sendall(header)
    for start in range(0, view.nbytes, chunk_bytes):
        sock.sendall(view[start: start + chunk_bytes])
    if mac is not None:
        sock.sendall(mac.tag(header, view))


def recv_exact(sock: socket.socket, view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Fills ``view`` from ``sock``; FrameError when the peer closes first."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got: got + chunk_bytes])
        if n == 0:
            raise FrameError(f"connection closed after {got} of {view.nbytes} bytes")
        got += n


def parse_header(head: bytes | bytearray, max_bytes: int | Mapping[bytes, int],
                 kinds: tuple[bytes, ...]) -> tuple[bytes, int]:
    """(kind, body length) of a frame header; FrameError for a kind not in ``kinds`` or a body
    above ``max_bytes`` (an int, or per kind with ``CONTROL_BYTES`` for kinds not in it)."""
    kind, length = HEADER.unpack(head)
    if kind not in kinds:
        raise FrameError(f"unknown frame kind {kind!r}; valid: {kinds}")
    limit = max_bytes.get(kind, CONTROL_BYTES) if isinstance(max_bytes, Mapping) else max_bytes
    if length > limit:
        what = "max_payload_bytes" if kind == b"DATA" else f"the {kind.decode().strip()} limit"
        raise FrameError(f"{kind.decode().strip()} frame of {length} bytes exceeds {what}="
                         f"{limit}")
    return kind, length


def recv_frame(sock: socket.socket, *, max_bytes: int | Mapping[bytes, int] = CONTROL_BYTES,
               kinds: tuple[bytes, ...], chunk_bytes: int = CHUNK_BYTES,
               mac: FrameMac | None = None, peer: str = "peer") -> tuple[bytes, bytearray]:
    """Reads one frame (limits checked before the body is allocated). With ``mac`` the tag is
    read and verified before the body is returned: AuthError naming ``peer`` otherwise; a
    ``DENY`` frame (the server refused us) is an AuthError with the server's reason."""
    head = bytearray(HEADER.size)
    recv_exact(sock, memoryview(head), HEADER.size)
    kind, length = parse_header(head, max_bytes, kinds + (DENY,))
    body = bytearray(length)
    recv_exact(sock, memoryview(body), chunk_bytes)
    if kind == DENY:
        raise AuthError(f"{peer} refused this connection: "
                        f"{bytes(body[:400]).decode('utf-8', 'replace')}")
    if mac is not None:
        tag = bytearray(TAG_BYTES)
        recv_exact(sock, memoryview(tag), TAG_BYTES)
        if not mac.verify(bytes(head), body, tag):
            raise AuthError(f"{peer} sent a frame whose MAC does not match this job's secret "
                            "(a different --secret-file / JAXFLOW_JOB_SECRET, or not a jaxflow "
                            "job)")
    return kind, body


def deny(sock: socket.socket, reason: str = DENIED) -> None:
    """Tells a peer why it is refused (one unauthenticated frame; errors ignored)."""
    try:
        send_frame(sock, DENY, reason.encode()[:1000])
    except OSError:
        pass


class Channel:
    """An authenticated connection: ``send(kind, body)`` and ``recv(...)`` with MACs.

    ``Channel.connect`` is the client side (``session``: the client's session id, bound into
    every MAC); ``Channel.accept`` the blocking server side of an accepted socket."""

    def __init__(self, sock: socket.socket, mac: FrameMac, kinds: tuple[bytes, ...], peer: str):
        self.sock, self.mac, self.kinds, self.peer = sock, mac, kinds, peer

    @property
    def session(self) -> bytes:
        """The client's session id."""
        return self.mac.session

    @classmethod
    def connect(cls, address: tuple[str, int], *, kinds: tuple[bytes, ...], timeout_s: float,
                secret: bytes | None = None, session: bytes | None = None) -> "Channel":
        """Connects and says hello; AuthError when no secret is available for ``address`` or
        the server refuses us, OSError when it is unreachable."""
        key = job_auth.job_secret(address[0], secret)
        session = session or job_auth.new_session()
        peer = f"{address[0]}:{address[1]}"
        sock = socket.create_connection(address, timeout=timeout_s)
        try:
            nonce, hello = job_auth.client_hello(session)
            send_frame(sock, HELLO, hello)
            _, body = recv_frame(sock, max_bytes=HELLO_BYTES, kinds=(HELLO,), peer=peer)
            server_nonce = job_auth.parse_server_hello(body, peer)
        except BaseException:
            sock.close()
            raise
        return cls(sock, FrameMac(key, nonce, server_nonce, session, client=True), kinds, peer)

    @classmethod
    def accept(cls, sock: socket.socket, *, kinds: tuple[bytes, ...],
               secret: bytes | None = None) -> "Channel":
        """The server side of the hello on an accepted ``sock`` (the socket's own timeout
        applies). The first frame after it is verified by the caller's first ``recv``."""
        key = job_auth.job_secret(sock.getsockname()[0], secret)
        _, body = recv_frame(sock, max_bytes=HELLO_BYTES, kinds=(HELLO,))
        client_nonce, session = job_auth.parse_client_hello(body)
        nonce, hello = job_auth.server_hello()
        send_frame(sock, HELLO, hello)
        return cls(sock, FrameMac(key, client_nonce, nonce, session, client=False), kinds,
                   job_auth.peer_name(sock))

    def send(self, kind: bytes, body: bytes | bytearray | memoryview = b"", *,
             chunk_bytes: int = CHUNK_BYTES) -> None:
        """One authenticated frame."""
        send_frame(self.sock, kind, body, chunk_bytes=chunk_bytes, mac=self.mac)

    def recv(self, max_bytes: int | Mapping[bytes, int] = CONTROL_BYTES) -> tuple[bytes, bytearray]:
        """One authenticated frame of ``kinds`` (AuthError when its MAC does not verify)."""
        return recv_frame(self.sock, max_bytes=max_bytes, kinds=self.kinds, mac=self.mac,
                          peer=self.peer)

    def close(self) -> None:
        """Closes the socket."""
        self.sock.close()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CHUNK_BYTES", "CONTROL_BYTES", "DENY", "HEADER", "HELLO", "Channel", "FrameError",
           "deny", "parse_header", "recv_exact", "recv_frame", "send_frame"]
