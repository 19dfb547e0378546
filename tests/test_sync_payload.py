"""Every rejection raises PayloadError before any parameter is touched."""

import dataclasses

import numpy as np
import pytest

from jaxflow import sync
from tests.test_sync_trees import adversarial_pair, tree_bits

CODECS = ("dense", "coo", "gap", "entropy", "auto")


def _setup(codec="auto"):
    old, new = adversarial_pair()
    payload = sync.encode(old, new, base_version=7, version=8, codec=codec)
    receiver = adversarial_pair()[0]  # a separate copy the tests may let apply write into
    return payload, receiver, tree_bits(receiver)


def _assert_rejected(payload_or_bytes, receiver, before, version=7):
    with pytest.raises(sync.PayloadError):
        payload = (sync.Payload.from_bytes(payload_or_bytes)
                   if isinstance(payload_or_bytes, bytes) else payload_or_bytes)
        sync.apply(payload, receiver, version=version, inplace=True)
    assert tree_bits(receiver) == before


@pytest.mark.parametrize("codec", CODECS)
def test_corrupt_bytes_rejected(codec):
    payload, receiver, before = _setup(codec)
    wire = bytearray(payload.to_bytes())
    for where in (0, 12, len(wire) // 2, len(wire) - 20, len(wire) - 1):
        corrupt = bytearray(wire)
        corrupt[where] ^= 0x41
        _assert_rejected(bytes(corrupt), receiver, before)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_bytes_rejected(codec):
    payload, receiver, before = _setup(codec)
    wire = payload.to_bytes()
    for length in (0, 5, 20, len(wire) // 2, len(wire) - 1):
        _assert_rejected(wire[:length], receiver, before)
    _assert_rejected(wire + b"\x00", receiver, before)


def test_wrong_base_version_rejected():
    payload, receiver, before = _setup()
    _assert_rejected(payload.to_bytes(), receiver, before, version=6)


def test_wrong_tree_rejected():
    payload, receiver, before = _setup()
    receiver["extra"] = np.zeros(3, np.float32)
    _assert_rejected(payload.to_bytes(), receiver, tree_bits(receiver))
    del receiver["extra"]
    renamed = dict(receiver)
    renamed["zzz"] = renamed.pop("scalar")
    _assert_rejected(payload.to_bytes(), renamed, tree_bits(renamed))


def test_reshaped_leaf_rejected():
    payload, receiver, before = _setup()
    receiver["all_changed"] = receiver["all_changed"].reshape(16, 8)
    _assert_rejected(payload.to_bytes(), receiver, tree_bits(receiver))


def test_wrong_dtype_rejected():
    payload, receiver, before = _setup()
    receiver["smooth"] = receiver["smooth"].astype(np.float16)
    _assert_rejected(payload.to_bytes(), receiver, tree_bits(receiver))
    payload, receiver, before = _setup()
    receiver["nested"][2] = receiver["nested"][2].astype(np.int64)
    _assert_rejected(payload.to_bytes(), receiver, tree_bits(receiver))


def _broken(payload, kind, **meta_changes):
    """A checksummed payload whose last ``kind`` section lies about its contents."""
    sections = list(payload.sections)
    i = max(j for j, s in enumerate(sections) if s.kind == kind)
    sections[i] = dataclasses.replace(sections[i], meta={**sections[i].meta, **meta_changes})
    return dataclasses.replace(payload, sections=tuple(sections))


@pytest.mark.parametrize("codec,kind,change", [
    ("coo", "coo", {"count": 3}),
    ("gap", "gap", {"escapes": 0}),
    ("entropy", "entropy", {"rice_bits": 2}),
    ("entropy", "entropy", {"count": 1}),
    ("auto", "mask", {"count": 5}),
    ("auto", "entropy", {"big": 0}),
])
def test_inconsistent_sections_rejected_before_any_write(codec, kind, change):
    """Earlier sections are valid; the receiver must still be untouched (inplace=True)."""
    payload, receiver, before = _setup(codec)
    _assert_rejected(_broken(payload, kind, **change).to_bytes(), receiver, before)


def test_overlapping_sections_rejected():
    payload, receiver, before = _setup("dense")
    duplicated = dataclasses.replace(payload, sections=payload.sections + payload.sections[:1])
    _assert_rejected(duplicated.to_bytes(), receiver, before)


def test_inplace_apply_writes_numpy_leaves():
    old, new = adversarial_pair()
    payload = sync.encode(old, new, base_version=0, version=1)
    out = sync.apply(payload, old, version=0, inplace=True)
    assert out["random"] is old["random"]
    assert tree_bits(out) == tree_bits(new)


def test_resealed_header_mutations_raise_only_payload_error():
    """Valid checksum, mutated header: either applies or raises PayloadError, never another
    exception, and a rejected payload leaves the receiver untouched."""
    import hashlib
    import json
    import random
    import struct

    from jaxflow.sync.payload import MAGIC

    rnd = random.Random(0)
    old, new = adversarial_pair()
    wire = sync.encode(old, new, base_version=0, version=1, bucket_elems=1000).to_bytes()
    (head_len,) = struct.unpack_from("<I", wire, len(MAGIC))
    header = json.loads(wire[len(MAGIC) + 4: len(MAGIC) + 4 + head_len])
    body = wire[len(MAGIC) + 4 + head_len: -16]
    for _ in range(60):
        h = json.loads(json.dumps(header))
        section = rnd.choice(h["sections"])
        if section["meta"] and rnd.random() < 0.7:
            key = rnd.choice(list(section["meta"]))
            section["meta"][key] = rnd.choice([0, 1, 2, -1, 7, 10**6, "x", None, 1.5,
                                               section["meta"][key] + 1])
        else:
            section["leaves"] = [rnd.randrange(-1, len(h["leaves"]) + 1)]
        head = json.dumps(h).encode()
        blob = MAGIC + struct.pack("<I", len(head)) + head + body
        blob += hashlib.blake2b(blob, digest_size=16).digest()
        receiver = adversarial_pair()[0]
        before = tree_bits(receiver)
        try:
            sync.apply(sync.Payload.from_bytes(blob), receiver, version=0, inplace=True)
        except sync.PayloadError:
            assert tree_bits(receiver) == before
