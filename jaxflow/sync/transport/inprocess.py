"""In-process transport: the replica is an object in this process (its params on the rollout
sub-mesh, see ``Replica(shardings=...)``); bytes are handed over without a copy."""

from __future__ import annotations

from typing import Callable

from jaxflow.sync.replica import Replica


class InProcessLink:
    """A link to a replica in the same process: payloads are applied directly."""
    def __init__(self, replica: Replica):
        self.replica = replica

    def status(self) -> tuple[int, str]:
        """The replica's (version, digest)."""
        return self.replica.version, self.replica.digest()

    def sync(self, plan: Callable[[int], list[bytes]]) -> tuple[int, str]:
        """Apply ``plan(replica version)``'s payloads in order; returns the new (version, digest)."""
        for data in plan(self.replica.version):
            self.replica.receive(data)
        return self.status()
