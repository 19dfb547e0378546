"""Storage transport over a tensorstore kvstore (``{"driver": "file", "path": ...}`` in tests;
the same spec with ``gcs`` / ``s3`` reaches object stores) for cross-cluster sync.

The trainer writes each payload under a fresh unique key and only then the small manifest
that names the current version, the step payloads (base -> version, key, bytes) and a dense
snapshot. A reader therefore never sees a payload the manifest names before it was completely
written; a writer killed mid-payload leaves an orphan key that no manifest names.

The manifest itself is written write-then-rename style (kvstores have no rename, so: write,
then commit): first complete and sealed (blake2b of its JSON) under a fresh history key
``manifests/<seq>-<id>.json``, then the same bytes as ``MANIFEST.json`` (one single-key write).
Readers and the writer verify the seal; when ``MANIFEST.json`` is missing, truncated or
corrupt they recover from the newest good manifest in the history (the last ``keep_manifests``
are kept), so a damaged manifest never wedges the channel: the next ``write`` replaces it.

Replicas pull: the chain of step payloads from their version, or the dense snapshot plus the
chain after it, whichever is smaller; a payload that fails its checksum makes the pull fall
back to the dense route, and the replica stays on its previous version if that fails too.
"""

from __future__ import annotations

import hashlib
import json
import uuid

import tensorstore as ts

from jaxflow.sync.payload import Payload, PayloadError
from jaxflow.sync.replica import Replica
from jaxflow.sync.sync_sender import SyncSender

MANIFEST = "MANIFEST.json"
HISTORY = "manifests/"
_MANIFEST_KEYS = {"seq", "version", "digest", "dense", "steps"}


def _spec(spec: str | dict) -> dict:
    if isinstance(spec, str):
        return {"driver": "file", "path": spec.rstrip("/") + "/"}
    return dict(spec)


class StorageChannel:
    """Args:
      spec: a kvstore spec dict, or a local directory path (file driver).
      dense_every: write a dense snapshot every this many published versions (and first).
      history: step payloads named in the manifest.
      keep_manifests: sealed manifests kept under ``manifests/`` to recover from.

    Attributes:
      recovered: after a read that had to fall back, the history key it recovered from and
        why (else None).
    """

    def __init__(self, spec: str | dict, *, dense_every: int = 16, history: int = 64,
                 keep_manifests: int = 8):
        if dense_every < 1:
            raise ValueError(f"dense_every={dense_every}: need >= 1")
        if keep_manifests < 1:
            raise ValueError(f"keep_manifests={keep_manifests}: need >= 1")
        self.kv = ts.KvStore.open(_spec(spec)).result()
        self.dense_every, self.history, self.keep_manifests = dense_every, history, keep_manifests
        self._publishes = 0
        self.recovered: tuple[str, str] | None = None

    # -- trainer side ------------------------------------------------------------------

    def _put(self, prefix: str, data: bytes) -> str:
        key = f"{prefix}-{uuid.uuid4().hex[:12]}.bin"
        self.kv.write(key, data).result()
        return key

    def write(self, sender: SyncSender) -> dict:
        """Publishes the sender's newest step payload (and a dense snapshot when due), then
        the manifest. Returns the manifest."""
        try:
            manifest = self.read_manifest()
        except PayloadError:  # nothing readable: start over (a dense snapshot, new steps)
            manifest = None
        if manifest is None:
            manifest = {"seq": self._last_seq(), "version": None, "steps": [], "dense": None}
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
        manifest = {"seq": manifest["seq"] + 1, "version": sender.version,
                    "digest": sender.digest(), "dense": dense, "steps": steps}
        self._commit(manifest)
        return manifest

    def _commit(self, manifest: dict) -> None:
        """Write (sealed, under a fresh history key), then commit as MANIFEST.json; prune."""
        data = _seal(manifest)
        self.kv.write(f"{HISTORY}{manifest['seq']:012d}-{uuid.uuid4().hex[:12]}.json",
                      data).result()
        self.kv.write(MANIFEST, data).result()
        for key in self._history_keys()[: -self.keep_manifests]:
            self.kv.delete_range(ts.KvStore.KeyRange(key, key + b"\x00")).result()

    def _last_seq(self) -> int:
        seqs = [key[len(HISTORY):].split(b"-")[0] for key in self._history_keys()]
        return max((int(s) for s in seqs if s.isdigit()), default=0)

    def _history_keys(self) -> list[bytes]:
        prefix = HISTORY.encode()
        return sorted(self.kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + b"0")).result())

    # -- replica side ------------------------------------------------------------------

    def read_manifest(self) -> dict | None:
        """The committed manifest, or when MANIFEST.json is missing or damaged the newest
        good one in the history (``self.recovered`` says which); None when nothing was ever
        published. Raises PayloadError when manifests exist but none is readable."""
        self.recovered = None
        r = self.kv.read(MANIFEST).result()
        if r.state == "value":
            try:
                return _unseal(bytes(r.value))
            except PayloadError as e:
                problem = f"{MANIFEST}: {e}"
        else:
            problem = f"{MANIFEST} missing"
        errors = []
        for key in reversed(self._history_keys()):
            h = self.kv.read(key).result()
            try:
                manifest = _unseal(bytes(h.value)) if h.state == "value" else None
            except PayloadError as e:
                errors.append(f"{key.decode()}: {e}")
                continue
            if manifest is not None:
                self.recovered = (key.decode(), problem)
                return manifest
        if r.state != "value" and not errors:
            return None  # nothing published yet
        raise PayloadError(f"no readable manifest: {problem}; history: {errors or 'empty'}")

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
        try:
            m = self.read_manifest()
        except PayloadError as e:
            raise PayloadError(f"replica stays at version {replica.version}: {e}") from None
        if m is None or replica.version == m["version"]:
            return replica.version
        routes = []
        chain = self._chain(m["steps"], replica.version, m["version"])
        dense_chain = self._chain(m["steps"], m["dense"]["version"], m["version"])
        if dense_chain is not None:
            routes.append([m["dense"], *dense_chain])
        if chain is not None:
            first = 0 if not routes or _route_bytes(chain) <= _route_bytes(routes[0]) else 1
            routes.insert(first, chain)
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
        """``replica``'s (version, digest)."""
        return replica.version, replica.digest()


def _seal(manifest: dict) -> bytes:
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return json.dumps({"manifest": manifest, "blake2b": hashlib.blake2b(
        body.encode(), digest_size=16).hexdigest()}, sort_keys=True).encode()


def _unseal(data: bytes) -> dict:
    """The manifest in ``data`` after checking its seal; PayloadError if damaged."""
    try:
        outer = json.loads(data.decode("utf-8"))
        manifest, seal = outer["manifest"], outer["blake2b"]
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise PayloadError(f"manifest unreadable ({type(e).__name__}: {e})") from None
    if hashlib.blake2b(body.encode(), digest_size=16).hexdigest() != seal:
        raise PayloadError("manifest seal mismatch (damaged)")
    if not isinstance(manifest, dict) or set(manifest) != _MANIFEST_KEYS:
        raise PayloadError(f"manifest keys invalid: expected {sorted(_MANIFEST_KEYS)}")
    return manifest


def _target(data: bytes) -> int:
    return Payload.from_bytes(data).version


def _route_bytes(route: list[dict]) -> int:
    """Total bytes of a route's manifest entries (the payloads a replica would read)."""
    return sum(e["bytes"] for e in route)
