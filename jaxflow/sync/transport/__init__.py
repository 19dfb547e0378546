"""Transports: how payload bytes reach a replica (see ``jaxflow.sync.replica``).

  InProcessLink   same process; the replica's params live on the rollout sub-mesh.
  TcpLink         a ReplicaServer in another process / machine, length-prefixed chunked frames.
  StorageChannel  a tensorstore kvstore (file, gcs, s3): payloads, then an atomic manifest;
                  replicas pull.
"""

from jaxflow.sync.transport.inprocess import InProcessLink
from jaxflow.sync.transport.storage import StorageChannel
from jaxflow.sync.transport.tcp import ReplicaServer, TcpLink

__all__ = ["InProcessLink", "ReplicaServer", "StorageChannel", "TcpLink"]
