"""The rollout job: a bf16 replica fed by SparseRL-Sync, sampling what the trainer asks for.

Every process of the rollout job (its own ``jax.distributed`` job, its own devices) runs
:func:`serve_rollouts`: a :class:`~jaxflow.sync.transport.tcp.ReplicaServer` (the replica, host
numpy bf16, starts FRESH so the trainer's first sync is a full payload) and the control protocol
of :mod:`jaxflow.rl.remote.protocol` on ``listen`` (process i: port + i). The trainer sends each
ROLL to every rollout process, which sample together on the rollout job's global mesh
(multi-controller: every process runs the same jitted sampler; the one-process path, the
:class:`~jaxflow.rl.rollout.RolloutWorker`, is reused unchanged). The replica's bits are laid
out on the mesh once per version and upcast to f32 there (exact), as the in-process
``SyncPublisher`` does, so the same replica bits, prompts and key give the same tokens.

With ``rl.sampler=engine`` the worker's :class:`jaxflow.rollout.RolloutEngine` follows the
replica in place (``engine.follow``: each step reads the replica's current bf16 leaves and
version; no f32 copy is made), under the replica server's lock while it samples, and every
token's version crosses with the batch.

Only the main thread launches JAX programs; the replica server's threads only write numpy, and
the control socket's threads (an acceptor, one reader per connection, at most
``max_connections``) only authenticate peers and read frames, handing each verified request to
the main thread through a bounded queue and waiting for its answer. So a silent or slow peer
holds only its own reader (closed ``handshake_timeout_s`` after it connected if it has not sent
a verified frame), never the trainer's requests; a peer without the job's secret is answered
DENY and nothing it sent is parsed; a malformed request gets an ERR reply. The job ends when the
trainer's session sends DONE, or exits 75 naming the trainer when no authenticated connection
is open for ``timeout_s``.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow import job_auth
from jaxflow.distributed import LOST_PEER_EXIT
from jaxflow.errors import one_line
from jaxflow.rl.remote import protocol as P
from jaxflow.rl.rollout import RolloutWorker
from jaxflow.sync.replica import FRESH, Replica
from jaxflow.sync.transport.frames import CONTROL_BYTES, Channel, deny
from jaxflow.sync.transport.tcp import ReplicaServer
from jaxflow.sync.wire import tree_digest

#: the largest ROLL request accepted (prompts as JSON text)
MAX_REQUEST_BYTES = 64 << 20
#: seconds a new connection has to say hello and send one frame that verifies
HANDSHAKE_TIMEOUT_S = 10.0
#: the most prompts one ROLL may ask for
MAX_PROMPTS = 4096


def bf16_template(abstract_params: Any) -> Any:
    """Host numpy zeros in the replica's layout: floating leaves bf16, others as they are."""
    def leaf(x):
        dtype = jnp.bfloat16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return np.zeros(x.shape, dtype)
    return jax.tree.map(leaf, abstract_params)


class _Conn:
    """One accepted control connection (its reader thread's state)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.accepted = sock, time.monotonic()
        self.authenticated = False
        self.peer = job_auth.peer_name(sock)


class RolloutService:
    """One rollout process: its replica server and the control protocol (module doc).

    Args:
      worker: samples on this job's rollout mesh (``param_shardings`` lay the replica out).
      host, port: the control address (``port`` 0: any free port; see ``address``).
      timeout_s: seconds without a trainer connection before the job gives up (exit 75).
      start_timeout_s: the same for the trainer's first connection (it may be pretraining);
        also the longest an authenticated connection may stay quiet between requests.
      log: one-line progress messages.
      secret: the job secret (default ``jaxflow.job_auth.job_secret(host)``: a non-loopback
        ``host`` without one is refused with an AuthError before anything listens).
      max_connections: control connections served at once (each on its own reader thread);
        when all are taken a new one evicts the oldest unauthenticated one, else is refused.
      handshake_timeout_s: a connection that has not sent one verified frame this long after
        it was accepted is closed.
    """

    def __init__(self, worker: RolloutWorker, *, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 120.0, start_timeout_s: float = 900.0,
                 log: Callable[[str], None] = print, secret: bytes | None = None,
                 max_connections: int = 8, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self.worker, self.timeout_s, self.log = worker, timeout_s, log
        self.start_timeout_s, self.handshake_timeout_s = start_timeout_s, handshake_timeout_s
        self._secret = job_auth.job_secret(host, secret)
        self._connected_once = False
        self.template = bf16_template(worker.fns.abstract_params())
        self.replica_server = ReplicaServer(Replica(self.template, version=FRESH), host=host,
                                            secret=self._secret, exclusive=True)
        self.origin = ""  # the lineage the replica holds (hex digest of the run's start params)
        self.trainer: bytes | None = None  # the session of the trainer (its last RSET)
        self.rollouts_served = 0
        self._placed: tuple[int, str, Any] | None = None  # (version, digest, f32 params on mesh)
        self._checked: tuple[int, int, str] | None = None  # (replica id, version, digest) verified
        self.max_connections = max_connections
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue(maxsize=max_connections)
        self._stop = threading.Event()
        self.errors: list[str] = []  # why each dropped control connection ended
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()[:2]

    @property
    def replica(self) -> Replica:
        """The bf16 replica the trainer's payloads update."""
        return self.replica_server.replica

    def status(self) -> dict:
        """The sync port, the replica's version and digest, the origin and this process's index."""
        return {"sync_port": self.replica_server.address[1], "version": self.replica.version,
                "digest": self.replica.digest(), "origin": self.origin,
                "process_index": jax.process_index(), "process_count": jax.process_count()}

    # -- connections (acceptor and reader threads: no JAX here) ---------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # the listening socket was closed
            conn = _Conn(sock)
            with self._conns_lock:
                if len(self._conns) >= self.max_connections:
                    waiting = [c for c in self._conns if not c.authenticated]
                    if not waiting:
                        deny(sock, f"all {self.max_connections} control connections are taken")
                        sock.close()
                        continue
                    self._hang_up(min(waiting, key=lambda c: c.accepted), "evicted for a new peer")
                self._conns.add(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _hang_up(self, conn: _Conn, why: str) -> None:
        self.errors.append(f"{conn.peer}: {why}")
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read(self, conn: _Conn) -> None:
        """A connection's reader: hello, then frames, each handed to the main thread and
        answered before the next is read."""
        try:
            with conn.sock:
                conn.sock.settimeout(self.handshake_timeout_s)
                channel = Channel.accept(conn.sock, kinds=P.KINDS, secret=self._secret)
                while not self._stop.is_set():
                    try:  # before a frame verified: CONTROL_BYTES at most
                        kind, body = channel.recv(
                            MAX_REQUEST_BYTES if conn.authenticated else CONTROL_BYTES)
                    except job_auth.AuthError as e:
                        deny(conn.sock)
                        if len(self.errors) < 10:  # a misconfigured trainer shows in the log
                            self.log(f"rollout job: refused {conn.peer}: {one_line(e)}")
                        raise
                    if not conn.authenticated:
                        conn.authenticated = True
                        conn.sock.settimeout(self.start_timeout_s)
                    answered = threading.Event()
                    self._requests.put((channel, kind, body, answered))
                    answered.wait()
        except Exception as e:  # noqa: BLE001 -- one peer's failure ends only its connection
            if not isinstance(e, OSError) or conn.authenticated is False:
                self.errors.append(f"{conn.peer}: {type(e).__name__}: {one_line(e)}")
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def _reap(self) -> int:
        """Hangs up connections past the handshake deadline; the number of authenticated ones."""
        now = time.monotonic()
        with self._conns_lock:
            for c in list(self._conns):
                if not c.authenticated and now - c.accepted > self.handshake_timeout_s:
                    self._hang_up(c, f"no verified frame within {self.handshake_timeout_s:g} s")
            return sum(c.authenticated for c in self._conns)

    # -- the main thread ------------------------------------------------------------------

    def serve(self) -> dict:
        """Serves until the trainer's DONE (returns a summary) or until no trainer is connected
        for ``timeout_s`` (exits the process with 75, one line on stderr; served from a thread other
        than the main one, returns the summary with ``timed_out`` instead)."""
        self.replica_server.start()
        acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        acceptor.start()
        self.log(f"rollout process {jax.process_index()}: control {self.address[0]}:"
                 f"{self.address[1]}, sync {self.replica_server.address[1]}")
        last_seen = time.monotonic()
        try:
            while True:
                try:
                    channel, kind, body, answered = self._requests.get(timeout=0.2)
                except queue.Empty:
                    if self._reap():
                        last_seen = time.monotonic()
                    limit, name = ((self.timeout_s, "timeout_s") if self._connected_once
                                   else (self.start_timeout_s, "start_timeout_s"))
                    if time.monotonic() - last_seen > limit:
                        print(f"rollout job: no trainer connected for {limit:g} s "
                              f"(remote.{name}); exiting", file=sys.stderr, flush=True)
                        sys.stdout.flush()
                        if threading.current_thread() is threading.main_thread():
                            os._exit(LOST_PEER_EXIT)
                        # served from another thread (a notebook, a test): end serve(), not the
                        # process that hosts it
                        return {"rollouts_served": self.rollouts_served, "timed_out": True,
                                "replica_version": self.replica.version,
                                "bytes_received": self.replica.bytes_received}
                    continue
                self._connected_once, last_seen = True, time.monotonic()
                done = False
                try:
                    reply_kind, reply, done = self._answer(kind, body, channel.session)
                    channel.send(reply_kind, reply)
                except OSError as e:
                    self.errors.append(f"{channel.peer}: reply lost ({one_line(e)})")
                    done = False
                finally:
                    answered.set()
                if done:
                    return {"rollouts_served": self.rollouts_served,
                            "replica_version": self.replica.version,
                            "bytes_received": self.replica.bytes_received}
        finally:
            self._stop.set()
            self.replica_server.stop()
            self._sock.close()
            with self._conns_lock:
                for c in list(self._conns):
                    self._hang_up(c, "the rollout job stopped")

    def _answer(self, kind: bytes, body, session: bytes) -> tuple[bytes, bytes, bool]:
        """(reply kind, reply body, whether the job is done); any error is an ERR reply."""
        try:
            if kind == b"DONE":
                self._require_trainer(session, "DONE")
                return b"OK  ", P.json_body({"rollouts_served": self.rollouts_served}), True
            reply_kind, reply = self._handle(kind, body, session)
            return reply_kind, reply, False
        except Exception as e:  # noqa: BLE001 -- a bad request is an error reply, never the end
            return b"ERR ", P.json_body({"error": f"{type(e).__name__}: {one_line(e)}"[:4000]}), False

    def _require_trainer(self, session: bytes, what: str) -> None:
        if session != self.trainer:
            raise P.RolloutRefused(f"{what} refused: only the trainer session that sent the last "
                                   "RSET may send it")

    def _handle(self, kind: bytes, body, session: bytes) -> tuple[bytes, bytes]:
        if kind == b"STAT":
            with self.replica_server.lock:
                return b"OK  ", P.json_body(self.status())
        if kind == b"RSET":
            origin, version = P.parse_reset(P.parse_json(body, "RSET"))
            with self.replica_server.lock:
                reset = origin != self.origin or self.replica.version > version
                if reset:
                    self.replica_server.replica = Replica(self.template, version=FRESH)
                    self.origin, self._placed, self._checked = origin, None, None
                self.trainer = session  # the trainer (restarted or not) owns the replica now
                self.replica_server.bind(session)
                return b"OK  ", P.json_body({"version": self.replica.version, "reset": reset})
        if kind == b"ROLL":
            self._require_trainer(session, "ROLL")
            return b"BTCH", self._roll(P.parse_json(body, "ROLL"))
        raise P.RolloutRefused(f"unexpected frame {kind!r}; valid: STAT, RSET, ROLL, DONE")

    def _check(self, version: int, digest: str) -> None:
        """RolloutRefused unless the replica is at ``version`` with ``digest`` (the digest is
        computed once per version; call under the replica server's lock)."""
        rep = self.replica
        if rep.version != version:
            raise P.RolloutRefused(f"replica is at version {rep.version}, the trainer asked "
                                   f"for {version} (sync first)")
        if self._checked != (id(rep), version, digest):
            got = tree_digest(rep.params)
            if got != digest:
                raise P.RolloutRefused(f"replica digest {got} at version {version} is not the "
                                       f"trainer's {digest}")
            self._checked = (id(rep), version, digest)

    def _params(self, version: int, digest: str) -> Any:
        """The replica at ``version`` laid out on the mesh, f32 (cached per version)."""
        with self.replica_server.lock:
            self._check(version, digest)
            if self._placed is None or self._placed[:2] != (version, digest):
                host = self.replica.params
                placed = _place(host, self.worker.param_shardings)
                self._placed = (version, digest, jax.tree.map(
                    lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                    else x, placed))
            return self._placed[2]

    def _roll(self, req: dict) -> bytes:
        key_shape = tuple(jax.random.key_data(jax.random.key(0)).shape)
        version, digest, prompts, key_data = P.parse_roll(req, key_shape=key_shape,
                                                          max_prompts=MAX_PROMPTS)
        key = jax.random.wrap_key_data(jnp.asarray(key_data))
        t0 = time.perf_counter()
        if self.worker.spec.sampler == "engine":
            with self.replica_server.lock:  # no payload lands while the engine samples
                self._check(version, digest)
                batch = self.worker.generate(None, prompts, key, replica=self.replica)
        else:
            params = self._params(version, digest)
            batch = self.worker.generate(params, prompts, key, version=version)
        self.rollouts_served += 1
        arrays = P.batch_arrays(batch)  # the records (sis_b top-K, R3 routing) when taken
        return P.encode_batch({"version": version, "digest": digest,
                               "sample_seconds": time.perf_counter() - t0}, arrays)


def _place(host_tree: Any, shardings: Any) -> Any:
    """Host numpy leaves onto ``shardings`` without collectives: each process builds only its
    addressable shards (``jax.make_array_from_callback``), so a multi-process job places the
    replica with no process waiting for another."""
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                        host_tree, shardings)


__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_PROMPTS", "MAX_REQUEST_BYTES", "RolloutService", "bf16_template"]
