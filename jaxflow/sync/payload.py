"""The wire format: a self-describing, checksummed, bounded sync payload (format version 2).

Layout of ``Payload.to_bytes()`` (full description: docs/sync_payload_format.md)::

    b"JFSYNC\x00" | format version (u8) | header length (u32 LE) | header (JSON, utf-8)
      | body | blake2b-128 of everything before it

The header names the base and target versions, the digest of the base tree (delta payloads),
the codec, the tree structure, every leaf's name / dtype / shape, and the sections. A section
is one codec's encoding of one leaf (dense, exact, mask) or of a bucket of leaves (coo, gap,
entropy); its streams lie back to back in the body in header order. The checksum covers
everything before it, so any flipped or missing byte is caught in ``from_bytes`` before a
single stream is decoded; the header is bounded in size (``MAX_HEADER_BYTES``) and JSON
nesting depth (``MAX_HEADER_DEPTH``) before it is parsed, and every field is type-checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from typing import Any

import ml_dtypes  # noqa: F401  -- registers bfloat16 / float8 dtype names with numpy
import numpy as np

from jaxflow.sync.codec_registry import check_codec

PREFIX = b"JFSYNC\x00"
FORMAT_VERSION = 2
MAGIC = PREFIX + bytes([FORMAT_VERSION])
_DIGEST_SIZE = 16
_HEADER_LEN = struct.Struct("<I")
FIXED_BYTES = len(MAGIC) + _HEADER_LEN.size + _DIGEST_SIZE
MAX_HEADER_BYTES = 1 << 26
# The format's own depth: header {} > sections [] > section {} > meta {} / leaves [].
MAX_HEADER_DEPTH = 4
MAX_DIM = 1 << 62
FRESH = -1  # the version of a receiver that holds no synced tree yet (a template)

SECTION_KINDS = ("dense", "exact", "mask", "coo", "gap", "entropy")
FULL_KINDS = ("dense", "exact")  # sections that carry their leaf whole
_HEX_DIGEST = re.compile(r"[0-9a-f]{32}")
_TOP_KEYS = {"base_version", "version", "base_digest", "codec", "treedef", "leaves",
             "sections"}
_SECTION_KEYS = {"kind", "leaves", "meta", "streams"}


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
    """A sync message taking a receiver from ``base_version`` to ``version``.

    Attributes:
      base_version: the version the payload applies to (``FRESH`` or older for full payloads,
        which apply from any version).
      version: the version the receiver holds afterwards; always > ``base_version``.
      codec: the codec it was encoded with (``jaxflow.sync.codec_registry.CODECS``).
      treedef: ``str`` of the tree's PyTreeDef.
      leaves: every leaf's LeafSpec, in tree-flatten order.
      sections: the encoded changes.
      base_digest: ``jaxflow.sync.digest.device_digest`` of the base tree (32 hex chars), which
        ``apply`` verifies on the receiver before writing; None for full payloads (and for
        deltas from an encoder that did not supply one: those are not base-checked).
    """

    base_version: int
    version: int
    codec: str
    treedef: str
    leaves: tuple[LeafSpec, ...]
    sections: tuple[Section, ...]
    base_digest: str | None = None

    @property
    def num_bytes(self) -> int:
        """Size of the serialised payload on the wire."""
        return len(self.to_bytes())

    @property
    def is_full(self) -> bool:
        """Every leaf is carried whole (dense / exact sections): the payload does not depend
        on the receiver's old values and applies from any version (a resync)."""
        covered = {i for s in self.sections if s.kind in FULL_KINDS for i in s.leaves}
        return len(covered) == len(self.leaves)

    def validate(self) -> "Payload":
        """Checks every envelope field (types, ranges, versions, digest, leaf specs, section
        kinds and leaf ids); raises PayloadError naming the bad value. Returns self."""
        base, version = _int(self.base_version, "base_version"), _int(self.version, "version")
        if base < FRESH:
            raise PayloadError(f"base_version {base} invalid: need >= {FRESH} (FRESH)")
        if version <= base:
            raise PayloadError(f"target version {version} must exceed base version {base}")
        check_codec(self.codec, error=PayloadError)
        if not isinstance(self.treedef, str):
            raise PayloadError(f"treedef must be a str, got {type(self.treedef).__name__}")
        if self.base_digest is not None and not (
                isinstance(self.base_digest, str) and _HEX_DIGEST.fullmatch(self.base_digest)):
            raise PayloadError(f"base_digest {self.base_digest!r} invalid: need None or 32 "
                               "lowercase hex characters")
        for spec in self.leaves:
            _check_spec(spec)
        seen: set[int] = set()
        for section in self.sections:
            if not isinstance(section, Section) or section.kind not in SECTION_KINDS:
                kind = getattr(section, "kind", section)
                raise PayloadError(f"unknown section kind {kind!r}; valid: {SECTION_KINDS}")
            ids = section.leaves
            if (not isinstance(ids, tuple) or not ids or any(
                    not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.leaves)
                    for i in ids)):
                raise PayloadError(f"section leaf ids {ids!r} invalid for "
                                   f"{len(self.leaves)} leaves")
            if seen.intersection(ids):
                raise PayloadError(f"leaf ids {sorted(seen.intersection(ids))} appear in more "
                                   "than one section")
            seen.update(ids)
            if not isinstance(section.meta, dict) or any(
                    not isinstance(k, str) or not isinstance(v, int) or isinstance(v, bool)
                    for k, v in section.meta.items()):
                raise PayloadError(f"section meta must map names to ints, got {section.meta!r}")
            if not isinstance(section.streams, tuple) or any(
                    not isinstance(b, (bytes, bytearray, memoryview)) for b in section.streams):
                raise PayloadError("section streams must be a tuple of bytes")
        return self

    def to_bytes(self) -> bytes:
        """The wire format (docs/sync_payload_format.md): magic, header, section streams, blake2b checksum."""
        head = header_bytes(self.base_version, self.version, self.base_digest, self.codec,
                            self.treedef, self.leaves,
                            [(s.kind, s.leaves, s.meta, [len(b) for b in s.streams])
                             for s in self.sections])
        parts = [MAGIC, _HEADER_LEN.pack(len(head)), head]
        parts += [bytes(b) for s in self.sections for b in s.streams]
        blob = b"".join(parts)
        return blob + hashlib.blake2b(blob, digest_size=_DIGEST_SIZE).digest()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Payload":
        """Parses and verifies a payload; raises PayloadError on any defect (wrong type,
        truncation, bad magic or format version, checksum, oversized or too deeply nested
        header, malformed or out-of-range field)."""
        data = _byte_view(data)
        if len(data) < FIXED_BYTES:
            raise PayloadError(f"payload truncated: {len(data)} bytes, need at least "
                               f"{FIXED_BYTES}")
        if bytes(data[: len(PREFIX)]) != PREFIX:
            raise PayloadError(f"bad magic {bytes(data[:len(PREFIX)])!r}, expected {PREFIX!r}")
        if data[len(PREFIX)] != FORMAT_VERSION:
            raise PayloadError(f"payload format version {data[len(PREFIX)]} is not supported; "
                               f"this reader reads version {FORMAT_VERSION}")
        blob, digest = data[:-_DIGEST_SIZE], bytes(data[-_DIGEST_SIZE:])
        if hashlib.blake2b(blob, digest_size=_DIGEST_SIZE).digest() != digest:
            raise PayloadError("checksum mismatch: payload corrupt or truncated")
        (head_len,) = _HEADER_LEN.unpack_from(blob, len(MAGIC))
        start = len(MAGIC) + _HEADER_LEN.size
        if head_len > MAX_HEADER_BYTES:
            raise PayloadError(f"header length {head_len} exceeds MAX_HEADER_BYTES="
                               f"{MAX_HEADER_BYTES}")
        if start + head_len > len(blob):
            raise PayloadError(f"header length {head_len} exceeds payload size {len(blob)}")
        raw = bytes(blob[start: start + head_len])
        depth = json_depth(raw, limit=MAX_HEADER_DEPTH)
        if depth > MAX_HEADER_DEPTH:
            raise PayloadError(f"header nests at least {depth} deep; the format allows "
                               f"{MAX_HEADER_DEPTH}")
        try:
            header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
            raise PayloadError(f"payload header is not valid JSON: {e}") from None
        return _from_header(header, blob[start + head_len:]).validate()


def header_bytes(base_version: int, version: int, base_digest: str | None, codec: str,
                 treedef: str, leaves, sections) -> bytes:
    """The JSON header of a payload; ``sections``: (kind, leaf ids, meta, stream lengths)
    per section. ``Payload.to_bytes`` writes it, ``payload_size`` measures it."""
    header = {
        "base_version": int(base_version),
        "version": int(version),
        "base_digest": base_digest,
        "codec": codec,
        "treedef": treedef,
        "leaves": [[spec.name, spec.dtype, list(spec.shape)] for spec in leaves],
        "sections": [
            {"kind": kind, "leaves": list(ids), "meta": meta, "streams": list(lengths)}
            for kind, ids, meta, lengths in sections
        ],
    }
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"payload header of {len(head)} bytes exceeds MAX_HEADER_BYTES="
                         f"{MAX_HEADER_BYTES}")
    return head


def payload_size(base_version: int, version: int, base_digest: str | None, codec: str,
                 treedef: str, leaves, sections) -> int:
    """``len(Payload(...).to_bytes())`` from the header fields and stream lengths alone
    (arguments as for ``header_bytes``): no stream is built or hashed."""
    head = header_bytes(base_version, version, base_digest, codec, treedef, leaves, sections)
    return FIXED_BYTES + len(head) + sum(int(n) for *_, lengths in sections for n in lengths)


def max_payload_bytes(treedef: str, specs: tuple[LeafSpec, ...]) -> int:
    """An upper bound on the size of any payload this package's encoders produce for a tree
    with this structure and these leaves (what a receiver may expect, e.g. to cap a frame).

    Header: the JSON of every leaf entry and its section, names at their worst-case escaped
    length (12 bytes per character). Body: 7 bytes per bf16 element (coo and gap send at most
    6, entropy at most 33 bits of Rice code + 2 value bytes), the raw bytes of other leaves,
    and 1 KiB of stream overhead (zstd frames, padding) per leaf.
    """
    head = 4096 + 12 * len(treedef)
    body = 0
    for spec in specs:
        head += 12 * len(spec.name) + 24 * len(spec.shape) + 600
        per_element = 7 if spec.dtype == "bfloat16" else np.dtype(spec.dtype).itemsize
        body += per_element * spec.size + 1024
    return FIXED_BYTES + min(head, MAX_HEADER_BYTES) + body


def _byte_view(data) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, bytearray or memoryview, got "
                           f"{type(data).__name__}")
    view = memoryview(data)
    if not view.contiguous:
        raise PayloadError("payload memoryview is not a contiguous byte buffer")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as e:
            raise PayloadError(f"payload memoryview is not a contiguous byte buffer: {e}") from None
    return view


def _reject_constant(name: str):
    raise PayloadError(f"payload header contains the non-JSON constant {name}")


_STRUCTURAL = np.zeros(256, bool)
_STRUCTURAL[list(b'[]{}"\\')] = True


def json_depth(raw: bytes, *, chunk: int = 1 << 20, limit: int | None = None) -> int:
    """Maximum bracket nesting depth of the JSON text ``raw``, brackets inside strings not
    counted; vectorised over the structural characters of ``chunk``-byte slices (state carried
    across slices: memory stays bounded whatever the header holds; no recursion, no parse).

    On valid JSON it is exact; on invalid JSON it is exact up to the first invalid character,
    which is as far as ``json.loads`` recurses before it fails. With ``limit``, stops after the
    first slice that goes deeper (returning that slice's depth: a lower bound).
    """
    b = np.frombuffer(raw, np.uint8)
    depth = deepest = 0
    inside = 0                 # string-quote parity before the slice
    last_pos, last_bs = -2, False
    run = 0                    # length of the backslash run ending at last_pos (if last_bs)
    for start in range(0, b.size, chunk):
        pos = np.flatnonzero(_STRUCTURAL[b[start: start + chunk]]) + start
        if pos.size == 0:
            continue
        ch = b[pos]
        is_bs = ch == 0x5C
        prev_pos = np.concatenate([[last_pos], pos[:-1]])
        prev_bs = np.concatenate([[last_bs], is_bs[:-1]])
        after_bs = prev_bs & (pos == prev_pos + 1)  # directly after a backslash
        idx = np.arange(pos.size)
        run_start = np.maximum.accumulate(np.where(is_bs & ~after_bs, idx, -1))
        length = np.where(run_start >= 0, idx - run_start + 1, run + idx + 1)  # at backslashes
        odd_before = np.concatenate([[run % 2 == 1], length[:-1] % 2 == 1])
        quote = (ch == 0x22) & ~(after_bs & odd_before)
        before = (inside + np.cumsum(quote) - quote) % 2 == 1
        live = ~before & ~quote
        step = (live & ((ch == 0x5B) | (ch == 0x7B))).astype(np.int64)
        step -= live & ((ch == 0x5D) | (ch == 0x7D))
        levels = depth + np.cumsum(step)
        deepest = max(deepest, int(levels.max()))
        if limit is not None and deepest > limit:
            break
        depth, inside = int(levels[-1]), (inside + int(quote.sum())) % 2
        last_pos, last_bs = int(pos[-1]), bool(is_bs[-1])
        run = int(length[-1]) if last_bs else 0
    return deepest


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PayloadError(f"{what} must be an int, got {value!r}")
    return value


def _check_spec(spec) -> None:
    if not isinstance(spec, LeafSpec) or not isinstance(spec.name, str):
        raise PayloadError(f"bad leaf spec {spec!r}")
    try:
        canonical = np.dtype(spec.dtype).name if isinstance(spec.dtype, str) else None
    except TypeError:
        canonical = None
    if canonical != spec.dtype:
        raise PayloadError(f"leaf {spec.name}: dtype {spec.dtype!r} is not a numpy dtype name")
    if not isinstance(spec.shape, tuple) or len(spec.shape) > 64:
        raise PayloadError(f"leaf {spec.name}: shape {spec.shape!r} invalid")
    for d in spec.shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_DIM:
            raise PayloadError(f"leaf {spec.name}: dim {d!r} invalid (need an int in "
                               f"[0, {MAX_DIM}])")
    if spec.size > MAX_DIM:
        raise PayloadError(f"leaf {spec.name}: {spec.size} elements exceed {MAX_DIM}")


def _want(value: Any, kind: type, what: str):
    if not isinstance(value, kind):
        raise PayloadError(f"{what} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _from_header(header: Any, body: memoryview) -> Payload:
    _want(header, dict, "payload header")
    if set(header) != _TOP_KEYS:
        raise PayloadError(f"header keys {sorted(header)} invalid; expected {sorted(_TOP_KEYS)}")
    leaves = []
    for entry in _want(header["leaves"], list, "header leaves"):
        if not isinstance(entry, list) or len(entry) != 3:
            raise PayloadError(f"bad leaf entry {entry!r}: need [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
            raise PayloadError(f"bad leaf entry {entry!r}: need [str, str, list]")
        leaves.append(LeafSpec(name, dtype, tuple(shape)))
    sections = []
    offset = 0
    for entry in _want(header["sections"], list, "header sections"):
        _want(entry, dict, "section")
        if set(entry) != _SECTION_KEYS:
            raise PayloadError(f"section keys {sorted(entry)} invalid; expected "
                               f"{sorted(_SECTION_KEYS)}")
        streams = []
        for length in _want(entry["streams"], list, "section streams"):
            length = _int(length, "stream length")
            if length < 0 or offset + length > len(body):
                raise PayloadError(f"stream of {length} bytes at {offset} overruns body of "
                                   f"{len(body)} bytes")
            streams.append(bytes(body[offset: offset + length]))
            offset += length
        sections.append(Section(entry["kind"], tuple(_want(entry["leaves"], list,
                                                            "section leaves")),
                                _want(entry["meta"], dict, "section meta"), tuple(streams)))
    if offset != len(body):
        raise PayloadError(f"body has {len(body) - offset} trailing bytes")
    return Payload(base_version=header["base_version"], version=header["version"],
                   codec=header["codec"], treedef=header["treedef"], leaves=tuple(leaves),
                   sections=tuple(sections), base_digest=header["base_digest"])
