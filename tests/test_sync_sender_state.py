"""The sender as a value (jaxflow.sync.sender): ``publish(state, params)`` returns a new state
and what it sent without touching the old state, on both diff paths; ``SyncSender`` is a thin
wrapper with the same bytes; the device path's whole-leaf fetch count follows from the
payload."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow import sync
from jaxflow.sync import device_diff, sender
from jaxflow.sync.encoder import encode_diffs
from jaxflow.sync.replica import Replica
from jaxflow.sync.sync_sender import SyncSender
from jaxflow.sync.weight_sync import SyncConfig, WeightSync
from tests.test_sync_transport import trainer_tree, trajectory


def _on(path, tree):
    return jax.tree.map(jnp.asarray, tree) if path == "device" else tree


def _hot(tree):
    """Every element of "embed" redrawn over a wide range (about 15 random bits of each bf16):
    auto's dense fallback reads it whole."""
    rng = np.random.default_rng(7)
    shape = tree["embed"].shape
    wide = np.sign(rng.normal(size=shape)) * np.exp(rng.uniform(-80, 80, size=shape))
    return dict(tree, embed=wide.astype(np.float32))


def _frozen_view(state):
    return (state.version, sync.tree_digest(state.snapshot), state.steps, state.digest,
            state.dense, None if state.lanes is None else state.lanes.copy())


def _same_frozen_view(a, b):
    assert a[:5] == b[:5]
    if a[5] is None or b[5] is None:
        assert a[5] is None and b[5] is None
    else:
        np.testing.assert_array_equal(a[5], b[5])


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("codec", ["auto", "coo", "dense"])
def test_publish_returns_a_new_state_and_leaves_the_old_one(path, codec):
    trees = trajectory(2)
    state0 = sender.sender_state(_on(path, trainer_tree()), codec=codec, path=path, history=4)
    state0 = sender.with_dense_payload(sender.with_digest(sender.with_lanes(state0)))
    before = _frozen_view(state0)
    scratch = {}
    s1, sent = sender.publish(state0, _on(path, trees[0]), with_bound=True, scratch=scratch)
    s1_again, sent_again = sender.publish(state0, _on(path, trees[0]), with_bound=True,
                                          scratch=scratch)
    _same_frozen_view(before, _frozen_view(state0))  # nothing of the old state changed
    assert sent.payload == sent_again.payload and len(sent.payload) == sent.payload_bytes > 0
    assert (dataclasses.replace(sent, encode_s=0.0)
            == dataclasses.replace(sent_again, encode_s=0.0))
    assert sent.version == s1.version == 1 and sent.base_version == state0.version == 0
    assert sender.chain_from(s1, 0) == [sent.payload] and sender.chain_from(state0, 0) == []
    assert sender.base_digest(s1) == sender.base_digest(s1_again) == sync.device_digest(
        s1.snapshot)
    assert s1.digest is None and s1.dense is None  # caches belong to their version
    # a different branch from the same old state: another payload, the old state still intact
    s2, other = sender.publish(state0, _on(path, _hot(trees[1])), version=5)
    assert other.payload != sent.payload and s2.version == 5
    _same_frozen_view(before, _frozen_view(state0))
    # the step payload applies bit-exactly to a replica at the old version
    replica = Replica(sync.to_bf16(trainer_tree()))
    replica.receive(sent.payload)
    assert replica.digest() == sync.tree_digest(sync.to_bf16(trees[0]))
    if s1.lanes is not None:
        assert not s1.lanes.flags.writeable


@pytest.mark.parametrize("path", ["host", "device"])
def test_the_wrapper_sends_what_the_pure_functions_make(path):
    trees = [trainer_tree(), *trajectory(3), _hot(trajectory(4)[-1])]
    wrapper = SyncSender(_on(path, trees[0]), codec="auto", path=path, history=2)
    state = sender.sender_state(_on(path, trees[0]), codec="auto", path=path, history=2)
    for v, tree in enumerate(trees[1:], start=1):
        stats = wrapper.publish(_on(path, tree))
        state, sent = sender.publish(state, _on(path, tree))
        assert stats.payload == sent.payload == wrapper.chain_from(v - 1)[0]
        assert stats.payload_bytes == len(stats.payload) and stats.path == path
        assert stats.dense_bytes == len(wrapper.dense_payload())
    assert wrapper.version == state.version == len(trees) - 1
    assert len(state.steps) == 2 and sender.chain_from(state, 1) is None  # out of history
    state, route, payloads = sender.plan(state, 1)
    assert route == "dense" and payloads == [wrapper.dense_payload()] == [state.dense]
    assert wrapper.plan(1) == payloads and wrapper.routes == ["dense"]
    assert wrapper.base_digest() == sender.base_digest(state)
    assert wrapper.digest() == sync.tree_digest(sync.to_bf16(trees[-1]))


@pytest.mark.parametrize("codec", ["auto", "dense", "coo"])
def test_loaded_bytes_count_what_the_encoder_fetched_whole(codec):
    """``device_diff.loaded_bytes`` (derived from the payload) equals a counter around every
    ``load_full`` the encoder calls -- what the removed in-dataclass counter measured."""
    old, new = trainer_tree(), _hot(trajectory(1)[0])
    snapshot = device_diff.cast_tree(_on("device", old))
    found = device_diff.device_diff(snapshot, _on("device", new),
                                    values=device_diff.values_for_codec(codec))
    counted = []

    def counting(load):
        def wrapped():
            out = load()
            counted.append(out.nbytes)
            return out
        return wrapped

    diffs = [dataclasses.replace(d, load_full=counting(d.load_full)) if d.load_full else d
             for d in found.diffs]
    payload = encode_diffs(found.treedef, found.specs, diffs, base_version=0, version=1,
                           codec=codec)
    assert device_diff.loaded_bytes(found, payload) == sum(counted)
    assert (sum(counted) > 0) == (codec != "coo")  # dense: every bf16 leaf; auto: "embed"


def test_weight_sync_publish_returns_the_record_it_appended():
    ws = WeightSync(trainer_tree(), None, SyncConfig(codec="auto", path="host"))
    record = ws.publish(trajectory(1)[0], version=1)
    assert ws.records == [record] and record.bit_exact
    assert record.stats.payload == b"" and record.stats.payload_bytes > 0  # records drop bytes
    assert record.stats.payload_bytes == len(ws.sender.chain_from(0)[0])
