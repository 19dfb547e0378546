"""Bit-exact round trips of every sync codec on adversarial trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow import sync
from jaxflow.sync import bound, codecs, entropy
from jaxflow.sync.diff import diff_tree
from tests.test_sync_trees import adversarial_pair, tree_bits


@pytest.mark.parametrize("codec", sync.CODECS)
@pytest.mark.parametrize("bucket_elems", [1 << 26, 1000])
def test_round_trip_is_bit_exact(codec, bucket_elems):
    old, new = adversarial_pair()
    payload = sync.encode(old, new, base_version=4, version=5, codec=codec,
                          bucket_elems=bucket_elems)
    wire = payload.to_bytes()
    received = sync.Payload.from_bytes(wire)
    assert received == payload
    out = sync.apply(received, old, version=4)
    assert tree_bits(out) == tree_bits(new)
    assert tree_bits(old) != tree_bits(new)  # the receiver's input was not modified
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(new)


def test_unchanged_tree_gives_empty_payload_and_same_leaves():
    old, _ = adversarial_pair()
    payload = sync.encode(old, old, base_version=0, version=1)
    assert payload.sections == ()
    out = sync.apply(payload, old, version=0)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(out),
                                      jax.tree_util.tree_leaves(old)))


def test_jax_leaves_round_trip_and_stay_jax():
    old, new = adversarial_pair(1)
    old_j = jax.tree.map(jnp.asarray, old)
    new_j = jax.tree.map(jnp.asarray, new)
    out = sync.apply(sync.encode(old_j, new_j, base_version=0, version=1), old_j, version=0)
    assert tree_bits(out) == tree_bits(new)
    assert isinstance(out["special"], jax.Array)


def test_auto_picks_sparse_mask_and_dense_per_leaf():
    old, new = adversarial_pair()
    payload = sync.encode(old, new, base_version=0, version=1, codec="auto")
    kinds = {payload.leaves[s.leaves[0]].name: s.kind for s in payload.sections
             if len(s.leaves) == 1}
    assert kinds["['all_changed']"] == "mask"  # +1 ulp everywhere: tiny mask + 1-bit values
    assert kinds["['noise']"] == "dense"  # random new values: nothing beats raw
    assert any(s.kind == "entropy" and len(s.leaves) > 1 for s in payload.sections)  # bucket
    assert payload.num_bytes < sync.encode(old, new, base_version=0, version=1,
                                           codec="coo").num_bytes


def test_gap_codec_uses_escapes_for_long_gaps():
    pos = np.array([3, 70_000, 199_999], np.int64)
    vals = np.array([1, 2, 3], np.uint16)
    meta, streams = codecs.gap_encode(pos, vals, 200_000)
    assert meta["width"] == 1 and meta["escapes"] == 2
    got_pos, got_vals = codecs.gap_decode(meta, streams, 200_000)
    np.testing.assert_array_equal(got_pos, pos)
    np.testing.assert_array_equal(got_vals, vals)


@pytest.mark.parametrize("gap_scale", [0, 1, 300, 70_000, 1 << 40])
def test_rice_round_trip(gap_scale):
    rng = np.random.default_rng(gap_scale)
    gaps = rng.integers(0, gap_scale + 1, 1001).astype(np.int64)
    b = entropy.rice_parameter(gaps)
    low, unary, n_unary = entropy.rice_encode(gaps, b)
    np.testing.assert_array_equal(entropy.rice_decode(low, unary, gaps.size, b, n_unary), gaps)


def test_entropy_codec_within_1_3x_of_bound_at_0_6_percent():
    rng = np.random.default_rng(0)
    master = (rng.standard_normal(1 << 20).astype(np.float32) * 0.02)
    step = np.tanh(1.5 * rng.standard_normal(master.size).astype(np.float32))
    old = {"w": master.astype(jnp.bfloat16)}
    new = {"w": (master - np.float32(2.7e-7) * step).astype(jnp.bfloat16)}
    treedef, specs, diffs = diff_tree(old, new)
    density = diffs[0].count / master.size
    assert 0.003 < density < 0.012, density
    limit = bound.entropy_bound_bytes(specs, diffs)
    size = sync.encode(old, new, base_version=0, version=1, codec="entropy").num_bytes
    assert size <= 1.3 * limit, (size, limit)
    assert 2 * master.size / size >= 100


def test_bound_counts_positions_and_values():
    assert bound.log2_binomial(4, 2) == pytest.approx(np.log2(6))
    assert bound.empirical_entropy_bits(np.array([1, -1, 1, -1])) == pytest.approx(1.0)


def test_diff_bits_across_chunk_boundaries():
    from jaxflow.sync import bits
    n = 3 * bits._CHUNK + 5
    old = np.zeros(n, np.uint16)
    new = old.copy()
    where = np.array([0, bits._CHUNK - 1, bits._CHUNK, 2 * bits._CHUNK + 7, n - 1])
    new[where] = np.arange(1, 6, dtype=np.uint16)
    pos, old_at, new_at = bits.diff_bits(old, new)
    np.testing.assert_array_equal(pos, where)
    np.testing.assert_array_equal(new_at, np.arange(1, 6))
    np.testing.assert_array_equal(old_at, np.zeros(5))
    assert bits.diff_bits(old, old)[0].size == 0


def test_one_codec_registry_names_and_checks_every_codec_argument():
    """encode, the sender, SyncConfig, a payload header and the sparse_sync config all check a
    codec name through ``codec_registry.check_codec``: one list, one message each way."""
    from configs.sparse_sync import Config as SparseSyncConfig
    from jaxflow.sync import codec_registry

    assert sync.CODECS is codec_registry.CODECS
    assert [c for c in sync.CODECS if codec_registry.sends_new_values(c)] == ["coo", "gap"]
    old, new = adversarial_pair()
    valid = r"; valid: \('dense', 'coo', 'gap', 'entropy', 'auto'\)"
    for call in (lambda: sync.encode(old, new, base_version=0, version=1, codec="zip"),
                 lambda: sync.SyncSender(old, codec="zip"),
                 lambda: sync.check_codec("zip")):
        with pytest.raises(ValueError, match=rf"^unknown codec 'zip'{valid}$"):
            call()
    with pytest.raises(sync.PayloadError, match=rf"^unknown codec 'zip'{valid}$"):
        sync.check_codec("zip", error=sync.PayloadError)
    with pytest.raises(ValueError, match=rf"^sync.codec='none'{valid} \(no weight sync: set sync=none\)$"):
        sync.SyncConfig(codec="none")
    with pytest.raises(ValueError, match=rf"^codecs\[1\]='zip'{valid}$"):
        SparseSyncConfig(codecs=("dense", "zip"))
    assert sync.check_codec("gap") == "gap"
