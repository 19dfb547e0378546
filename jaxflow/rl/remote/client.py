"""The trainer's side of a separate rollout job: a Publisher whose only way to the rollout
weights is SparseRL-Sync over TCP, and the rollouts asked for over the control protocol.

:class:`RemoteRollout` plays both parts :class:`jaxflow.rl.grpo.GRPOTrainer` needs from its
rollout side:

* the :class:`jaxflow.rl.publish.Publisher` (``init`` / ``rollout_params`` / ``publish``): the
  trainer's state holds its own bf16 cast (on the trainer mesh) and version, as the in-process
  ``SyncPublisher`` holds the serving replica's; a :class:`~jaxflow.sync.sync_sender.SyncSender`
  (the same encoder, so the same payload bytes) syncs every rollout process's replica through
  a :class:`~jaxflow.sync.transport.tcp.TcpLink`, and each replica's digest is checked against
  the sender's (``SyncRecord.bit_exact``);
* ``generate(params, prompts, key)``: the rollout job samples with its replica at the state's
  version (``params`` is a :class:`RemoteParams`: version and digest, no weights) and returns
  the batch; every rollout process answers, and their batches must be identical.

A multi-process trainer job: every process runs the same calls; process 0 alone talks to the
rollout job and the others receive the batch and the sync figures by a broadcast
(``jax.experimental.multihost_utils.broadcast_one_to_all``), so every trainer process holds the
same state.

Faults: a rollout endpoint that stops answering (killed, restarting) is retried every second
for ``timeout_s``; when it answers again it is a new replica (FRESH), so it is reset, given a
full payload by the sender's plan, and the request is sent again. After ``timeout_s`` without
an answer :class:`~jaxflow.rl.remote.protocol.RolloutLost` names the endpoint (the flagship
exits 75 with that line, after its last checkpoint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow import job_auth
from jaxflow.distributed import to_host
from jaxflow.job_auth import AuthError
from jaxflow.rl.remote import protocol as P
from jaxflow.rl.rollout import RolloutBatch, RolloutSpec
from jaxflow.rl.tasks import encode_prompts
from jaxflow.sync.sync_sender import SyncSender
from jaxflow.sync.transport.frames import Channel, FrameError
from jaxflow.sync.transport.tcp import TcpLink
from jaxflow.sync.weight_sync import SyncConfig, SyncRecord


class RemoteParams(NamedTuple):
    """What a remote rollout samples with: the replica version and its digest (no weights)."""

    version: int
    digest: str


@jax.jit
def _cast_bf16(params):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, params)


class _Endpoint:
    """One rollout process's authenticated control connection (reconnected on demand)."""

    def __init__(self, host: str, port: int, io_timeout_s: float, secret: bytes, session: bytes):
        self.address, self.io_timeout_s = (host, port), io_timeout_s
        self.secret, self.session = secret, session
        self.channel: Channel | None = None

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def send(self, kind: bytes, body: bytes = b"") -> None:
        if self.channel is None:
            self.channel = Channel.connect(self.address, kinds=P.KINDS, timeout_s=self.io_timeout_s,
                                           secret=self.secret, session=self.session)
        self.channel.send(kind, body)

    def recv(self, max_bytes: int) -> tuple[bytes, bytearray]:
        assert self.channel is not None
        kind, body = self.channel.recv({k: max_bytes for k in P.KINDS})
        if kind == b"ERR ":
            raise P.RolloutRefused(f"rollout {self.name}: {P.parse_json(body, self.name).get('error')}")
        return kind, body

    def ask(self, kind: bytes, body: bytes = b"", max_bytes: int = 1 << 20) -> dict:
        self.send(kind, body)
        _, reply = self.recv(max_bytes)
        return P.parse_json(reply, f"rollout {self.name}")

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class RemoteRollout:
    """The rollout job seen from the trainer (module doc).

    Args:
      endpoints: every rollout process's control address, in process order.
      spec, task, tokenizer: what the rollout samples (to check the batch shapes).
      config: the SparseRL-Sync settings (codec, every, history; the sender's path is "host").
      timeout_s: how long a silent endpoint is retried before RolloutLost.
      start_timeout_s: the same at the start (the rollout job may still be starting up).
      log: one-line messages (a lost endpoint, a reconnect).
      secret: the job secret (default ``jaxflow.job_auth.job_secret`` of the first endpoint's
        host). Every connection presents one random session id (``session``), which the
        rollout job binds at RSET: only it may sync, roll and say DONE there.
      model: the policy's TransformerConfig, to check the records a batch carries: the routing
        record's shape (needed with ``spec.record_routing``), the top-K's ids below its vocabulary.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], spec: RolloutSpec, task, tokenizer,
                 config: SyncConfig, *, timeout_s: float = 120.0, start_timeout_s: float = 900.0,
                 io_timeout_s: float = 600.0, log: Callable[[str], None] = print,
                 secret: bytes | None = None, model: Any = None):
        if not endpoints:
            raise ValueError("RemoteRollout needs at least one rollout endpoint")
        if spec is not None and spec.record_routing and model is None:
            raise ValueError("RemoteRollout: spec.record_routing=True (R3) needs model= (the policy's "
                             "TransformerConfig: its MoE layers and top-k fix the routing record's shape)")
        self.model = model
        self._secrets = {h: job_auth.job_secret(h, secret) for h, _ in endpoints}
        self.session = job_auth.new_session()
        self.spec, self.task, self.tokenizer = spec, task, tokenizer
        self.config, self.timeout_s, self.log = config, timeout_s, log
        self.start_timeout_s = start_timeout_s
        self.primary = jax.process_index() == 0
        self._endpoints = [_Endpoint(h, p, io_timeout_s, self._secrets[h], self.session)
                           for h, p in endpoints] if self.primary else []
        self._links: list[TcpLink] = []
        self.sender: SyncSender | None = None
        self._origin: str | None = None
        self.prompt_width = task.max_prompt_len + 1

    # -- connection handling -------------------------------------------------------------

    def _retrying(self, what: str, fn: Callable[[], Any], *, start: bool = False) -> Any:
        """``fn()``; on a lost connection, waits for every endpoint to answer again (up to
        ``timeout_s``, or ``start_timeout_s`` at the start), brings the restarted replicas back
        (reset + full payload) and retries."""
        deadline = None
        limit, name = ((self.start_timeout_s, "start_timeout_s") if start
                       else (self.timeout_s, "timeout_s"))
        while True:
            try:
                return fn()
            except AuthError:
                raise  # a wrong secret does not heal by waiting
            except (OSError, FrameError) as e:
                if deadline is None:
                    deadline = time.monotonic() + limit
                    self.log(f"rollout job: {what} failed ({type(e).__name__}: {e}); waiting up "
                             f"to {limit:g} s (remote.{name}) for it to come back")
                self._reconnect(deadline, limit, name)

    def _reconnect(self, deadline: float, limit: float, name: str) -> None:
        for ep in self._endpoints:
            ep.close()
        pending = list(self._endpoints)
        while pending:
            ep = pending[0]
            try:
                ep.ask(b"STAT")
                pending.pop(0)
            except AuthError:
                raise
            except (OSError, FrameError):
                ep.close()
                if time.monotonic() > deadline:
                    raise P.RolloutLost(
                        f"rollout endpoint {ep.name} lost: no answer for {limit:g} s "
                        f"(remote.{name})") from None
                time.sleep(1.0)
        self._connect_links()
        self._reset_and_catch_up()

    def _connect_links(self) -> None:
        self._links = []
        for ep in self._endpoints:
            status = ep.ask(b"STAT")
            port = status.get("sync_port")
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise P.RolloutRefused(f"rollout {ep.name}: STAT sync_port {port!r} is not a port")
            self._links.append(TcpLink(ep.address[0], port, timeout_s=60.0,
                                       secret=ep.secret, session=self.session))

    def _reset_and_catch_up(self) -> list[dict]:
        body = P.json_body({"origin": self._origin, "version": self.sender.version})
        for ep in self._endpoints:
            ep.ask(b"RSET", body)
        report = self.sender.sync_all(self._links)
        failed = [r for r in report if not r["ok"]]
        if failed:
            raise ConnectionError(f"weight sync to the rollout job failed: {failed}")
        return report

    # -- Publisher -----------------------------------------------------------------------

    def _start(self, bf16: Any, version: int, origin: Any) -> None:
        """A sender at ``version`` holding ``bf16`` (the trainer-mesh cast), every replica
        reset to this lineage and brought to it."""
        host = jax.tree.map(to_host, bf16)  # every trainer process (a gather when sharded)
        self.sender = SyncSender(host, version=version, codec=self.config.codec,
                                 history=self.config.history, path="host")
        self._origin = np.asarray(to_host(origin)).tobytes().hex()
        if self.primary:
            def start():
                if not self._links:
                    self._connect_links()
                self._reset_and_catch_up()
            self._retrying("the first sync", start, start=not self._links)

    def init(self, params: Any, origin: jax.Array) -> tuple[tuple, jax.Array]:
        """``Publisher.init``: ((the bf16 cast of ``params``,), version 0); starts the sender and
        brings every rollout replica to that tree."""
        bf16 = _cast_bf16(params)
        self._start(bf16, 0, origin)
        return (bf16,), _replicated(jnp.zeros((1,), jnp.int32), params)

    def serving(self, published: tuple, versions: jax.Array, origin: jax.Array) -> SyncSender:
        """The sender at the state's published version and origin (restarted, and the replicas
        resynced, for a restored state)."""
        version = int(to_host(versions)[0])
        lineage = np.asarray(to_host(origin)).tobytes().hex()
        if self.sender is None or self.sender.version != version or self._origin != lineage:
            self._start(published[0], version, origin)  # a restored state: replicas resynced
        return self.sender

    def rollout_params(self, published: tuple, versions: jax.Array, origin: jax.Array) -> RemoteParams:
        """``Publisher.rollout_params``: the version and digest the rollout processes sample with
        (the weights themselves stay there)."""
        sender = self.serving(published, versions, origin)
        return RemoteParams(sender.version, sender.digest())

    def publish(self, published, versions, params, step, *, rollout, origin):
        """``Publisher.publish``: every ``config.every`` rollouts, encode ``params`` as version
        ``step`` and sync every rollout replica; returns (published, published_version, the
        SyncRecord or None)."""
        sender = self.serving(published, versions, origin)
        if (rollout + 1) % self.config.every:  # ``every`` counts rollouts
            return published, versions, None
        version = int(to_host(step))
        stats = sender.publish(jax.tree.map(to_host, params), version=version,
                               with_bound=self.config.bound)
        figures = np.zeros(2, np.float64)  # deliver seconds, bit_exact
        report: tuple = ()
        if self.primary:
            t0 = time.perf_counter()
            rep = self._retrying("a weight sync", self._sync_all_or_raise)
            # SyncSender.sync already checked every replica's digest against the snapshot (the
            # trainer's bf16 cast): a link that is ok is bit-exact
            exact = len(rep) == len(self._links) and all(r["ok"] for r in rep)
            figures[:] = (time.perf_counter() - t0, float(exact))
            report = tuple(rep)
        figures = _broadcast(figures)
        record = SyncRecord(dataclasses.replace(stats, payload=b""), float(figures[0]),
                            bool(figures[1]), report)
        return (_cast_bf16(params),), step[None], record

    def _sync_all_or_raise(self) -> list[dict]:
        report = self.sender.sync_all(self._links)
        failed = [r for r in report if not r["ok"]]
        if failed:
            raise ConnectionError(f"weight sync failed: {failed}")
        return report

    # -- rollouts ------------------------------------------------------------------------

    def expected_arrays(self, rows: int) -> dict[str, tuple]:
        """The (shape, dtype[, id bound]) of each array a rollout of ``rows`` rows must return
        (:func:`jaxflow.rl.remote.protocol.expected_batch`): with the spec's ``behaviour_topk``
        the top-K (K capped at the vocabulary, as the rollout worker caps it), with its
        ``record_routing`` the model's routing record."""
        m, k = self.model, self.spec.behaviour_topk
        routing = None
        if self.spec.record_routing:
            layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
            routing = (layers, m.n_experts_per_token, max(m.n_experts, 1))
        return P.expected_batch(rows, self.prompt_width, self.spec.max_new_tokens,
                                behaviour_topk=min(k, m.vocab_size) if m is not None else k,
                                vocab_size=None if m is None else m.vocab_size, routing=routing)

    def generate(self, params: RemoteParams, prompt_texts: Sequence[str], key: jax.Array, *,
                 version: int | None = None, replica: Any = None) -> RolloutBatch:
        """G samples per prompt from the rollout job's replica at ``params.version`` (rows
        ``i*G .. i*G+G-1`` answer prompt ``i``), the same arrays as ``RolloutWorker.generate``
        (``versions``: per token, as the rollout job's sampler recorded them). ``version`` must
        be ``params.version`` when given; ``replica`` must be None (the replica is remote)."""
        if version is not None and version != params.version:
            raise ValueError(f"generate(version={version}) but the remote replica is asked for "
                             f"version {params.version}")
        if replica is not None:
            raise ValueError("a remote rollout samples its own replica; replica must be None")
        rows = len(prompt_texts) * self.spec.group_size
        expected = self.expected_arrays(rows)
        if self.primary:
            request = P.json_body({"version": params.version, "digest": params.digest,
                                   "prompts": list(prompt_texts),
                                   "key": np.asarray(jax.random.key_data(key)).tolist()})
            bound = sum(int(np.prod(s)) * 4 for s, *_ in expected.values()) * 2 + (1 << 20)
            arrays = self._retrying("a rollout", lambda: self._roll(request, expected, bound))
            prompts, _ = encode_prompts(self.tokenizer, [p for p in prompt_texts
                                                         for _ in range(self.spec.group_size)],
                                        self.prompt_width)
            if not np.array_equal(prompts, arrays["prompts"]):
                raise P.RolloutRefused("the rollout job encoded other prompts than the trainer's")
        else:
            arrays = {k: np.zeros(s, d) for k, (s, d, *_) in expected.items()}
        arrays = _broadcast(arrays)
        return RolloutBatch(*(None if k not in arrays else np.asarray(arrays[k])
                              for k in P.BATCH_FIELDS + P.RECORD_FIELDS))

    def _roll(self, request: bytes, expected: dict, bound: int) -> dict[str, np.ndarray]:
        for ep in self._endpoints:  # every rollout process samples, together
            ep.send(b"ROLL", request)
        batches, digests = [], set()
        for ep in self._endpoints:
            _, body = ep.recv(bound)
            _, arrays = P.decode_batch(body, expected, f"rollout {ep.name}")
            batches.append(arrays)
            digests.add(hashlib.blake2b(b"".join(arrays[k].tobytes() for k in sorted(arrays)),
                                        digest_size=16).hexdigest())
        if len(digests) != 1:
            raise P.RolloutRefused(f"the rollout processes returned {len(digests)} different batches")
        return batches[0]

    def close(self) -> None:
        """Tells the rollout job the run is over (DONE), so it exits 0."""
        for ep in self._endpoints:
            try:
                ep.ask(b"DONE")
            except (OSError, FrameError, P.RolloutRefused):
                pass
            ep.close()


def _replicated(x: jax.Array, like: Any) -> jax.Array:
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = getattr(jax.tree.leaves(like)[0], "sharding", None)
    if isinstance(sharding, NamedSharding):
        from jaxflow.distributed import put

        return put(np.asarray(x), NamedSharding(sharding.mesh, PartitionSpec()))
    return x


def _broadcast(tree: Any) -> Any:
    """Process 0's ``tree`` (numpy leaves) on every process of this job (a no-op in one)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


__all__ = ["RemoteParams", "RemoteRollout"]
