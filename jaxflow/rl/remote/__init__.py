"""GRPO's trainer and rollout as two separate jobs, joined only by SparseRL-Sync.

The rollout job (:mod:`.server`) holds a bf16 replica that the trainer's SparseRL-Sync
payloads update over TCP and samples what the trainer asks for; the trainer (:mod:`.client`)
publishes through the sync and asks for rollouts over a small control protocol
(:mod:`.protocol`). ``python -m jaxflow.run --exp=flagship --set remote.role=...`` runs either
side.
"""

from jaxflow.rl.remote.client import RemoteParams, RemoteRollout
from jaxflow.rl.remote.protocol import RemoteConfig, RolloutLost, RolloutRefused
from jaxflow.rl.remote.server import RolloutService

__all__ = ["RemoteConfig", "RemoteParams", "RemoteRollout", "RolloutLost", "RolloutRefused",
           "RolloutService"]
