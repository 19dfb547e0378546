"""Encoding: choose a section per leaf, bucket the sparse ones, assemble a Payload.

Codecs (``sync.encode(..., codec=)``): dense, coo, gap, entropy and auto, each described and
checked in :mod:`jaxflow.sync.codec_registry`.
Every payload but a full one (``dense``) carries ``device_digest`` of the tree it was encoded
against, which ``apply`` checks on the receiver.
Sparse leaves are merged into buckets of up to ``bucket_elems`` elements (one position space,
one set of streams) so many small tensors cost a few messages, not one each. Non-bf16 leaves
are carried whole, bit-exact, when any bit changed (always, for ``dense``).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from jaxflow.sync import bits, codecs, entropy
from jaxflow.sync.codec_registry import check_codec, sends_new_values
from jaxflow.sync.diff import LeafDiff, diff_tree
from jaxflow.sync.digest import device_digest
from jaxflow.sync.payload import FRESH, LeafSpec, Payload, PayloadError, Section, payload_size

DEFAULT_BUCKET_ELEMS = 1 << 26
# auto: above this changed fraction a leaf is sent as bitmask + values instead of positions.
MASK_DENSITY = 0.25


def encode(old_params, new_params, *, base_version: int, version: int, codec: str = "auto",
           bucket_elems: int = DEFAULT_BUCKET_ELEMS,
           zstd_level: int = entropy.DEFAULT_ZSTD_LEVEL,
           base_digest: str | None = None) -> Payload:
    """Encodes the bit-pattern changes from ``old_params`` (the receiver's snapshot at
    ``base_version``) to ``new_params`` (the trainer's bf16 cast, ``version``).

    Both trees must have the same structure, shapes and dtypes, and ``version`` must exceed
    ``base_version``. Returns a Payload whose ``apply`` reproduces ``new_params`` bit for bit;
    unless it is full (``codec="dense"``) it carries ``device_digest(old_params)``, computed
    where the old leaves live -- or ``base_digest`` when the caller already knows it (a
    sender carries it from publish to publish, ``SyncSender.base_digest``; a wrong one makes
    every receiver refuse the payload).

    When no element changed and ``codec`` is not ``"dense"`` it warns (``UserWarning`` naming
    the 0 changed elements) and still returns the valid empty delta (it moves a receiver
    from ``base_version`` to ``version``; the format is unchanged). The usual cause is taking
    ``old_params`` as ``nnx.state(model)`` and then ``nnx.update(model, ...)``: that state
    holds the model's variables, so it follows the update; snapshot with
    ``nnx.to_pure_dict(nnx.state(model))`` (or ``jaxflow.sync.to_bf16``) before updating.
    Wrap the call in ``warnings.catch_warnings()`` where an empty delta is intended.
    """
    _check_versions(base_version, version)
    treedef, specs, diffs = diff_tree(old_params, new_params)
    if codec != "dense" and not any(d.count for d in diffs):
        warnings.warn(
            f"sync.encode: 0 of {sum(s.size for s in specs)} elements changed between "
            f"old_params and new_params (an empty delta, version {base_version} -> {version}). "
            "If new_params should differ, old_params is probably the same live tree: "
            "nnx.state(model) follows a later nnx.update(model, ...); take the snapshot with "
            "nnx.to_pure_dict(nnx.state(model)) before updating.", UserWarning, stacklevel=2)
    if codec == "dense":
        base_digest = None
    elif base_digest is None:
        base_digest = device_digest(old_params)
    return encode_diffs(treedef, specs, diffs, base_version=base_version, version=version,
                        codec=codec, bucket_elems=bucket_elems, zstd_level=zstd_level,
                        base_digest=base_digest)


def _check_versions(base_version, version) -> None:
    for name, v in (("base_version", base_version), ("version", version)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if int(base_version) < -1 or int(version) <= int(base_version):
        raise ValueError(f"version {version} must exceed base_version {base_version} "
                         "(and base_version must be >= -1, FRESH)")


def encode_diffs(treedef: str, specs: tuple[LeafSpec, ...], diffs: list[LeafDiff], *,
                 base_version: int, version: int, codec: str = "auto",
                 bucket_elems: int = DEFAULT_BUCKET_ELEMS,
                 zstd_level: int = entropy.DEFAULT_ZSTD_LEVEL,
                 base_digest: str | None = None) -> Payload:
    """Encodes precomputed per-leaf diffs (from ``diff_tree`` or a ``ChangeTracker``).

    ``base_digest``: ``device_digest`` of the tree the diffs were taken against; delta
    payloads should carry it (``apply`` then refuses any other base). Dropped for full
    payloads, which do not depend on the base.
    """
    _check_versions(base_version, version)
    check_codec(codec)
    if len(specs) != len(diffs):
        raise ValueError(f"{len(specs)} leaf specs but {len(diffs)} diffs")
    sections: list[Section] = []
    sparse: list[int] = []
    for i, (spec, diff) in enumerate(zip(specs, diffs)):
        if spec.dtype != bits.BF16.name:
            if diff.count or codec == "dense":
                sections.append(Section("exact", (i,), *codecs.exact_encode(_full(spec, diff))))
        elif codec == "dense":
            sections.append(Section("dense", (i,), *codecs.dense_encode(
                bits.as_bits(_full(spec, diff)))))
        elif diff.count == 0:
            continue
        elif codec == "auto" and diff.count > MASK_DENSITY * spec.size:
            sections.append(_dense_fallback(i, spec, diff, zstd_level))
        else:
            sparse.append(i)
    for bucket in _buckets(sparse, specs, bucket_elems):
        sections.append(_bucket_section(codec, bucket, specs, diffs, zstd_level))
    payload = Payload(base_version=int(base_version), version=int(version), codec=codec,
                      treedef=treedef, leaves=tuple(specs), sections=tuple(sections))
    if base_digest is not None and not payload.is_full:
        payload = dataclasses.replace(payload, base_digest=base_digest)
    try:
        return payload.validate()
    except PayloadError as e:
        raise ValueError(f"encode produced an invalid payload: {e}") from None


def _full(spec: LeafSpec, diff: LeafDiff) -> np.ndarray:
    full = diff.full()
    if full is None:
        raise ValueError(f"leaf {spec.name}: this codec needs the full new leaf, "
                         "but the diff does not carry it")
    return full


def _dense_fallback(i: int, spec: LeafSpec, diff: LeafDiff, level: int) -> Section:
    """Bitmask + values, or the raw leaf when even that is not smaller."""
    meta, streams = entropy.mask_encode_deltas(diff.positions, diff.value_deltas(), spec.size,
                                               level)
    if sum(map(len, streams)) >= 2 * spec.size:
        full = diff.full()
        if full is not None:
            return Section("dense", (i,), *codecs.dense_encode(bits.as_bits(full)))
    return Section("mask", (i,), meta, streams)


def dense_payload_size(treedef: str, specs: tuple[LeafSpec, ...], *, version: int) -> int:
    """``len()`` of the full (``codec="dense"``, base FRESH) payload of a tree with these
    leaves, computed from shapes and dtypes alone (no leaf is read or encoded)."""
    sections = []
    for i, spec in enumerate(specs):
        if spec.dtype == bits.BF16.name:
            sections.append(("dense", (i,), {}, [2 * spec.size]))
        else:
            sections.append(("exact", (i,), {}, [np.dtype(spec.dtype).itemsize * spec.size]))
    return payload_size(FRESH, version, None, "dense", treedef, specs, sections)


def _buckets(ids: list[int], specs, bucket_elems: int) -> list[list[int]]:
    """Greedy tree-order groups of leaves with at most ``bucket_elems`` elements in total
    (a larger leaf forms its own bucket)."""
    out: list[list[int]] = []
    current, size = [], 0
    for i in ids:
        n = specs[i].size
        if current and size + n > bucket_elems:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        out.append(current)
    return out


def _bucket_section(codec: str, ids: list[int], specs, diffs, level: int) -> Section:
    offsets = np.cumsum([0] + [specs[i].size for i in ids])
    total = int(offsets[-1])
    values = (lambda d: d.new_bits) if sends_new_values(codec) else LeafDiff.value_deltas
    if len(ids) == 1:  # a big leaf alone: no copies
        pos, vals = diffs[ids[0]].positions, values(diffs[ids[0]])
    else:
        pos = np.concatenate([diffs[i].positions + off for i, off in zip(ids, offsets[:-1])])
        vals = np.concatenate([values(diffs[i]) for i in ids])
    if codec == "coo":
        meta, streams = codecs.coo_encode(pos, vals, total)
    elif codec == "gap":
        meta, streams = codecs.gap_encode(pos, vals, total)
    else:  # entropy, auto: values as bit-pattern differences from the old values
        meta, streams = entropy.entropy_encode_deltas(pos, vals, total, level)
        codec = "entropy"
    return Section(codec, tuple(ids), meta, tuple(streams))
