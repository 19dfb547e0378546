"""The RL trainer's weight sync: trainer f32 params -> bf16 rollout replicas, sparse.

``WeightSync`` composes a :class:`SyncSender` with in-process replicas on the rollout sub-mesh
(plus any extra links: TCP replica processes, ...). ``jaxflow.rl.publish.publish_weights``
uses it when given one (``sync=``); ``SyncConfig`` is the ``sync`` sub-config of an RL
experiment (``--set sync.codec=entropy --set sync.every=4``).

    ws = WeightSync(params, rollout_shardings, SyncConfig(codec="auto", every=4))
    for step in range(1, steps + 1):
        rollout_params = ws.rollout_params()     # version check on every rollout
        ...train one step...
        if ws.due(step):
            ws.publish(params, version=step)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jaxflow.sync.encoder import CODECS
from jaxflow.sync.replica import (Link, PublishStats, Replica, SyncSender, VersionMismatch,
                                  tree_digest, to_bf16)
from jaxflow.sync.transport.inprocess import InProcessLink

ON_MISMATCH = ("resync", "error")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Attributes:
      codec: a ``jaxflow.sync.CODECS`` name.
      every: publish every this many optimizer steps (rollouts in between use older weights).
      history: step payloads kept for chained catch-up of lagging replicas.
      replicas: in-process bf16 replicas on the rollout sub-mesh (the first one serves rollouts).
      on_mismatch: what a rollout does when its replica is not at the published version:
        "resync" (catch it up, then sample) or "error" (raise VersionMismatch).
    """

    codec: str = "auto"
    every: int = 1
    history: int = 64
    replicas: int = 1
    on_mismatch: str = "resync"

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"sync.codec={self.codec!r}; valid: {CODECS}")
        for name in ("every", "replicas"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"sync.{name}={getattr(self, name)!r}: need an int >= 1")
        if self.history < 0:
            raise ValueError(f"sync.history={self.history}: need >= 0")
        if self.on_mismatch not in ON_MISMATCH:
            raise ValueError(f"sync.on_mismatch={self.on_mismatch!r}; valid: {ON_MISMATCH}")


@dataclasses.dataclass(frozen=True)
class SyncRecord:
    """One publish and its delivery: encode stats, wall time of delivering to every link
    (apply + digest verification), and whether every replica equals the trainer's bf16 cast."""

    stats: PublishStats
    deliver_s: float
    bit_exact: bool
    report: tuple


class WeightSync:
    def __init__(self, params: Any, rollout_shardings: Any, config: SyncConfig = SyncConfig(),
                 *, version: int = 0, links: Sequence[Link] = ()):
        self.config = config
        self.sender = SyncSender(params, version=version, codec=config.codec,
                                 history=config.history)
        self.replicas = [Replica(self.sender.snapshot, version=version,
                                 shardings=rollout_shardings) for _ in range(config.replicas)]
        self.links: list[Link] = [InProcessLink(r) for r in self.replicas] + list(links)
        self.records: list[SyncRecord] = []

    @property
    def version(self) -> int:
        return self.sender.version

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def publish(self, params: Any, *, version: int, with_bound: bool = False) -> SyncRecord:
        """Encodes ``params`` (the trainer's f32 tree; cast to bf16 here) as ``version`` and
        delivers it to every link. A failed link stays behind (reported in ``report``) and is
        caught up at its next sync; ``bit_exact`` checks every successful replica's digest
        against an independent hash of the trainer's bf16 cast."""
        stats = self.sender.publish(params, version=version, with_bound=with_bound)
        t0 = time.perf_counter()
        report = self.sender.sync_all(self.links)
        deliver_s = time.perf_counter() - t0
        expected = tree_digest(to_bf16(params))
        digests = [link.status()[1] for link, r in zip(self.links, report) if r["ok"]]
        record = SyncRecord(stats, deliver_s, all(d == expected for d in digests)
                            and len(digests) == len(self.links), tuple(report))
        self.records.append(record)
        return record

    def rollout_params(self, replica: int = 0) -> Any:
        """The bf16 params a rollout samples with, after the per-rollout version check."""
        link, rep = self.links[replica], self.replicas[replica]
        if rep.version != self.sender.version:
            if self.config.on_mismatch == "error":
                rep.check_version(self.sender.version)
            self.sender.sync(link)
        return rep.params


__all__ = ["ON_MISMATCH", "SyncConfig", "SyncRecord", "VersionMismatch", "WeightSync"]
