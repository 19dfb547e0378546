"""Sender and replicas: versioned fan-out of sync payloads, catch-up and recovery.

A :class:`SyncSender` owns the last synced bf16 snapshot, the recent step payloads (each takes
version ``b`` to the next synced version) and, lazily, a dense payload of the current version.
For a replica at version ``v`` it :meth:`~SyncSender.plan` s either the chain of step payloads
from ``v`` or one dense resync, whichever is fewer bytes (dense when ``v`` fell out of the
history, or the replica is fresh). A :class:`Replica` verifies each payload completely before
writing and advances its version only after a successful apply, so a transfer that dies
mid-way leaves it on its previous version and the next sync continues from there.

    sender = SyncSender(bf16(params0), version=0, codec="auto")
    replicas = [Replica(bf16(params0), version=0) for _ in range(2)]
    links = [InProcessLink(r) for r in replicas]             # or TcpLink / StorageChannel
    sender.publish(bf16(params), version=4)
    report = sender.sync_all(links)                            # per link: version, digest, route

Transports (``jaxflow.sync.transport``) only move payload bytes; every route ends in
``Replica.receive``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from jaxflow.sync import bits, digest
from jaxflow.sync.bound import entropy_bound_bytes
from jaxflow.sync.diff import diff_tree, tree_layout
from jaxflow.sync.encoder import CODECS, encode, encode_diffs
from jaxflow.sync.payload import FRESH, Payload, PayloadError
from jaxflow.sync.receiver import apply, check_applicable


class VersionMismatch(RuntimeError):
    """A rollout found its replica at another version than the trainer published."""


def to_bf16(params: Any) -> Any:
    """Host numpy copy of ``params`` with every floating leaf cast to bf16 (what rollout runs)."""
    def cast(x):
        x = np.asarray(jax.device_get(x))
        return x.astype(bits.BF16) if np.issubdtype(x.dtype, np.floating) else x.copy()
    return jax.tree.map(cast, params)


def tree_digest(params: Any) -> str:
    """blake2b-128 hex over every leaf's name, dtype, shape and raw bytes (bit patterns)."""
    h = hashlib.blake2b(digest_size=16)
    treedef, leaves, specs = tree_layout(params)
    h.update(treedef.encode())
    for spec, leaf in zip(specs, leaves):
        h.update(f"{spec.name}|{spec.dtype}|{spec.shape}".encode())
        h.update(bits.host_array(leaf).tobytes())
    return h.hexdigest()


def is_full(payload: Payload) -> bool:
    """True when every leaf is carried whole (dense / exact sections): such a payload does not
    depend on the receiver's old values and may be applied from any version (a resync)."""
    return payload.is_full


class Replica:
    """One rollout replica's weights and version.

    Args:
      params: initial tree (e.g. the bf16 warm start), or a same-layout template with
        ``version=FRESH``.
      version: the version ``params`` are at.
      shardings: optional same-structure tree of shardings (the rollout sub-mesh): params are
        ``device_put`` there and ``apply`` keeps each leaf's sharding.
    """

    def __init__(self, params: Any, *, version: int = 0, shardings: Any = None):
        if (isinstance(version, bool) or not isinstance(version, (int, np.integer))
                or version < FRESH):
            raise ValueError(f"version={version!r}: need an int >= {FRESH} (FRESH)")
        if shardings is not None:
            params = jax.device_put(params, shardings)
        self._params, self._version = params, int(version)
        self.bytes_received = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def params(self) -> Any:
        return self._params

    def digest(self) -> str:
        return tree_digest(self._params)

    def receive(self, data: bytes | bytearray | memoryview | Payload, *,
                rollback: bool = False) -> int:
        """Verifies and applies one payload; returns the new version.

        A full (dense) payload is accepted from any version up to its own, and from a newer
        one only with ``rollback=True``; a delta payload must name this replica's version as
        its base and carry the digest of this replica's tree (checked on its devices). Raises
        PayloadError naming both versions, with params and version unchanged.
        """
        payload = data if isinstance(data, Payload) else Payload.from_bytes(data)
        check_applicable(payload, self._version, rollback=rollback, who="replica")
        # on_device passed explicitly: receiver.apply's default probes ``leaf.devices().pop()``,
        # which empties the sharding's cached device set (shared by every same-sharded array).
        self._params = apply(payload, self._params, version=self._version,
                             on_device=_on_accelerator(self._params), rollback=rollback)
        self._version = payload.version  # only after apply succeeded
        if not isinstance(data, Payload):
            self.bytes_received += len(data)
        return self._version

    def check_version(self, expected: int) -> None:
        """The per-rollout check: raises VersionMismatch unless at ``expected``."""
        if self._version != expected:
            raise VersionMismatch(f"replica is at version {self._version}, the trainer "
                                  f"published {expected}")


def _on_accelerator(params: Any) -> bool:
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.sharding.device_set)).platform != "cpu"
    return False


class Link(Protocol):
    """A sender's view of one replica, whatever carries the bytes."""

    def sync(self, plan: Callable[[int], list[bytes]]) -> tuple[int, str]:
        """Asks the replica's version v, sends ``plan(v)`` in order, returns (version, digest)."""

    def status(self) -> tuple[int, str]:
        """(version, digest) of the replica."""


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """One publish: sizes in bytes, times in seconds, changed elements of bf16 leaves."""

    base_version: int
    version: int
    codec: str
    payload_bytes: int
    dense_bytes: int
    changed: int
    elements: int
    bound_bytes: float
    encode_s: float

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.elements, 1)

    @property
    def ratio_vs_dense(self) -> float:
        return self.dense_bytes / max(self.payload_bytes, 1)


class SyncSender:
    """The trainer side: snapshot, step-payload history, plans and fan-out.

    Args:
      params: the bf16 tree every replica starts from (at ``version``).
      codec: one of ``jaxflow.sync.CODECS``.
      history: step payloads kept for chained catch-up (older replicas get a dense resync).
    """

    def __init__(self, params: Any, *, version: int = 0, codec: str = "auto", history: int = 64):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; valid: {CODECS}")
        if history < 0:
            raise ValueError(f"history={history}: need >= 0")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version={version!r}: need an int >= 0")
        self.codec, self.history = codec, history
        self._snapshot = to_bf16(params)
        self._version = int(version)
        # Per-leaf digest lanes of the snapshot (jaxflow.sync.digest), computed once and then
        # advanced from each publish's diff in O(changes): the base digest costs no pass.
        self._lanes: np.ndarray | None = None
        self._steps: dict[int, tuple[int, bytes]] = {}  # base version -> (version, bytes)
        self._dense: bytes | None = None
        self._digest: str | None = None
        self.routes: list[str] = []  # "chain" / "dense" / "current" per plan, for reports

    @property
    def version(self) -> int:
        return self._version

    @property
    def snapshot(self) -> Any:
        return self._snapshot

    def digest(self) -> str:
        if self._digest is None:
            self._digest = tree_digest(self._snapshot)
        return self._digest

    def publish(self, params: Any, *, version: int | None = None,
                with_bound: bool = False) -> PublishStats:
        """Encodes the change from the snapshot to ``params`` (cast to bf16) as the next
        version (default: current + 1) and makes it the snapshot. Sends nothing."""
        version = self._version + 1 if version is None else int(version)
        if version <= self._version:
            raise ValueError(f"version {version} must exceed the current {self._version}")
        new = to_bf16(params)
        t0 = time.perf_counter()
        treedef, specs, diffs = diff_tree(self._snapshot, new)
        base_digest = None
        if self.codec != "dense":
            if self._lanes is None:
                self._lanes = digest.tree_lanes(self._snapshot)
            base_digest = digest.combine(treedef, specs, self._lanes)
        payload = encode_diffs(treedef, specs, diffs, base_version=self._version,
                               version=version, codec=self.codec, base_digest=base_digest)
        data = payload.to_bytes()
        encode_s = time.perf_counter() - t0
        bf16_ids = [i for i, s in enumerate(specs) if s.dtype == bits.BF16.name]
        stats = PublishStats(
            base_version=self._version, version=version, codec=self.codec,
            payload_bytes=len(data), dense_bytes=len(self._dense_of(new, version)),
            changed=sum(diffs[i].count for i in bf16_ids),
            elements=sum(specs[i].size for i in bf16_ids),
            bound_bytes=entropy_bound_bytes(specs, diffs) if with_bound else float("nan"),
            encode_s=encode_s)
        self._steps[self._version] = (version, data)
        for base in sorted(self._steps)[: max(0, len(self._steps) - self.history)]:
            del self._steps[base]
        if self._lanes is not None:
            self._advance_lanes(specs, diffs, jax.tree_util.tree_leaves(new))
        self._snapshot, self._version, self._digest = new, version, None
        return stats

    def _advance_lanes(self, specs, diffs, new_leaves) -> None:
        for i, (spec, diff) in enumerate(zip(specs, diffs)):
            if not diff.count:
                continue
            if spec.dtype == bits.BF16.name:  # one word per element: update the changes only
                self._lanes[i] += digest.lanes_delta(diff.positions, diff.old_bits,
                                                     diff.new_bits)
            else:
                self._lanes[i] = digest.host_lanes(np.asarray(new_leaves[i]))

    def base_digest(self) -> str:
        """``device_digest`` of the snapshot (what the next step payload names as its base)."""
        if self._lanes is None:
            self._lanes = digest.tree_lanes(self._snapshot)
        treedef, _, specs = tree_layout(self._snapshot)
        return digest.combine(treedef, specs, self._lanes)

    def _dense_of(self, params: Any, version: int) -> bytes:
        # base FRESH: a full payload applies from any version (Payload.is_full)
        self._dense = encode(params, params, base_version=FRESH, version=version,
                             codec="dense").to_bytes()
        return self._dense

    def dense_payload(self) -> bytes:
        """A full payload of the current version (applies from any version)."""
        if self._dense is None:
            self._dense_of(self._snapshot, self._version)
        return self._dense

    def chain_from(self, version: int) -> list[bytes] | None:
        """Step payloads from ``version`` to the current one, or None if not in the history."""
        chain, v = [], version
        while v != self._version:
            if v not in self._steps:
                return None
            v, data = self._steps[v]
            chain.append(data)
        return chain

    def plan(self, replica_version: int) -> list[bytes]:
        """What to send a replica at ``replica_version``: nothing, the chain, or a dense
        resync, whichever is smallest."""
        if replica_version == self._version:
            self.routes.append("current")
            return []
        chain = self.chain_from(replica_version) if replica_version >= 0 else None
        dense = self.dense_payload()
        if chain is not None and sum(map(len, chain)) <= len(dense):
            self.routes.append("chain")
            return chain
        self.routes.append("dense")
        return [dense]

    def sync(self, link: Link) -> tuple[int, str]:
        """Brings one replica to the current version; raises if it ends elsewhere or its
        digest differs from the snapshot's (bit-exactness)."""
        version, digest = link.sync(self.plan)
        if version != self._version:
            raise VersionMismatch(f"replica ended at {version}, sender is at {self._version}")
        if digest != self.digest():
            raise PayloadError(f"replica digest {digest} != sender digest {self.digest()} at "
                               f"version {version}")
        return version, digest

    def sync_all(self, links: Sequence[Link]) -> list[dict]:
        """Fan-out: syncs every link; a failing link is reported (and left behind, to be
        caught up next time) instead of stopping the others."""
        report = []
        for i, link in enumerate(links):
            try:
                version, _ = self.sync(link)
                report.append({"link": i, "ok": True, "version": version,
                               "route": self.routes[-1]})
            except (OSError, PayloadError, VersionMismatch, TimeoutError) as e:
                report.append({"link": i, "ok": False, "error": repr(e)})
        return report
