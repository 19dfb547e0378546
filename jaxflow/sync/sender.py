"""The trainer side of weight sync as a value: ``SenderState`` and a pure ``publish``.

A :class:`SenderState` holds everything a sender knows: the last synced bf16 snapshot and its
version, the snapshot's digest lanes (advanced from each publish's diff in O(changes)), the
recent step payloads (each takes version ``b`` to the next synced version) and the codec /
path settings. Functions take a state and return a new one; none mutates its argument, so
publishing twice from the same state gives the same payload::

    state = sender_state(params0, version=0, codec="auto")
    state, sent = publish(state, params, version=4)    # sent.payload: the step payload
    state, route, payloads = plan(state, replica_version)  # "current" / "chain" / "dense"

The two diff paths are two functions with one result (:class:`EncodedDiff`): ``encode_on_host``
(the tree is pulled to numpy and diffed there) and ``encode_on_device`` (cast, diff and
compaction on the params' devices, ``jaxflow.sync.device_diff``); both make the same payload
bytes. :class:`jaxflow.sync.sync_sender.SyncSender` is the stateful convenience wrapper.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxflow.sync import bits, device_diff, digest, encoder
from jaxflow.sync.bound import entropy_bound_bytes
from jaxflow.sync.codec_registry import check_codec
from jaxflow.sync.diff import LeafDiff, diff_tree, tree_layout
from jaxflow.sync.encoder import encode_diffs
from jaxflow.sync.payload import FRESH, LeafSpec, Payload
from jaxflow.sync.wire import device_tree, resolve_path, to_bf16, tree_digest


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """One publish: what it sent, sizes in bytes, times in seconds, changed elements of bf16
    leaves.

    ``payload``: the step payload's bytes (``len(payload) == payload_bytes``; empty in
    records that drop it, see ``weight_sync.SyncRecord``); ``encode_s``: the cast to bf16,
    diff, encode and ``to_bytes``; ``dense_bytes``: the size of a full payload (computed from
    shapes and dtypes); ``host_bytes``: what the publish moved device -> host (the host path
    pulls every jax leaf whole, the device path only the compacted changes); ``path``: "host"
    or "device"."""

    base_version: int
    version: int
    codec: str
    payload_bytes: int
    dense_bytes: int
    changed: int
    elements: int
    bound_bytes: float
    encode_s: float
    host_bytes: int = 0
    path: str = "host"
    payload: bytes = dataclasses.field(default=b"", repr=False)

    @property
    def changed_fraction(self) -> float:
        """Changed bf16 elements over all elements."""
        return self.changed / max(self.elements, 1)

    @property
    def ratio_vs_dense(self) -> float:
        """Dense bf16 bytes over the payload's bytes."""
        return self.dense_bytes / max(self.payload_bytes, 1)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step payload of the history: ``data`` takes ``base_version`` to ``version``."""

    base_version: int
    version: int
    data: bytes


@dataclasses.dataclass(frozen=True, eq=False)
class SenderState:
    """Everything a sender knows, as a value (replace fields, never mutate them).

    Attributes:
      snapshot: the bf16 tree at ``version`` (host numpy on path "host", jax Arrays on the
        params' devices on path "device").
      version: the snapshot's version.
      codec: one of ``jaxflow.sync.CODECS``.
      history: how many step payloads ``steps`` keeps.
      path: "host" or "device" (resolved, never "auto").
      backend, interpret: the device path's compaction (``device_diff``'s ``backend``).
      treedef, specs: the snapshot's layout (``diff.tree_layout``); every publish has it.
      dense_size0: ``len()`` of the snapshot's full payload at version 0 (full payloads differ
        between versions only in the digits of the version).
      lanes: read-only uint32[n_leaves, 2] digest lanes of the snapshot
        (``jaxflow.sync.digest``), or None until first needed (a delta codec's publish,
        ``with_lanes``).
      steps: the step payloads, oldest first, at most ``history``.
      digest: ``tree_digest(snapshot)`` once ``with_digest`` computed it, else None.
      dense: the full payload of the snapshot once ``with_dense_payload`` made it, else None.
    """

    snapshot: Any
    version: int
    codec: str
    history: int
    path: str
    backend: str
    interpret: bool
    treedef: str
    specs: tuple[LeafSpec, ...]
    dense_size0: int
    lanes: np.ndarray | None = None
    steps: tuple[Step, ...] = ()
    digest: str | None = None
    dense: bytes | None = None


@dataclasses.dataclass(frozen=True)
class EncodedDiff:
    """What either diff path returns for one publish.

    Attributes:
      new: the bf16 tree of the new version (the next snapshot).
      treedef, specs, diffs: its layout and one LeafDiff per leaf against the old snapshot.
      data: the step payload's bytes.
      lanes: read-only uint32[n_leaves, 2] digest lanes of ``new``, or None when the state
        tracks none (``SenderState.lanes`` None and the ``dense`` codec).
      host_bytes: bytes the path moved device -> host.
    """

    new: Any
    treedef: str
    specs: tuple[LeafSpec, ...]
    diffs: list[LeafDiff]
    data: bytes
    lanes: np.ndarray | None
    host_bytes: int


def sender_state(params: Any, *, version: int = 0, codec: str = "auto", history: int = 64,
                 path: str = "auto", backend: str = "auto", interpret: bool = False,
                 copy: bool = True) -> SenderState:
    """The state of a sender whose replicas start from ``params`` (cast to bf16) at ``version``.

    Args:
      params: any tree of arrays (host numpy or jax Arrays); floating leaves become bf16.
      codec: one of ``jaxflow.sync.CODECS``.
      history: step payloads kept for chained catch-up (older replicas get a dense resync).
      path: "host" (the snapshot is host numpy: every publish pulls the tree and diffs it in
        numpy), "device" (the snapshot stays on the params' devices: the cast, diff and
        compaction run there and only the changes reach the host) or "auto" (device when
        ``params`` live on an accelerator). Both paths make the same payload bytes.
      backend, interpret: the device path's compaction (``device_diff``'s ``backend``).
      copy: ``False``: leaves of ``params`` that need no cast become the snapshot as they are
        (the caller must not modify or donate them).
    """
    check_codec(codec)
    if history < 0:
        raise ValueError(f"history={history}: need >= 0")
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"version={version!r}: need an int >= 0")
    if backend not in device_diff.BACKENDS:
        raise ValueError(f"backend={backend!r}; valid: {device_diff.BACKENDS}")
    path = resolve_path(path, params)
    snapshot = _device_snapshot(params, copy) if path == "device" else to_bf16(params, copy=copy)
    treedef, _, specs = tree_layout(snapshot)
    return SenderState(snapshot=snapshot, version=int(version), codec=codec, history=history,
                       path=path, backend=backend, interpret=interpret, treedef=treedef,
                       specs=specs,
                       dense_size0=encoder.dense_payload_size(treedef, specs, version=0))


def _device_snapshot(params: Any, copy: bool) -> Any:
    params = device_tree(params)
    if copy:
        return device_diff.cast_tree(params)
    return jax.tree.map(
        lambda x: device_diff.cast_tree(x) if jax.numpy.issubdtype(
            x.dtype, jax.numpy.floating) and x.dtype != jax.numpy.bfloat16 else x, params)


def publish(state: SenderState, params: Any, *, version: int | None = None,
            with_bound: bool = False, copy: bool = True, scratch: dict | None = None
            ) -> tuple[SenderState, PublishStats]:
    """Encodes the change from ``state.snapshot`` to ``params`` (cast to bf16) as ``version``
    (default: ``state.version + 1``). Sends nothing; ``state`` is left as it was.

    Args:
      params: same structure, shapes and (before the cast) floating-ness as the snapshot.
      with_bound: also compute the entropy bound (``PublishStats.bound_bytes``, else NaN).
      copy: ``False`` (host path): bf16 numpy leaves of ``params`` become the new snapshot
        without a copy; the caller must not modify them afterwards.
      scratch: a caller-owned dict of the host diff's work buffers, reused between calls
        (their contents mean nothing between calls; None: fresh buffers).
    Returns:
      (the state at ``version`` with this step payload in its history, the PublishStats
      including the payload bytes).
    """
    version = state.version + 1 if version is None else int(version)
    if version <= state.version:
        raise ValueError(f"version {version} must exceed the current {state.version}")
    t0 = time.perf_counter()
    found = _ENCODERS[state.path](state, params, version=version, with_bound=with_bound,
                                  copy=copy, scratch=scratch)
    encode_s = time.perf_counter() - t0
    specs, diffs = found.specs, found.diffs
    bf16_ids = [i for i, s in enumerate(specs) if s.dtype == bits.BF16.name]
    stats = PublishStats(
        base_version=state.version, version=version, codec=state.codec,
        payload_bytes=len(found.data), dense_bytes=dense_payload_bytes(state, version),
        changed=sum(diffs[i].count for i in bf16_ids),
        elements=sum(specs[i].size for i in bf16_ids),
        bound_bytes=entropy_bound_bytes(specs, diffs) if with_bound else float("nan"),
        encode_s=encode_s, host_bytes=int(found.host_bytes), path=state.path,
        payload=found.data)
    steps = (*state.steps, Step(state.version, version, found.data))
    steps = steps[max(0, len(steps) - state.history):]
    return dataclasses.replace(state, snapshot=found.new, version=version, lanes=found.lanes,
                               steps=steps, digest=None, dense=None), stats


def encode_on_host(state: SenderState, params: Any, *, version: int, with_bound: bool = False,
                   copy: bool = True, scratch: dict | None = None) -> EncodedDiff:
    """The host path: pulls ``params`` to numpy as bf16, diffs it against the (numpy)
    snapshot and encodes the step payload to ``version``. ``with_bound`` needs nothing more
    here (the host diff keeps old and new bits)."""
    del with_bound
    host_bytes = sum(x.nbytes for x in jax.tree.leaves(params) if isinstance(x, jax.Array))
    new = to_bf16(params, copy=copy)
    treedef, specs, diffs = diff_tree(state.snapshot, new, scratch=scratch)
    payload, lanes = _encode(state, treedef, specs, diffs, version)
    data = payload.to_bytes()
    if lanes is not None:
        lanes = _advanced_lanes(lanes, specs, diffs, _host_lanes_delta(specs, diffs))
    return EncodedDiff(new, treedef, specs, diffs, data, lanes, host_bytes)


def encode_on_device(state: SenderState, params: Any, *, version: int,
                     with_bound: bool = False, copy: bool = True,
                     scratch: dict | None = None) -> EncodedDiff:
    """The device path: casts and diffs ``params`` against the (device) snapshot on their
    devices (``device_diff``), fetches only the changes and encodes the step payload to
    ``version``. ``copy`` and ``scratch`` do not apply (the new snapshot is a fresh cast)."""
    del copy, scratch
    found = device_diff.device_diff(
        state.snapshot, device_tree(params),
        values=device_diff.values_for_codec(state.codec, with_bound),
        backend=state.backend, interpret=state.interpret)
    payload, lanes = _encode(state, found.treedef, found.specs, found.diffs, version)
    data = payload.to_bytes()
    if lanes is not None:  # the bf16 leaves' change was computed on the device, O(changes)
        lanes = _advanced_lanes(lanes, found.specs, found.diffs, found.lanes_delta)
    host_bytes = found.host_bytes + device_diff.loaded_bytes(found, payload)
    return EncodedDiff(found.new, found.treedef, found.specs, found.diffs, data, lanes,
                       host_bytes)


_ENCODERS = {"host": encode_on_host, "device": encode_on_device}


def _encode(state: SenderState, treedef: str, specs, diffs, version: int
            ) -> tuple[Payload, np.ndarray | None]:
    """The step payload of ``diffs`` and the lanes of ``state.snapshot`` it named as its base
    (computed here on the first delta publish; None while untracked and ``dense``)."""
    lanes, base_digest = state.lanes, None
    if state.codec != "dense":
        lanes = _snapshot_lanes(state)
        base_digest = digest.combine(treedef, specs, lanes)
    payload = encode_diffs(treedef, specs, diffs, base_version=state.version, version=version,
                           codec=state.codec, base_digest=base_digest)
    return payload, lanes


def _host_lanes_delta(specs, diffs) -> np.ndarray:
    """uint32[n_leaves, 2]: the lanes' change of every changed bf16 leaf (one word per
    element: from the changes alone, all leaves in one pass), zero rows elsewhere."""
    bf16 = [i for i, spec in enumerate(specs) if spec.dtype == bits.BF16.name and diffs[i].count]
    out = np.zeros((len(specs), 2), np.uint32)
    out[bf16] = digest.lanes_deltas([diffs[i].positions for i in bf16],
                                    [diffs[i].old_bits for i in bf16],
                                    [diffs[i].new_bits for i in bf16])
    return out


def _advanced_lanes(lanes: np.ndarray, specs, diffs, bf16_delta: np.ndarray) -> np.ndarray:
    """A new read-only lanes array: ``lanes + bf16_delta`` (mod 2**32), with every changed
    non-bf16 leaf (carried whole, ``full_new``) digested again."""
    out = lanes + bf16_delta
    for i, (spec, diff) in enumerate(zip(specs, diffs)):
        if diff.count and spec.dtype != bits.BF16.name:
            out[i] = digest.host_lanes(diff.full_new)
    out.flags.writeable = False
    return out


def _snapshot_lanes(state: SenderState) -> np.ndarray:
    if state.lanes is not None:
        return state.lanes
    lanes = digest.tree_lanes(state.snapshot)
    lanes.flags.writeable = False
    return lanes


def dense_payload_bytes(state: SenderState, version: int) -> int:
    """``len()`` of the full payload of ``state``'s layout at ``version``, from shapes alone
    (the header differs between versions only in the digits of the version)."""
    return state.dense_size0 + len(str(int(version))) - 1


def with_lanes(state: SenderState) -> SenderState:
    """``state`` with its digest lanes computed (one pass over the snapshot, where it lives)."""
    return state if state.lanes is not None else dataclasses.replace(
        state, lanes=_snapshot_lanes(state))


def base_digest(state: SenderState) -> str:
    """``device_digest`` of the snapshot (what the next step payload names as its base); a
    pass over the snapshot when ``state.lanes`` is None (``with_lanes`` keeps it)."""
    return digest.combine(state.treedef, state.specs, _snapshot_lanes(state))


def with_digest(state: SenderState) -> SenderState:
    """``state`` with ``digest = tree_digest(snapshot)`` (the end-to-end check of a sync)."""
    return state if state.digest is not None else dataclasses.replace(
        state, digest=tree_digest(state.snapshot))


def dense_payload_of(params: Any, version: int) -> bytes:
    """A full payload of ``params`` at ``version``, base FRESH: it applies from any version
    (``Payload.is_full``). The leaves are read whole (from the devices on the device path)."""
    treedef, leaves, specs = tree_layout(params)
    fetched = jax.device_get(leaves)
    empty = np.zeros(0, np.uint16)
    diffs = [LeafDiff(np.zeros(0, np.int64), empty, empty,
                      bits.host_array(leaf).reshape(-1)) for leaf in fetched]
    return encode_diffs(treedef, specs, diffs, base_version=FRESH, version=version,
                        codec="dense").to_bytes()


def with_dense_payload(state: SenderState) -> SenderState:
    """``state`` with ``dense`` = the full payload of its snapshot (the resync payload)."""
    return state if state.dense is not None else dataclasses.replace(
        state, dense=dense_payload_of(state.snapshot, state.version))


def chain_from(state: SenderState, version: int) -> list[bytes] | None:
    """Step payloads from ``version`` to ``state.version``, or None if not in the history."""
    by_base = {step.base_version: step for step in state.steps}
    chain, v = [], version
    while v != state.version:
        if v not in by_base:
            return None
        step = by_base[v]
        v = step.version
        chain.append(step.data)
    return chain


def plan(state: SenderState, replica_version: int) -> tuple[SenderState, str, list[bytes]]:
    """What to send a replica at ``replica_version``: nothing ("current"), the chain of step
    payloads ("chain") or one dense resync ("dense"), whichever is fewest bytes. Returns
    (``state`` with its dense payload made, the route, the payloads in order)."""
    if replica_version == state.version:
        return state, "current", []
    chain = chain_from(state, replica_version) if replica_version >= 0 else None
    state = with_dense_payload(state)
    if chain is not None and sum(map(len, chain)) <= len(state.dense):
        return state, "chain", chain
    return state, "dense", [state.dense]


__all__ = ["EncodedDiff", "PublishStats", "SenderState", "Step", "base_digest", "chain_from",
           "dense_payload_bytes", "dense_payload_of", "encode_on_device", "encode_on_host",
           "plan", "publish", "sender_state", "with_dense_payload", "with_digest", "with_lanes"]
