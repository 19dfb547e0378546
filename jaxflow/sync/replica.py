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

from jaxflow.sync import bits, device_diff, digest, encoder
from jaxflow.sync.bound import entropy_bound_bytes
from jaxflow.sync.diff import LeafDiff, diff_tree, tree_layout
from jaxflow.sync.encoder import CODECS, encode_diffs
from jaxflow.sync.payload import FRESH, Payload, PayloadError
from jaxflow.sync.receiver import apply, check_applicable


class VersionMismatch(RuntimeError):
    """A rollout found its replica at another version than the trainer published."""


def to_bf16(params: Any, *, copy: bool = True) -> Any:
    """Host numpy copy of ``params`` with every floating leaf cast to bf16 (what rollout runs).
    ``copy=False``: numpy leaves that need no cast are returned as they are."""
    def cast(x):
        if not copy and isinstance(x, np.ndarray) and (
                x.dtype == bits.BF16 or not np.issubdtype(x.dtype, np.floating)):
            return x
        x = np.asarray(jax.device_get(x))
        return x.astype(bits.BF16) if np.issubdtype(x.dtype, np.floating) else x.copy()
    return jax.tree.map(cast, params)


def _device_tree(params: Any) -> Any:
    """``params`` with every leaf a jax Array (host leaves put on the default device; a dtype
    the device cannot hold, e.g. int64 without x64, is an error: use path="host")."""
    def put(x):
        if isinstance(x, jax.Array):
            return x
        host = np.asarray(x)
        out = jax.numpy.asarray(host)
        if out.dtype != host.dtype:
            raise ValueError(f"a {host.dtype} leaf becomes {out.dtype} on the device: the "
                             "device sync path needs device dtypes (use path='host')")
        return out
    return jax.tree.map(put, params)


def tree_digest(params: Any) -> str:
    """blake2b-128 hex over every leaf's name, dtype, shape and raw bytes (bit patterns): equal
    iff the trees are bit-identical. The project's one parameter digest (sync end-to-end checks,
    the ``params_checksum`` of run summaries, resume tests). Leaves spread over several
    processes are gathered first (every process gets the same digest)."""
    from jaxflow.distributed import to_host

    h = hashlib.blake2b(digest_size=16)
    treedef, leaves, specs = tree_layout(params)
    h.update(treedef.encode())
    for spec, leaf in zip(specs, leaves):
        h.update(f"{spec.name}|{spec.dtype}|{spec.shape}".encode())
        if not getattr(leaf, "is_fully_addressable", True):
            leaf = to_host(leaf)
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
      path: where payloads are written into jax leaves: "device" (integer scatters on the
        leaves' own devices, no host round trip), "host" (numpy, then ``device_put``) or
        "auto" (device when the params live on an accelerator).
      scatter, interpret: the device write's backend (``receiver.apply``'s ``scatter``).
    """

    def __init__(self, params: Any, *, version: int = 0, shardings: Any = None,
                 path: str = "auto", scatter: str = "auto", interpret: bool = False):
        if (isinstance(version, bool) or not isinstance(version, (int, np.integer))
                or version < FRESH):
            raise ValueError(f"version={version!r}: need an int >= {FRESH} (FRESH)")
        if path not in PATHS:
            raise ValueError(f"path={path!r}; valid: {PATHS}")
        if shardings is not None:
            params = jax.device_put(params, shardings)
        self._params, self._version = params, int(version)
        self.path, self.scatter, self.interpret = path, scatter, interpret
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
        on_device = (_on_accelerator(self._params) if self.path == "auto"
                     else self.path == "device")
        self._params = apply(payload, self._params, version=self._version,
                             on_device=on_device, rollback=rollback, scatter=self.scatter,
                             interpret=self.interpret)
        self._version = payload.version  # only after apply succeeded
        if not isinstance(data, Payload):
            self.bytes_received += len(data)
        return self._version

    def check_version(self, expected: int) -> None:
        """The per-rollout check: raises VersionMismatch unless at ``expected``."""
        if self._version != expected:
            raise VersionMismatch(f"replica is at version {self._version}, the trainer "
                                  f"published {expected}")


PATHS = ("auto", "host", "device")


def resolve_path(path: str, params: Any) -> str:
    """"host" or "device" for a sender / replica of ``path`` holding ``params``: "auto" is
    "device" when the leaves live on an accelerator (GPU/TPU), else the host numpy path."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}; valid: {PATHS}")
    if path == "auto":
        return "device" if _on_accelerator(params) else "host"
    return path


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
    """One publish: sizes in bytes, times in seconds, changed elements of bf16 leaves.

    ``encode_s``: the cast to bf16, diff, encode and ``to_bytes``; ``dense_bytes``: the size
    of a full payload (computed from shapes and dtypes); ``host_bytes``: what the publish
    moved device -> host (the host path pulls every jax leaf whole, the device path only
    the compacted changes); ``path``: "host" or "device"."""

    base_version: int
    version: int
    codec: str
    payload_bytes: int
    dense_bytes: int
    changed: int
    elements: int
    bound_bytes: float
    encode_s: float
    host_bytes: int = 0
    path: str = "host"

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.elements, 1)

    @property
    def ratio_vs_dense(self) -> float:
        return self.dense_bytes / max(self.payload_bytes, 1)


class SyncSender:
    """The trainer side: snapshot, step-payload history, plans and fan-out.

    Args:
      params: the tree every replica starts from (cast to bf16 here), at ``version``.
      codec: one of ``jaxflow.sync.CODECS``.
      history: step payloads kept for chained catch-up (older replicas get a dense resync).
      path: "host" (the snapshot is host numpy: every publish pulls the tree and diffs it in
        numpy), "device" (the snapshot stays on the params' devices: the cast, diff and
        compaction run there and only the changes reach the host, ``jaxflow.sync.device_diff``)
        or "auto" (device when ``params`` live on an accelerator). Both paths make the same
        payload bytes.
      backend, interpret: the device path's compaction (``device_diff``'s ``backend``).
      copy: ``False``: leaves of ``params`` that need no cast become the snapshot as they are
        (the caller must not modify or donate them).
    """

    def __init__(self, params: Any, *, version: int = 0, codec: str = "auto", history: int = 64,
                 path: str = "auto", backend: str = "auto", interpret: bool = False,
                 copy: bool = True):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; valid: {CODECS}")
        if history < 0:
            raise ValueError(f"history={history}: need >= 0")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version={version!r}: need an int >= 0")
        if backend not in device_diff.BACKENDS:
            raise ValueError(f"backend={backend!r}; valid: {device_diff.BACKENDS}")
        self.codec, self.history = codec, history
        self.path = resolve_path(path, params)
        self.backend, self.interpret = backend, interpret
        if self.path == "device":
            params = _device_tree(params)
            self._snapshot = device_diff.cast_tree(params) if copy else jax.tree.map(
                lambda x: device_diff.cast_tree(x) if jax.numpy.issubdtype(
                    x.dtype, jax.numpy.floating) and x.dtype != jax.numpy.bfloat16 else x,
                params)
        else:
            self._snapshot = to_bf16(params, copy=copy)
        self._version = int(version)
        # Per-leaf digest lanes of the snapshot (jaxflow.sync.digest), computed once and then
        # advanced from each publish's diff in O(changes): the base digest costs no pass.
        self._lanes: np.ndarray | None = None
        self._steps: dict[int, tuple[int, bytes]] = {}  # base version -> (version, bytes)
        self._scratch: dict = {}  # the host diff's buffers, reused across publishes
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
                with_bound: bool = False, copy: bool = True) -> PublishStats:
        """Encodes the change from the snapshot to ``params`` (cast to bf16) as the next
        version (default: current + 1) and makes it the snapshot. Sends nothing.

        ``copy=False`` (host path): bf16 numpy leaves of ``params`` become the snapshot
        without a copy; the caller must not modify them afterwards."""
        version = self._version + 1 if version is None else int(version)
        if version <= self._version:
            raise ValueError(f"version {version} must exceed the current {self._version}")
        t0 = time.perf_counter()
        if self.path == "device":
            found = device_diff.device_diff(
                self._snapshot, _device_tree(params),
                values=device_diff.values_for_codec(self.codec, with_bound),
                backend=self.backend, interpret=self.interpret)
            new, treedef, specs, diffs = found.new, found.treedef, found.specs, found.diffs
        else:
            host_bytes = sum(x.nbytes for x in jax.tree.leaves(params)
                             if isinstance(x, jax.Array))
            new = to_bf16(params, copy=copy)
            treedef, specs, diffs = diff_tree(self._snapshot, new, scratch=self._scratch)
        base_digest = None
        if self.codec != "dense":
            if self._lanes is None:
                self._lanes = digest.tree_lanes(self._snapshot)
            base_digest = digest.combine(treedef, specs, self._lanes)
        payload = encode_diffs(treedef, specs, diffs, base_version=self._version,
                               version=version, codec=self.codec, base_digest=base_digest)
        data = payload.to_bytes()
        if self._lanes is not None:
            if self.path == "device":
                self._lanes += found.lanes_delta  # computed on the device, O(changes)
                for i, (spec, diff) in enumerate(zip(specs, diffs)):
                    if diff.count and spec.dtype != bits.BF16.name:
                        self._lanes[i] = digest.host_lanes(diff.full_new)
            else:
                self._advance_lanes(specs, diffs, jax.tree_util.tree_leaves(new))
        encode_s = time.perf_counter() - t0
        if self.path == "device":
            host_bytes = found.host_bytes + found.fetched_bytes()
        bf16_ids = [i for i, s in enumerate(specs) if s.dtype == bits.BF16.name]
        stats = PublishStats(
            base_version=self._version, version=version, codec=self.codec,
            payload_bytes=len(data),
            dense_bytes=self._dense_size(treedef, specs, version),
            changed=sum(diffs[i].count for i in bf16_ids),
            elements=sum(specs[i].size for i in bf16_ids),
            bound_bytes=entropy_bound_bytes(specs, diffs) if with_bound else float("nan"),
            encode_s=encode_s, host_bytes=int(host_bytes), path=self.path)
        self._steps[self._version] = (version, data)
        for base in sorted(self._steps)[: max(0, len(self._steps) - self.history)]:
            del self._steps[base]
        self._snapshot, self._version, self._digest, self._dense = new, version, None, None
        return stats

    def _advance_lanes(self, specs, diffs, new_leaves) -> None:
        bf16 = [i for i, spec in enumerate(specs)
                if spec.dtype == bits.BF16.name and diffs[i].count]
        # one word per bf16 element: update the changes only, all leaves in one pass
        self._lanes[bf16] += digest.lanes_deltas([diffs[i].positions for i in bf16],
                                                 [diffs[i].old_bits for i in bf16],
                                                 [diffs[i].new_bits for i in bf16])
        for i, (spec, diff) in enumerate(zip(specs, diffs)):
            if diff.count and spec.dtype != bits.BF16.name:
                self._lanes[i] = digest.host_lanes(np.asarray(new_leaves[i]))

    def _dense_size(self, treedef: str, specs, version: int) -> int:
        # The full payload's header differs between versions only in the digits of
        # "version" (base FRESH, no digest): measured once per layout.
        key = (treedef, specs)
        if getattr(self, "_dense_key", None) != key:
            self._dense_key = key
            self._dense_size0 = encoder.dense_payload_size(treedef, specs, version=0)
        return self._dense_size0 + len(str(int(version))) - 1

    def base_digest(self) -> str:
        """``device_digest`` of the snapshot (what the next step payload names as its base)."""
        if self._lanes is None:
            self._lanes = digest.tree_lanes(self._snapshot)
        treedef, _, specs = tree_layout(self._snapshot)
        return digest.combine(treedef, specs, self._lanes)

    def _dense_of(self, params: Any, version: int) -> bytes:
        # base FRESH: a full payload applies from any version (Payload.is_full). The leaves
        # are read whole (from the devices on the device path): this is the resync payload.
        treedef, leaves, specs = tree_layout(params)
        fetched = jax.device_get(leaves)
        empty = np.zeros(0, np.uint16)
        diffs = [LeafDiff(np.zeros(0, np.int64), empty, empty,
                          bits.host_array(leaf).reshape(-1)) for leaf in fetched]
        self._dense = encode_diffs(treedef, specs, diffs, base_version=FRESH, version=version,
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
