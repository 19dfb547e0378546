"""Storage transport over a tensorstore kvstore (``{"driver": "file", "path": ...}`` in tests;
the same spec with ``gcs`` / ``s3`` reaches object stores) for cross-cluster sync.

The trainer writes each payload under a fresh unique key and only then rewrites the small
``MANIFEST.json`` (one key write, atomic in every kvstore driver) that names the current
version, the step payloads (base -> version, key, bytes) and a dense snapshot. A reader
therefore never sees a payload the manifest names before it was completely written; a writer
killed mid-payload leaves an orphan key that no manifest names. Replicas pull: the chain of
step payloads from their version, or the dense snapshot plus the chain after it, whichever is
smaller; a payload that fails its checksum makes the pull fall back to the dense route, and
the replica stays on its previous version if that fails too.
"""

from __future__ import annotations

import json
import uuid
import tensorstore as ts

from jaxflow.sync.payload import Payload, PayloadError
from jaxflow.sync.replica import Replica, SyncSender

MANIFEST = "MANIFEST.json"


def _spec(spec: str | dict) -> dict:
    if isinstance(spec, str):
        return {"driver": "file", "path": spec.rstrip("/") + "/"}
    return dict(spec)


class StorageChannel:
    """Args:
      spec: a kvstore spec dict, or a local directory path (file driver).
      dense_every: write a dense snapshot every this many published versions (and first).
      history: step payloads named in the manifest.
    """

    def __init__(self, spec: str | dict, *, dense_every: int = 16, history: int = 64):
        if dense_every < 1:
            raise ValueError(f"dense_every={dense_every}: need >= 1")
        self.kv = ts.KvStore.open(_spec(spec)).result()
        self.dense_every, self.history = dense_every, history
        self._publishes = 0

    # -- trainer side ------------------------------------------------------------------

    def _put(self, prefix: str, data: bytes) -> str:
        key = f"{prefix}-{uuid.uuid4().hex[:12]}.bin"
        self.kv.write(key, data).result()
        return key

    def write(self, sender: SyncSender) -> dict:
        """Publishes the sender's newest step payload (and a dense snapshot when due), then
        the manifest. Returns the manifest."""
        manifest = self.read_manifest() or {"version": None, "steps": [], "dense": None}
        steps, last = list(manifest["steps"]), manifest["version"]
        chain = sender.chain_from(last) if last is not None else None
        if chain is None:
            steps = []  # first write, or the sender's history lost our last version
        for data in chain or []:
            nxt = _target(data)
            steps.append({"base": last, "version": nxt, "bytes": len(data),
                          "key": self._put(f"steps/{last}-{nxt}", data)})
            last = nxt
        steps = steps[-self.history:] if self.history else []
        dense = manifest["dense"]
        if (dense is None or chain is None or self._publishes % self.dense_every == 0
                or self._chain(steps, dense["version"], sender.version) is None):
            data = sender.dense_payload()
            dense = {"version": sender.version, "bytes": len(data),
                     "key": self._put(f"dense/{sender.version}", data)}
        self._publishes += 1
        manifest = {"version": sender.version, "digest": sender.digest(), "dense": dense,
                    "steps": steps}
        self.kv.write(MANIFEST, json.dumps(manifest).encode()).result()
        return manifest

    # -- replica side ------------------------------------------------------------------

    def read_manifest(self) -> dict | None:
        r = self.kv.read(MANIFEST).result()
        return json.loads(bytes(r.value).decode()) if r.state == "value" else None

    def _get(self, entry: dict) -> bytes:
        r = self.kv.read(entry["key"]).result()
        if r.state != "value":
            raise PayloadError(f"payload {entry['key']} named by the manifest is missing")
        data = bytes(r.value)
        if len(data) != entry["bytes"]:
            raise PayloadError(f"payload {entry['key']} has {len(data)} bytes, manifest says "
                               f"{entry['bytes']}")
        return data

    def _chain(self, steps: list[dict], start: int, end: int) -> list[dict] | None:
        by_base = {s["base"]: s for s in steps}
        out, v = [], start
        while v != end:
            if v not in by_base:
                return None
            out.append(by_base[v])
            v = by_base[v]["version"]
        return out

    def pull(self, replica: Replica) -> int:
        """Brings ``replica`` to the manifest's version; returns it. Raises PayloadError (the
        replica on its last good version) when neither route works."""
        m = self.read_manifest()
        if m is None or replica.version == m["version"]:
            return replica.version
        routes = []
        chain = self._chain(m["steps"], replica.version, m["version"])
        dense_chain = self._chain(m["steps"], m["dense"]["version"], m["version"])
        if dense_chain is not None:
            routes.append([m["dense"], *dense_chain])
        if chain is not None:
            size = lambda r: sum(e["bytes"] for e in r)
            routes.insert(0 if not routes or size(chain) <= size(routes[0]) else 1, chain)
        errors = []
        for route in routes:
            try:
                for entry in route:
                    replica.receive(self._get(entry))
                return replica.version
            except PayloadError as e:
                errors.append(str(e))
        raise PayloadError(f"replica stays at version {replica.version}: {errors}")

    def status(self, replica: Replica) -> tuple[int, str]:
        return replica.version, replica.digest()


def _target(data: bytes) -> int:
    return Payload.from_bytes(data).version
