"""The wire format: a self-describing, checksummed sync payload.

Layout of ``Payload.to_bytes()``::

    b"JFSYNC\\x00\\x01" | header length (u32 LE) | header (JSON, utf-8) | body | blake2b-128

The header names the base and target versions, the codec, the tree structure, every leaf's
name / dtype / shape, and the sections. A section is one codec's encoding of one leaf (dense,
exact, mask) or of a bucket of leaves (coo, gap, entropy); its streams lie back to back in the
body in header order. The digest covers everything before it, so any flipped or missing byte
is caught in ``from_bytes`` before a single stream is decoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any

MAGIC = b"JFSYNC\x00\x01"
FORMAT_VERSION = 1
_DIGEST_SIZE = 16
_HEADER_LEN = struct.Struct("<I")

SECTION_KINDS = ("dense", "exact", "mask", "coo", "gap", "entropy")


class PayloadError(ValueError):
    """A payload was rejected: corrupt, truncated, or not applicable to the receiver's params.

    Raised before any parameter is touched; the receiver keeps its params and its version.
    """


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One leaf of the synced tree: its key path, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        size = 1
        for dim in self.shape:
            size *= dim
        return size


@dataclasses.dataclass(frozen=True)
class Section:
    """One codec's encoding of one leaf or a bucket of leaves.

    Attributes:
      kind: one of SECTION_KINDS.
      leaves: indices into ``Payload.leaves``; a bucket's flat position space is the
        concatenation of these leaves in this order.
      meta: small JSON-able codec parameters (counts, widths).
      streams: the section's byte streams.
    """

    kind: str
    leaves: tuple[int, ...]
    meta: dict[str, Any]
    streams: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class Payload:
    """A sync message taking a receiver from ``base_version`` to ``version``."""

    base_version: int
    version: int
    codec: str
    treedef: str
    leaves: tuple[LeafSpec, ...]
    sections: tuple[Section, ...]

    @property
    def num_bytes(self) -> int:
        return len(self.to_bytes())

    def to_bytes(self) -> bytes:
        header = {
            "format": FORMAT_VERSION,
            "base_version": int(self.base_version),
            "version": int(self.version),
            "codec": self.codec,
            "treedef": self.treedef,
            "leaves": [[l.name, l.dtype, list(l.shape)] for l in self.leaves],
            "sections": [
                {"kind": s.kind, "leaves": list(s.leaves), "meta": s.meta,
                 "streams": [len(b) for b in s.streams]}
                for s in self.sections
            ],
        }
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
        parts = [MAGIC, _HEADER_LEN.pack(len(head)), head]
        parts += [bytes(b) for s in self.sections for b in s.streams]
        blob = b"".join(parts)
        return blob + hashlib.blake2b(blob, digest_size=_DIGEST_SIZE).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Payload":
        """Parses and verifies a payload; raises PayloadError on any defect."""
        data = memoryview(data if isinstance(data, (bytes, bytearray)) else bytes(data))
        fixed = len(MAGIC) + _HEADER_LEN.size + _DIGEST_SIZE
        if len(data) < fixed:
            raise PayloadError(f"payload truncated: {len(data)} bytes, need at least {fixed}")
        if bytes(data[: len(MAGIC)]) != MAGIC:
            raise PayloadError(f"bad magic {bytes(data[:len(MAGIC)])!r}, expected {MAGIC!r}")
        blob, digest = data[:-_DIGEST_SIZE], bytes(data[-_DIGEST_SIZE:])
        if hashlib.blake2b(blob, digest_size=_DIGEST_SIZE).digest() != digest:
            raise PayloadError("checksum mismatch: payload corrupt or truncated")
        (head_len,) = _HEADER_LEN.unpack_from(blob, len(MAGIC))
        start = len(MAGIC) + _HEADER_LEN.size
        if start + head_len > len(blob):
            raise PayloadError(f"header length {head_len} exceeds payload size {len(blob)}")
        try:
            header = json.loads(bytes(blob[start: start + head_len]).decode("utf-8"))
            payload = _from_header(header, blob[start + head_len:])
        except PayloadError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise PayloadError(f"malformed payload header: {e!r}") from e
        return payload


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PayloadError(f"{what} must be an int, got {value!r}")
    return value


def _from_header(header: dict, body: memoryview) -> Payload:
    if header.get("format") != FORMAT_VERSION:
        raise PayloadError(f"unknown payload format {header.get('format')!r}, "
                           f"this reader knows {FORMAT_VERSION}")
    leaves = []
    for entry in header["leaves"]:
        name, dtype, shape = entry
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise PayloadError(f"bad leaf entry {entry!r}")
        dims = tuple(_int(d, f"dim of leaf {name}") for d in shape)
        if any(d < 0 for d in dims):
            raise PayloadError(f"negative dim in leaf {name}: {dims}")
        leaves.append(LeafSpec(name, dtype, dims))
    sections = []
    offset = 0
    for entry in header["sections"]:
        kind = entry["kind"]
        if kind not in SECTION_KINDS:
            raise PayloadError(f"unknown section kind {kind!r}; valid: {SECTION_KINDS}")
        ids = tuple(_int(i, "section leaf id") for i in entry["leaves"])
        if not ids or any(not 0 <= i < len(leaves) for i in ids):
            raise PayloadError(f"section leaf ids {ids} out of range for {len(leaves)} leaves")
        meta = entry["meta"]
        if not isinstance(meta, dict):
            raise PayloadError(f"section meta must be a dict, got {type(meta).__name__}")
        streams = []
        for length in entry["streams"]:
            length = _int(length, "stream length")
            if length < 0 or offset + length > len(body):
                raise PayloadError(f"stream of {length} bytes at {offset} overruns body of "
                                   f"{len(body)} bytes")
            streams.append(bytes(body[offset: offset + length]))
            offset += length
        sections.append(Section(kind, ids, meta, tuple(streams)))
    if offset != len(body):
        raise PayloadError(f"body has {len(body) - offset} trailing bytes")
    return Payload(
        base_version=_int(header["base_version"], "base_version"),
        version=_int(header["version"], "version"),
        codec=str(header["codec"]),
        treedef=str(header["treedef"]),
        leaves=tuple(leaves),
        sections=tuple(sections),
    )
