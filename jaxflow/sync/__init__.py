"""SparseRL-Sync: lossless sparse bf16 weight synchronisation between trainer and rollout.

    payload = sync.encode(receiver_snapshot, trainer_bf16, base_version=3, version=4)
    wire = payload.to_bytes()
    params = sync.apply(sync.Payload.from_bytes(wire), params, version=3)   # now version 4

A delta payload carries the on-device digest of the tree it was encoded against and applies
only to that tree at its base version; a malformed or inapplicable payload raises
PayloadError before anything is written. Wire format (version 2): docs/sync_payload_format.md.

Modules: bits (bit views), diff (tree diff), digest (on-device base-tree digest), tracker
(in-mesh change tracking), device_diff (the sender's cast / diff / compaction on the devices),
codec_registry (the codec names and their one check), codecs and entropy (section formats),
payload (wire format), encoder / receiver (encode / apply), bound (entropy bound), baseline
(PULSE-style codec), sender (the sender as a value: ``SenderState``, a pure ``publish``),
sync_sender (``SyncSender``: plans and fan-out to links; ``path="host" | "device" | "auto"``),
replica (replicas, catch-up), programs (a publish's device programs for
``--compile-only``), host_kernels (the host path's compiled diff,
Rice / value-bit coders and digest lanes; numba, each with a numpy twin giving the same
bytes) and transport/ (in-process, TCP, storage).
The zstd-coded sections import ``zstandard`` on first use: without it, ``dense``, ``coo``
and ``gap`` still work.
"""

from jaxflow.sync.codec_registry import CODECS, check_codec
from jaxflow.sync.digest import device_digest
from jaxflow.sync.encoder import encode, encode_diffs
from jaxflow.sync.payload import Payload, PayloadError
from jaxflow.sync.receiver import apply
from jaxflow.sync.replica import FRESH, PublishStats, Replica, VersionMismatch, to_bf16, tree_digest
from jaxflow.sync.sync_sender import SyncSender
from jaxflow.sync.tracker import ChangeTracker, CompactBackend
from jaxflow.sync.weight_sync import SyncConfig, WeightSync

__all__ = ["CODECS", "FRESH", "ChangeTracker", "CompactBackend", "Payload", "PayloadError",
           "PublishStats", "Replica", "SyncConfig", "SyncSender", "VersionMismatch", "apply", "check_codec",
           "device_digest", "encode", "WeightSync", "encode_diffs", "to_bf16", "tree_digest"]
