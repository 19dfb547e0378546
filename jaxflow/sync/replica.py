"""Replicas: versioned bf16 weights that verify every payload before writing, catch-up and
recovery.

A :class:`Replica` verifies each payload completely before writing and advances its version
only after a successful apply, so a transfer that dies mid-way leaves it on its previous
version and the next sync continues from there. A :class:`Link` is a sender's view of one
replica, whatever carries the bytes; the sender side (:class:`jaxflow.sync.sync_sender.SyncSender`)
plans, for a replica at version ``v``, either the chain of step payloads from ``v`` or one dense
resync, whichever is fewer bytes, and fans them out over links::

    sender = SyncSender(bf16(params0), version=0, codec="auto")
    replicas = [Replica(bf16(params0), version=0) for _ in range(2)]
    links = [InProcessLink(r) for r in replicas]             # or TcpLink / StorageChannel
    sent = sender.publish(bf16(params), version=4)           # sent.payload: the step payload
    report = sender.sync_all(links)                            # per link: version, digest, route

Transports (``jaxflow.sync.transport``) only move payload bytes; every route ends in
``Replica.receive``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import numpy as np

from jaxflow.sync.payload import FRESH, Payload
from jaxflow.sync.receiver import apply, check_applicable
from jaxflow.sync.sender import PublishStats, SenderState
from jaxflow.sync.wire import PATHS, on_accelerator, resolve_path, to_bf16, tree_digest


class VersionMismatch(RuntimeError):
    """A rollout found its replica at another version than the trainer published."""


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
        """The version of the parameters the replica holds."""
        return self._version

    @property
    def params(self) -> Any:
        """The replica's current bf16 parameters."""
        return self._params

    def digest(self) -> str:
        """``tree_digest`` of the replica's parameters."""
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
        on_device = (on_accelerator(self._params) if self.path == "auto"
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


class Link(Protocol):
    """A sender's view of one replica, whatever carries the bytes."""

    def sync(self, plan: Callable[[int], list[bytes]]) -> tuple[int, str]:
        """Asks the replica's version v, sends ``plan(v)`` in order, returns (version, digest)."""

    def status(self) -> tuple[int, str]:
        """(version, digest) of the replica."""


__all__ = ["FRESH", "PATHS", "Link", "PublishStats", "Replica", "SenderState", "VersionMismatch",
           "is_full", "resolve_path", "to_bf16", "tree_digest"]
