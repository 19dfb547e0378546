"""Deadlines and slot eviction for the TCP replica server: slow or silent peers are dropped.

A read timeout per socket operation does not stop a peer that sends one byte just before each
timeout ("slow loris"), nor peers that connect and say nothing while every server slot is
theirs. The server (``jaxflow.sync.transport.tcp.ReplicaServer``) therefore reads through a
:class:`Peer`, which enforces, per connection:

  idle_timeout_s     the next frame's first byte must arrive within this many seconds of the
                     connection's start or of the previous reply;
  frame_deadline_s   a whole frame (header and body) must arrive within this many seconds of
                     its first byte, plus ``length / min_bytes_per_s`` once the header has
                     announced the body's ``length`` (so a large payload on a slow but honest
                     link still fits, and the allowance is known before the body is read);

and a :class:`PeerTable` of at most ``max_connections`` peers: when all are taken and a new
peer is waiting, the table evicts one that is not being served (not applying a payload or
replying) and is slower than ``min_bytes_per_s`` since its last complete frame, preferring
one that never completed a frame, then the one quiet the longest. A fast transfer in progress
is never evicted; a newly accepted peer is the last choice among the idle ones.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

IDLE_TIMEOUT_S = 30.0
FRAME_DEADLINE_S = 30.0
MIN_BYTES_PER_S = float(1 << 20)  # 8 Mbit/s: slower than any trainer-to-rollout link


class DeadlineError(TimeoutError):
    """A peer too slow or too quiet: a frame not complete by its deadline, no frame within the
    idle limit, or a connection evicted to make room for a new peer."""


def check_deadlines(idle_timeout_s: float, frame_deadline_s: float,
                    min_bytes_per_s: float) -> None:
    """ValueError naming the first setting that is not a positive number."""
    for name, value in (("idle_timeout_s", idle_timeout_s),
                        ("frame_deadline_s", frame_deadline_s),
                        ("min_bytes_per_s", min_bytes_per_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}; valid: a number > 0")


class Peer:
    """One served connection and its progress (read by :class:`PeerTable` to pick a victim).

    Attributes:
      quiet_since: ``time.monotonic()`` of the accept or of the end of the last reply.
      frames: frames completed on this connection.
      frame_bytes: bytes received since the last complete frame.
      busy: a complete frame is being served (applied / replied to): not evictable.
      evicted: why the table dropped this peer (None while it is served).
    """

    def __init__(self, conn: socket.socket, *, timeout_s: float):
        self.conn, self.timeout_s = conn, timeout_s
        self.quiet_since = time.monotonic()
        self.frames = 0
        self.frame_bytes = 0
        self.busy = False
        self.evicted: str | None = None

    def recv_into(self, view: memoryview, deadline: float, late: Callable[[], str], *,
                  within_frame: bool = True) -> int:
        """One ``recv_into`` that returns by ``deadline`` (monotonic); DeadlineError with
        ``late()`` as its message when the deadline passes first, or when this peer was
        evicted. Inside a frame the read also gives up after ``timeout_s`` (TimeoutError);
        between frames only the deadline (the idle limit) applies. Returns the number of
        bytes read (0: the peer closed)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineError(late())
        self.conn.settimeout(min(self.timeout_s, remaining) if within_frame else remaining)
        try:
            n = self.conn.recv_into(view)
        except OSError:
            if self.evicted is not None:
                raise DeadlineError(self.evicted) from None
            if time.monotonic() >= deadline:
                raise DeadlineError(late()) from None
            raise
        if self.evicted is not None:
            raise DeadlineError(self.evicted)
        self.frame_bytes += n
        return n

    def rate(self, now: float) -> float:
        """Bytes per second received since the last complete frame (0 for a silent peer)."""
        return self.frame_bytes / max(now - self.quiet_since, 1e-3)


class PeerTable:
    """At most ``max_connections`` served peers; :meth:`make_room` evicts a slow one for a new
    peer (see the module docstring for the order)."""

    def __init__(self, max_connections: int, *, min_bytes_per_s: float):
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
                or max_connections < 1:
            raise ValueError(f"max_connections={max_connections!r}; valid: an int >= 1")
        self.max_connections, self.min_bytes_per_s = max_connections, min_bytes_per_s
        self._peers: set[Peer] = set()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._peers)

    def add(self, peer: Peer) -> None:
        with self._cond:
            self._peers.add(peer)

    def remove(self, peer: Peer) -> None:
        with self._cond:
            self._peers.discard(peer)
            self._cond.notify_all()

    def start_serving(self, peer: Peer) -> None:
        """Marks a complete frame as being served (not evictable); DeadlineError if the peer
        was evicted before its frame completed."""
        with self._cond:
            if peer.evicted is not None:
                raise DeadlineError(peer.evicted)
            peer.busy, peer.frames = True, peer.frames + 1

    def done_serving(self, peer: Peer) -> None:
        """The reply is sent: the peer's idle time (and its next frame) starts now."""
        with self._cond:
            peer.busy, peer.frame_bytes, peer.quiet_since = False, 0, time.monotonic()

    def make_room(self, timeout: float) -> bool:
        """True when a slot is free (evicting a slow peer if all are taken), False if none
        freed within ``timeout`` seconds (every peer busy or fast: the new peer waits)."""
        with self._cond:
            if len(self._peers) >= self.max_connections and not any(
                    p.evicted for p in self._peers):  # one eviction at a time
                victim = self._victim(time.monotonic())
                if victim is not None:
                    now = time.monotonic()
                    victim.evicted = (
                        f"evicted for a new peer: all {self.max_connections} slots taken and "
                        f"this one had {victim.frame_bytes} bytes in "
                        f"{now - victim.quiet_since:.2f}s since its last complete frame "
                        f"({victim.frames} frames), below min_bytes_per_s="
                        f"{self.min_bytes_per_s:.0f}")
                    _hang_up(victim.conn)
            return self._cond.wait_for(lambda: len(self._peers) < self.max_connections, timeout)

    def close_all(self) -> None:
        """Hangs up every peer (the server is stopping)."""
        with self._cond:
            for peer in self._peers:
                peer.evicted = peer.evicted or "the server stopped"
                _hang_up(peer.conn)

    def _victim(self, now: float) -> Peer | None:
        slow = [p for p in self._peers if not p.busy and p.rate(now) < self.min_bytes_per_s]
        return min(slow, key=lambda p: (p.frames > 0, p.quiet_since), default=None)


def _hang_up(conn: socket.socket) -> None:
    """Wakes the peer's thread from a blocked read (it sees the eviction and ends)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer or its thread
