"""Trie-constrained decoding: never an invalid item (property test over random tries), beam
search == exhaustive ranking when the beam covers the catalogue, empty histories, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.genrec import beam
from jaxflow.genrec.model import GenRecConfig
from jaxflow.genrec.train import init_model
from jaxflow.genrec.trie import build_trie, item_of

L, W, NODES = 3, 5, 1 + 40 * 3
CFG = GenRecConfig(levels=L, width=W, instruction_vocab=6, max_instruction=2, max_history=4,
                   behaviours=2, d_model=16, n_heads=2, d_ff=32, encoder_layers=1,
                   decoder_layers=1)


def _random_codes(rng, n):
    flat = rng.choice(W ** L, n, replace=False)
    return np.stack(np.unravel_index(flat, (W,) * L), 1).astype(np.int32)


def _inputs(rng, b, codes):
    hist = rng.integers(0, len(codes), (b, 6))
    valid = rng.random((b, 6)) < 0.6
    valid[0] = False  # an empty history
    return (jnp.asarray(rng.integers(0, 6, (b, 2)), jnp.int32), jnp.asarray(codes[hist]),
            jnp.asarray(rng.integers(0, 2, (b, 6)), jnp.int32), jnp.asarray(valid))


@pytest.fixture(scope="module")
def model():
    graphdef, params = init_model(CFG, seed=0)
    search = {k: jax.jit(lambda p, t, *enc, k=k: beam.beam_search(nnx.merge(graphdef, p), t, *enc,
                                                                    beam_size=k))
              for k in (3, 8)}
    sample = jax.jit(lambda p, t, key, *enc: beam.constrained_sample(
        nnx.merge(graphdef, p), t, *enc, samples=3, key=key))
    logp = jax.jit(lambda p, t, *args: beam.constrained_logp(nnx.merge(graphdef, p), t, *args))
    return graphdef, params, search, sample, logp


def test_trie_round_trip_and_invalid_tuples():
    rng = np.random.default_rng(0)
    codes = _random_codes(rng, 30)
    trie = build_trie(codes, W, pad_nodes=NODES)
    assert trie.children.shape == (NODES, W)
    np.testing.assert_array_equal(np.asarray(item_of(trie, jnp.asarray(codes))), np.arange(30))
    valid = {tuple(c) for c in codes.tolist()}
    others = np.asarray([c for c in np.ndindex(W, W, W) if c not in valid][:50], np.int32)
    assert (np.asarray(item_of(trie, jnp.asarray(others))) == -1).all()
    with pytest.raises(ValueError, match=r"shared by 2 items"):
        build_trie(np.concatenate([codes, codes[:1]]), W)
    with pytest.raises(ValueError, match=r"code 5 outside \[0, width=5\)"):
        build_trie(np.asarray([[0, 5, 1]]), W)


def test_constrained_decoding_never_emits_an_invalid_item(model):
    """Property: over random tries (1..40 items) and random requests, every beam with a finite
    score and every sample is a catalogue item whose codes are the emitted codes; a row has
    min(K, N) distinct items."""
    _, params, search, sample, _ = model
    rng = np.random.default_rng(1)
    for trial in range(8):
        n = int(rng.integers(1, 41))
        codes = _random_codes(rng, n)
        trie = build_trie(codes, W, pad_nodes=NODES)
        enc = _inputs(rng, 8, codes)
        for k, fn in search.items():
            items, emitted, scores = (np.asarray(x) for x in fn(params, trie, *enc))
            finite = np.isfinite(scores)
            assert (finite.sum(1) == min(k, n)).all(), (trial, n, k)
            assert ((items >= 0) == finite).all()
            for b in range(8):
                got = items[b][finite[b]]
                assert len(set(got.tolist())) == len(got)
                np.testing.assert_array_equal(codes[got], emitted[b][finite[b]])
            assert (np.diff(np.where(finite, scores, -1e30), axis=1) <= 1e-6).all()
        drawn, drawn_codes, logp = (np.asarray(x) for x in sample(params, trie,
                                                                  jax.random.key(trial), *enc))
        assert ((drawn >= 0) & (drawn < n)).all()
        np.testing.assert_array_equal(codes[drawn], drawn_codes)
        assert np.isfinite(logp).all() and (logp <= 0).all()


def test_full_beam_equals_exhaustive_ranking(model):
    """With beam >= N every item survives each level, so the beam's order is the ranking of
    all items by their (masked) sequence log-probability."""
    _, params, search, _, logp_fn = model
    rng = np.random.default_rng(2)
    codes = _random_codes(rng, 7)
    trie = build_trie(codes, W, pad_nodes=NODES)
    enc = _inputs(rng, 8, codes)
    items, _, scores = (np.asarray(x) for x in search[8](params, trie, *enc))
    rep = [jnp.repeat(x, 7, axis=0) for x in enc]
    all_codes = jnp.asarray(np.tile(codes, (8, 1)))
    seq = np.asarray(logp_fn(params, trie, *rep, all_codes)).sum(-1).reshape(8, 7)
    order = np.argsort(-seq, axis=1, kind="stable")
    np.testing.assert_array_equal(items[:, :7], order)
    np.testing.assert_allclose(scores[:, :7], np.take_along_axis(seq, order, 1), rtol=1e-5,
                               atol=1e-5)


def test_empty_history_is_finite_and_long_instruction_is_an_error(model):
    graphdef, params, *_ = model

    @jax.jit
    def encode(params, instruction, codes, behaviour, valid):
        return nnx.merge(graphdef, params).encode(instruction, codes, behaviour, valid)

    codes = jnp.zeros((2, 3, L), jnp.int32)
    memory, valid = encode(params, jnp.ones((2, 2), jnp.int32), codes,
                           jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), bool))
    assert np.isfinite(np.asarray(memory)).all()
    assert np.asarray(valid).sum(1).tolist() == [3, 3]  # BOS + 2 instruction tokens only
    with pytest.raises(ValueError, match="instruction length 3 exceeds the encoder's "
                                         "max_instruction=2"):
        encode(params, jnp.ones((2, 3), jnp.int32), codes, jnp.zeros((2, 3), jnp.int32),
               jnp.ones((2, 3), bool))


def test_constrained_beam_search_lowers_for_tpu_and_cuda(model):
    _, params, search, _, _ = model
    rng = np.random.default_rng(4)
    codes = _random_codes(rng, 10)
    trie = build_trie(codes, W, pad_nodes=NODES)
    exported = jax.export.export(search[8], platforms=("tpu", "cuda"))(
        params, trie, *_inputs(rng, 8, codes))
    assert exported.platforms == ("tpu", "cuda")
    assert [a.shape for a in exported.out_avals] == [(8, 8), (8, 8, L), (8, 8)]


def test_decoding_covers_the_dedup_level_of_a_skewed_catalogue(model):
    """Six identical items overflow the last level (width 5), so RQ-KMeans appends a
    de-duplication code: 2 k-means levels + 1 = the model's L = 3. The trie, the full beam,
    sampling and log-probs work over the dedup level: the full beam returns every item once,
    ranked by its whole-ID log-probability, and sampled codes spell the sampled items."""
    from jaxflow.genrec.semantic_ids import rq_kmeans

    _, params, search, sample, logp_fn = model
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal((2, 4)), np.ones((6, 4))]).astype(np.float32)
    sid = rq_kmeans(x, levels=2, width=W, key=jax.random.key(0), iters=3)
    assert sid.largest_prefix_group >= 6 and sid.dedup_levels == 1 and sid.levels == L
    n = len(x)
    assert len(np.unique(sid.codes[-6:, :2], axis=0)) < 6  # k-means codes alone collide
    trie = build_trie(sid.codes, W, pad_nodes=NODES)
    np.testing.assert_array_equal(np.asarray(item_of(trie, jnp.asarray(sid.codes))),
                                  np.arange(n))
    enc = _inputs(rng, 8, sid.codes)
    items, emitted, scores = (np.asarray(a) for a in search[8](params, trie, *enc))
    assert np.isfinite(scores).all()
    for b in range(8):
        assert sorted(items[b].tolist()) == list(range(n))
        np.testing.assert_array_equal(sid.codes[items[b]], emitted[b])
    rep = [jnp.repeat(a, n, axis=0) for a in enc]
    seq = np.asarray(logp_fn(params, trie, *rep, jnp.asarray(np.tile(sid.codes, (8, 1))))
                     ).sum(-1).reshape(8, n)
    np.testing.assert_allclose(scores, np.take_along_axis(seq, items, 1), rtol=1e-5, atol=1e-5)
    drawn, codes, logp = (np.asarray(a) for a in sample(params, trie, jax.random.key(3), *enc))
    assert ((drawn >= 0) & (drawn < n)).all() and np.isfinite(logp).all()
    np.testing.assert_array_equal(sid.codes[drawn], codes)
