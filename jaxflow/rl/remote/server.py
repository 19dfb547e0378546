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

Only the control socket's thread (the main one) launches JAX programs; the replica server's
threads only write numpy. The job ends when the trainer sends DONE, or exits 75 naming the
trainer when none is connected for ``timeout_s``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.distributed import LOST_PEER_EXIT
from jaxflow.rl.remote import protocol as P
from jaxflow.rl.rollout import RolloutWorker
from jaxflow.sync.replica import FRESH, Replica
from jaxflow.sync.transport.tcp import FrameError, ReplicaServer, recv_frame, send_frame
from jaxflow.sync.wire import tree_digest

#: the largest ROLL request accepted (prompts as JSON text)
MAX_REQUEST_BYTES = 64 << 20


def bf16_template(abstract_params: Any) -> Any:
    """Host numpy zeros in the replica's layout: floating leaves bf16, others as they are."""
    def leaf(x):
        dtype = jnp.bfloat16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return np.zeros(x.shape, dtype)
    return jax.tree.map(leaf, abstract_params)


class RolloutService:
    """One rollout process: its replica server and the control protocol (module doc).

    Args:
      worker: samples on this job's rollout mesh (``param_shardings`` lay the replica out).
      host, port: the control address (``port`` 0: any free port; see ``address``).
      timeout_s: seconds without a trainer connection before the job gives up (exit 75).
      start_timeout_s: the same for the trainer's first connection (it may be pretraining).
      log: one-line progress messages.
    """

    def __init__(self, worker: RolloutWorker, *, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 120.0, start_timeout_s: float = 900.0, log: Callable[[str], None] = print):
        self.worker, self.timeout_s, self.log = worker, timeout_s, log
        self.start_timeout_s = start_timeout_s
        self._connected_once = False
        self.template = bf16_template(worker.fns.abstract_params())
        self.replica_server = ReplicaServer(Replica(self.template, version=FRESH), host=host)
        self.origin = ""  # the lineage the replica holds (hex digest of the run's start params)
        self.rollouts_served = 0
        self._placed: tuple[int, str, Any] | None = None  # (version, digest, f32 params on mesh)
        self._checked: tuple[int, int, str] | None = None  # (replica id, version, digest) verified
        self._sock = socket.create_server((host, port))
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

    def serve(self) -> dict:
        """Serves until DONE (returns a summary) or until no trainer is connected for
        ``timeout_s`` (exits the process with 75, one line on stderr)."""
        self.replica_server.start()
        self.log(f"rollout process {jax.process_index()}: control {self.address[0]}:"
                 f"{self.address[1]}, sync {self.replica_server.address[1]}")
        try:
            while True:
                limit, name = ((self.timeout_s, "timeout_s") if self._connected_once
                               else (self.start_timeout_s, "start_timeout_s"))
                conn = self._accept(limit)
                if conn is None:
                    print(f"rollout job: no trainer connected for {limit:g} s "
                          f"(remote.{name}); exiting", file=sys.stderr, flush=True)
                    sys.stdout.flush()
                    os._exit(LOST_PEER_EXIT)
                with conn:
                    if self._session(conn):
                        return {"rollouts_served": self.rollouts_served,
                                "replica_version": self.replica.version,
                                "bytes_received": self.replica.bytes_received}
                self.log("rollout job: the trainer's connection closed; waiting for it to return")
        finally:
            self.replica_server.stop()
            self._sock.close()

    def _accept(self, limit: float) -> socket.socket | None:
        self._sock.settimeout(limit)
        try:
            conn, _ = self._sock.accept()
        except socket.timeout:
            return None
        self._connected_once = True
        conn.settimeout(None)  # a request may come minutes later (the trainer's updates)
        return conn

    def _session(self, conn: socket.socket) -> bool:
        """Serves one trainer connection; True when it said DONE."""
        while True:
            try:
                kind, body = recv_frame(conn, max_bytes=MAX_REQUEST_BYTES, kinds=P.KINDS)
            except (FrameError, OSError):
                return False
            if kind == b"DONE":
                send_frame(conn, b"OK  ", P.json_body({"rollouts_served": self.rollouts_served}))
                return True
            try:
                reply_kind, reply = self._handle(kind, body)
            except P.RolloutRefused as e:
                reply_kind, reply = b"ERR ", P.json_body({"error": str(e)})
            try:
                send_frame(conn, reply_kind, reply)
            except OSError:
                return False

    def _handle(self, kind: bytes, body) -> tuple[bytes, bytes]:
        if kind == b"STAT":
            with self.replica_server.lock:
                return b"OK  ", P.json_body(self.status())
        if kind == b"RSET":
            req = P.parse_json(body, "RSET")
            with self.replica_server.lock:
                reset = (req.get("origin") != self.origin
                         or self.replica.version > int(req.get("version", 0)))
                if reset:
                    self.replica_server.replica = Replica(self.template, version=FRESH)
                    self.origin, self._placed, self._checked = str(req.get("origin")), None, None
                return b"OK  ", P.json_body({"version": self.replica.version, "reset": reset})
        if kind == b"ROLL":
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
        try:
            version, digest = int(req["version"]), str(req["digest"])
            prompts, key_data = list(req["prompts"]), np.asarray(req["key"], np.uint32)
        except (KeyError, TypeError, ValueError) as e:
            raise P.RolloutRefused(f"malformed ROLL request ({e!r})") from None
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
        arrays = dict(zip(P.BATCH_FIELDS, batch))
        return P.encode_batch({"version": version, "digest": digest,
                               "sample_seconds": time.perf_counter() - t0}, arrays)


def _place(host_tree: Any, shardings: Any) -> Any:
    """Host numpy leaves onto ``shardings`` without collectives: each process builds only its
    addressable shards (``jax.make_array_from_callback``), so a multi-process job places the
    replica with no process waiting for another."""
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                        host_tree, shardings)


__all__ = ["MAX_REQUEST_BYTES", "RolloutService", "bf16_template"]
