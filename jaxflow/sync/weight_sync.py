"""The RL trainer's weight sync: trainer f32 params -> bf16 rollout replicas, sparse.

``WeightSync`` composes a :class:`SyncSender` with in-process replicas on the rollout sub-mesh
(plus any extra links: TCP replica processes, ...). ``jaxflow.rl.publish.publish_weights``
uses it when given one (``sync=``); ``SyncConfig`` is the ``sync`` sub-config of an RL
experiment (``--set sync.codec=entropy --set sync.every=4``), and
:class:`jaxflow.rl.grpo.GRPOTrainer` builds and drives its own WeightSync from it (see there).
An RL config's ``sync=None`` (``--set sync=none``) switches weight sync off: the trainer then
publishes its f32 params with a plain dense copy.

    ws = WeightSync(params, rollout_shardings, SyncConfig(codec="auto", every=4))
    for rollout in range(1, rollouts + 1):
        rollout_params = ws.rollout_params()     # version check on every rollout
        ...train on the rollout...
        if ws.due(rollout):
            ws.publish(params, version=step)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from jaxflow.config_domains import COUNT, COUNT0, domains
from jaxflow.sync.codec_registry import check_codec
from jaxflow.sync.replica import (
    FRESH,
    PATHS,
    Link,
    PublishStats,
    Replica,
    VersionMismatch,
    to_bf16,
    tree_digest,
)
from jaxflow.sync.sync_sender import SyncSender
from jaxflow.sync.transport.inprocess import InProcessLink

ON_MISMATCH = ("resync", "error")


@domains(every=COUNT, history=COUNT0, replicas=COUNT)
@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Attributes:
      codec: a ``jaxflow.sync.CODECS`` name. (No weight sync at all is ``sync=None`` in the
        RL configs, not a codec.)
      every: sync every this many trainer publishes. In :class:`jaxflow.rl.grpo.GRPOTrainer` a
        publish ends every rollout, so ``every`` counts ROLLOUTS (RL steps): with policy lag N
        the trainer syncs every ``every * N`` optimizer steps, and the rollouts in between
        sample from the previous synced version.
      history: step payloads kept for chained catch-up of lagging replicas.
      replicas: in-process bf16 replicas on the rollout sub-mesh (the first one serves rollouts).
      on_mismatch: what a rollout does when its replica is not at the published version:
        "resync" (catch it up, then sample) or "error" (raise VersionMismatch).
      bound: also compute the entropy bound of every publish (a study measurement, costs about
        one more encode; ``PublishStats.bound_bytes`` is NaN without it).
      path: where the sender diffs and the replicas apply: "host" (numpy: the tree is pulled
        to the host every publish), "device" (cast, diff and compaction on the trainer's
        devices, only the changes cross to the host; replicas scatter on their devices) or
        "auto" (device on GPU/TPU, host on CPU). Same payload bytes either way.
    """

    codec: str = "auto"
    every: int = 1
    history: int = 64
    replicas: int = 1
    on_mismatch: str = "resync"
    bound: bool = False
    path: str = "auto"

    def __post_init__(self):
        check_codec(self.codec, field="sync.codec")
        for name in ("every", "replicas"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"sync.{name}={getattr(self, name)!r}: need an int >= 1")
        if self.history < 0:
            raise ValueError(f"sync.history={self.history}: need >= 0")
        if self.path not in PATHS:
            raise ValueError(f"sync.path={self.path!r}; valid: {PATHS}")
        if self.on_mismatch not in ON_MISMATCH:
            raise ValueError(f"sync.on_mismatch={self.on_mismatch!r}; valid: {ON_MISMATCH}")


@dataclasses.dataclass(frozen=True)
class SyncRecord:
    """One publish and its delivery: encode stats, wall time of delivering to every link
    (apply + digest verification), and whether every replica equals the trainer's bf16 cast.

    ``stats`` is the publish's PublishStats without the payload bytes (``payload`` empty,
    ``payload_bytes`` kept): a long run's records would otherwise hold every payload (the
    sender's history keeps the recent ones)."""

    stats: PublishStats
    deliver_s: float
    bit_exact: bool
    report: tuple


class WeightSync:
    """A sender, ``config.replicas`` in-process bf16 replicas and any extra ``links``.

    Args:
      params: the weights every replica starts from (f32 trainer params, cast to bf16 here, or
        an already-bf16 tree), at ``version``.
      rollout_shardings: same structure, the rollout sub-mesh's shardings of the replicas.
      fresh: start the in-process replicas as empty templates (version FRESH) instead of
        copies of ``params``; :meth:`catch_up` then gives them a dense resync (see
        :meth:`resume`).
    """

    def __init__(self, params: Any, rollout_shardings: Any, config: SyncConfig = SyncConfig(),
                 *, version: int = 0, links: Sequence[Link] = (), fresh: bool = False):
        self.config = config
        self.sender = SyncSender(params, version=version, codec=config.codec,
                                 history=config.history, path=config.path)
        start = jax.tree.map(np.zeros_like, self.sender.snapshot) if fresh else self.sender.snapshot
        self.replicas = [Replica(start, version=FRESH if fresh else version,
                                 shardings=rollout_shardings, path=config.path)
                         for _ in range(config.replicas)]
        self.links: list[Link] = [InProcessLink(r) for r in self.replicas] + list(links)
        self.records: list[SyncRecord] = []

    @classmethod
    def resume(cls, bf16_params: Any, rollout_shardings: Any, config: SyncConfig, *,
               version: int, links: Sequence[Link] = ()) -> "WeightSync":
        """A WeightSync rebuilt at ``version`` from that version's bf16 weights (e.g. the
        rollout params a checkpoint holds): new, empty replicas receive a dense resync through
        the payload path, and every link (e.g. replica processes that outlived the trainer) is
        brought to ``version``. Raises RuntimeError when a link cannot be reached."""
        ws = cls(bf16_params, rollout_shardings, config, version=version, links=links,
                 fresh=True)
        ws.catch_up()
        return ws

    def catch_up(self) -> list[dict]:
        """Brings every link to the sender's version (nothing to send for those already
        there); RuntimeError naming the failed links otherwise."""
        report = self.sender.sync_all(self.links)
        failed = [r for r in report if not r["ok"]]
        if failed:
            raise RuntimeError(f"weight sync: links failed to reach version {self.version}: "
                               f"{failed}")
        return report

    @property
    def version(self) -> int:
        """The version last published."""
        return self.sender.version

    def due(self, step: int) -> bool:
        """Whether training step ``step`` publishes (every ``config.every`` steps)."""
        return step % self.config.every == 0

    def publish(self, params: Any, *, version: int,
                with_bound: bool | None = None) -> SyncRecord:
        """Encodes ``params`` (the trainer's f32 tree; cast to bf16 here) as ``version`` and
        delivers it to every link. A failed link stays behind (reported in ``report``) and is
        caught up at its next sync; ``bit_exact`` checks every successful replica's digest
        against an independent hash of the trainer's bf16 cast. ``with_bound`` defaults to
        ``config.bound``. Returns the record it appended to ``records`` (read it instead of
        counting records)."""
        with_bound = self.config.bound if with_bound is None else with_bound
        stats = self.sender.publish(params, version=version, with_bound=with_bound)
        t0 = time.perf_counter()
        report = self.sender.sync_all(self.links)
        deliver_s = time.perf_counter() - t0
        expected = tree_digest(to_bf16(params))
        digests = [link.status()[1] for link, r in zip(self.links, report) if r["ok"]]
        record = SyncRecord(dataclasses.replace(stats, payload=b""), deliver_s,
                            all(d == expected for d in digests) and len(digests) == len(self.links),
                            tuple(report))
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


__all__ = ["ON_MISMATCH", "SyncConfig", "SyncRecord", "VersionMismatch",
           "WeightSync"]
