"""SparseRL-Sync: lossless sparse bf16 weight synchronisation between trainer and rollout.

    payload = sync.encode(receiver_snapshot, trainer_bf16, base_version=3, version=4)
    wire = payload.to_bytes()
    params = sync.apply(sync.Payload.from_bytes(wire), params, version=3)   # now version 4

Modules: bits (bit views), diff (tree diff), tracker (in-mesh change tracking), codecs and
entropy (section formats), payload (wire format), encoder / receiver (encode / apply),
bound (entropy bound), baseline (PULSE-style codec), replica (sender / replicas, catch-up) and transport/ (in-process, TCP, storage).
"""

from jaxflow.sync.encoder import CODECS, encode, encode_diffs
from jaxflow.sync.receiver import apply
from jaxflow.sync.payload import Payload, PayloadError
from jaxflow.sync.tracker import ChangeTracker, CompactBackend
from jaxflow.sync.replica import (FRESH, PublishStats, Replica, SyncSender, VersionMismatch,
                                  to_bf16, tree_digest)
from jaxflow.sync.weight_sync import OFF, SYNC_CODECS, SyncConfig, WeightSync

__all__ = ["CODECS", "FRESH", "OFF", "SYNC_CODECS", "ChangeTracker", "CompactBackend", "Payload", "PayloadError",
           "PublishStats", "Replica", "SyncConfig", "SyncSender", "VersionMismatch", "apply", "encode",
           "WeightSync", "encode_diffs", "to_bf16", "tree_digest"]
