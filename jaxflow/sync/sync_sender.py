"""The trainer side of weight sync as an object: :class:`SyncSender`, plans and fan-out to links.

A :class:`SyncSender` holds a :class:`jaxflow.sync.sender.SenderState` -- the last synced bf16
snapshot, the recent step payloads (each takes version ``b`` to the next synced version), the
digest lanes -- and calls the pure functions of ``jaxflow.sync.sender`` on it. For a replica at
version ``v`` it :meth:`~SyncSender.plan` s either the chain of step payloads from ``v`` or one
dense resync, whichever is fewer bytes (dense when ``v`` fell out of the history, or the replica
is fresh), and :meth:`~SyncSender.sync_all` fans them out over :class:`jaxflow.sync.replica.Link`
s, checking every replica's digest against the snapshot::

    sender = SyncSender(bf16(params0), version=0, codec="auto")
    sent = sender.publish(bf16(params), version=4)           # sent.payload: the step payload
    report = sender.sync_all(links)                            # per link: version, digest, route
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxflow.errors import one_line
from jaxflow.sync import sender as sender_fns
from jaxflow.sync.payload import PayloadError
from jaxflow.sync.replica import Link, VersionMismatch
from jaxflow.sync.sender import PublishStats, SenderState


class SyncAllError(RuntimeError):
    """A link raised an error that is not a link failure; ``report``: every link's outcome."""

    def __init__(self, message: str, report: list[dict]):
        super().__init__(message)
        self.report = report


class SyncSender:
    """The trainer side: a :class:`SenderState` plus plans and fan-out to links.

    A thin stateful wrapper over ``jaxflow.sync.sender``: every method replaces ``state``
    with what the pure function returned. It also holds the host diff's work buffers
    (``scratch``) and ``routes``, the route of every plan ("chain" / "dense" / "current"),
    for reports.

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
        self._state = sender_fns.sender_state(params, version=version, codec=codec,
                                              history=history, path=path, backend=backend,
                                              interpret=interpret, copy=copy)
        self._scratch: dict = {}  # the host diff's buffers, reused across publishes
        self.routes: list[str] = []

    @property
    def state(self) -> SenderState:
        """The current :class:`SenderState` (a value: later calls replace it)."""
        return self._state

    @property
    def version(self) -> int:
        """The version of the last published snapshot."""
        return self._state.version

    @property
    def snapshot(self) -> Any:
        """The bf16 tree at ``version`` (what the replicas hold once in sync)."""
        return self._state.snapshot

    @property
    def codec(self) -> str:
        """The payload codec (one of ``CODECS``)."""
        return self._state.codec

    @property
    def history(self) -> int:
        """How many step payloads are kept for replicas catching up."""
        return self._state.history

    @property
    def path(self) -> str:
        """Where the diff runs: ``host`` or ``device`` (resolved, never ``auto``)."""
        return self._state.path

    @property
    def backend(self) -> str:
        """The device path's compaction backend."""
        return self._state.backend

    @property
    def interpret(self) -> bool:
        """Whether the device path's Pallas kernel runs in interpret mode."""
        return self._state.interpret

    def digest(self) -> str:
        """``tree_digest`` of the snapshot (computed once per version)."""
        self._state = sender_fns.with_digest(self._state)
        return self._state.digest

    def publish(self, params: Any, *, version: int | None = None,
                with_bound: bool = False, copy: bool = True) -> PublishStats:
        """Encodes the change from the snapshot to ``params`` (cast to bf16) as the next
        version (default: current + 1) and makes it the snapshot. Sends nothing; returns
        what it encoded (``PublishStats.payload``: the step payload's bytes).

        ``copy=False`` (host path): bf16 numpy leaves of ``params`` become the snapshot
        without a copy; the caller must not modify them afterwards."""
        self._state, stats = sender_fns.publish(self._state, params, version=version,
                                                with_bound=with_bound, copy=copy,
                                                scratch=self._scratch)
        return stats

    def base_digest(self) -> str:
        """``device_digest`` of the snapshot (what the next step payload names as its base)."""
        self._state = sender_fns.with_lanes(self._state)
        return sender_fns.base_digest(self._state)

    def dense_payload(self) -> bytes:
        """A full payload of the current version (applies from any version)."""
        self._state = sender_fns.with_dense_payload(self._state)
        return self._state.dense

    def chain_from(self, version: int) -> list[bytes] | None:
        """Step payloads from ``version`` to the current one, or None if not in the history."""
        return sender_fns.chain_from(self._state, version)

    def plan(self, replica_version: int) -> list[bytes]:
        """What to send a replica at ``replica_version``: nothing, the chain, or a dense
        resync, whichever is smallest."""
        self._state, route, payloads = sender_fns.plan(self._state, replica_version)
        self.routes.append(route)
        return payloads

    def sync(self, link: Link) -> tuple[int, str]:
        """Brings one replica to the current version; raises if it ends elsewhere or its
        digest differs from the snapshot's (bit-exactness)."""
        version, digest = link.sync(self.plan)
        if version != self.version:
            raise VersionMismatch(f"replica ended at {version}, sender is at {self.version}")
        if digest != self.digest():
            raise PayloadError(f"replica digest {digest} != sender digest {self.digest()} at "
                               f"version {version}")
        return version, digest

    def sync_all(self, links: Sequence[Link]) -> list[dict]:
        """Fan-out: syncs every link; a failing link is reported (and left behind, to be
        caught up next time) instead of stopping the others.

        Returns one entry per link, in order: ``{"link": i, "ok": True, "version", "route"}``
        or ``{"link": i, "ok": False, "error": "<ExceptionType>: <message>"}`` (one line). A
        link fails with an OSError (connection, timeout, or a malformed reply: ``TcpLink``
        raises a FrameError naming the replica and what is wrong with its reply), PayloadError
        or VersionMismatch.

        Raises:
          SyncAllError: a link raised anything else (a link breaking its contract, or a bug);
            raised only after every link was tried, naming the first such link and its error
            in one line, with the full report as ``.report``.
        """
        report, unexpected = [], None
        for i, link in enumerate(links):
            try:
                version, _ = self.sync(link)
                report.append({"link": i, "ok": True, "version": version,
                               "route": self.routes[-1]})
            except (OSError, PayloadError, VersionMismatch, TimeoutError) as e:
                report.append({"link": i, "ok": False, "error": _one_line_error(e)})
            except Exception as e:  # noqa: BLE001 -- re-raised below, after the other links
                report.append({"link": i, "ok": False, "error": _one_line_error(e)})
                unexpected = unexpected or (i, link, e)
        if unexpected is not None:
            i, link, e = unexpected
            synced = [r["link"] for r in report if r["ok"]]
            raise SyncAllError(
                f"sync_all: link {i} ({getattr(link, 'name', type(link).__name__)}) raised "
                f"{_one_line_error(e)}; links synced: {synced}", report) from e
        return report


def _one_line_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(e)}"


__all__ = ["SyncAllError", "SyncSender"]
