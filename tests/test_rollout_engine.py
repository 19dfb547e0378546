"""RolloutEngine: equal to the static sampler (mixed prompt lengths, early EOS, shared group
prefixes), the decode step and prefill bit-identical to the static sampler's on the same shapes,
pages freed and reused, continuous batching independent of slots / admission order, per-token
weight versions across an in-place update, clear errors on bad input.

Tolerance of the end-to-end comparison: tokens and masks exactly equal, log-probs within
``LOGPROB_ATOL``. XLA:CPU's f32 matmuls are not invariant to the row count of the batch they run
in (the static sampler itself gives a row different log-probs, by ~2e-6, when it runs in another
batch or with wider prompt padding: ``test_static_sampler_is_not_batch_invariant``), and the
engine runs a row in other batches (``slots`` rows per decode, ``prefill_chunk`` tokens per
prefill). On the same shapes its arithmetic is the static sampler's bit for bit
(``test_decode_step_and_prefill_bit_identical``).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import PRESETS, SamplingConfig, Transformer, make_sampler
from jaxflow.models.sampler import LogitsHook, make_decoder
from jaxflow.rollout import EngineConfig, RolloutConfigError, RolloutEngine
from jaxflow.rollout.model_step import Pools, empty_pools, make_steps
from jaxflow.rollout.paged_attention import gather_pages

TINY = PRESETS["tiny"]  # the flagship's shape: 2 layers, d_model 64, 4 heads / 2 KV heads
P, N = 12, 20
LENGTHS = np.array([12, 3, 1, 7, 9, 5], np.int32)
LOGPROB_ATOL = 1e-5
EOS = 5


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def new_state():
    """Other weights of the same structure (an update's)."""
    return nnx.split(Transformer(TINY, rngs=nnx.Rngs(1)))[1]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    out = np.zeros((len(LENGTHS), P), np.int32)
    for i, n in enumerate(LENGTHS):
        out[i, :n] = rng.integers(1, TINY.vocab_size, n)
    return out


def _keys(n, seed=3):
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.arange(n))


def _engine(split_model, sampling, mesh=None, **kw):
    graphdef, state = split_model
    # one compiled shape per program (page tables always max_seq_len wide, every slot / prefill
    # row in each call), and one pool size: engines of a sampling config share their programs
    cfg = dict(slots=3, page_size=8, num_pages=60, prefill_chunk=5, max_seq_len=P + N,
               narrow_tables=False, bucket_rows=False)
    cfg.update(kw)
    return RolloutEngine(graphdef, state, EngineConfig(**cfg), sampling, mesh=mesh)


def _assert_same(out, ref, rows=slice(None)):
    np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens)[rows])
    np.testing.assert_array_equal(out.mask, np.asarray(ref.mask)[rows])
    np.testing.assert_array_equal(out.lengths, np.asarray(ref.lengths)[rows])
    np.testing.assert_allclose(out.logprobs, np.asarray(ref.logprobs)[rows], rtol=0,
                               atol=LOGPROB_ATOL)


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=N, temperature=1.0),
    SamplingConfig(max_new_tokens=N, temperature=0.8, top_k=6, eos_id=EOS),
    SamplingConfig(max_new_tokens=N, temperature=0.0, eos_id=EOS),
], ids=["plain", "topk-eos", "greedy-eos"])
def test_matches_static_sampler(split_model, prompts, sampling):
    graphdef, state = split_model
    keys = _keys(len(LENGTHS))
    ref = make_sampler(graphdef, sampling, per_row_keys=True)(state, prompts, LENGTHS, keys)
    # one case with page tables as wide as rows need and calls as many rows as run (defaults)
    narrow = sampling.temperature == 1.0
    out = _engine(split_model, sampling, narrow_tables=narrow, bucket_rows=narrow).generate(
        prompts, LENGTHS, keys)
    _assert_same(out, ref)
    if sampling.eos_id is not None:  # the case is exercised: some rows end early
        assert (out.lengths < N).sum() >= 2, out.lengths


def test_stateless_logits_hook_matches_static_sampler(split_model, prompts):
    """A stateless LogitsHook (here: token 1 banned, logits shifted by the step index) is applied
    per row with the row's own step, as the static sampler applies it per step."""
    graphdef, state = split_model
    hook = LogitsHook(apply=lambda logits, _, step, __: logits.at[:, 1].set(-jnp.inf)
                      + 0.01 * jnp.reshape(step, (-1, 1)))
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
    keys = _keys(len(LENGTHS), seed=9)
    ref = make_sampler(graphdef, sampling, per_row_keys=True, logits_hook=hook)(
        state, prompts, LENGTHS, keys)
    eng = RolloutEngine(graphdef, state, EngineConfig(slots=3, page_size=8, num_pages=40,
                                                      prefill_chunk=5, max_seq_len=P + N,
                                                      narrow_tables=False),
                        sampling, logits_hook=hook)
    out = eng.generate(prompts, LENGTHS, keys)
    _assert_same(out, ref)
    assert not (out.tokens[out.mask > 0] == 1).any()
    with pytest.raises(RolloutConfigError, match="update but no init"):
        RolloutEngine(graphdef, state, EngineConfig(), sampling,
                      logits_hook=LogitsHook(apply=hook.apply, update=lambda s, t, a: s))


def _seen(tokens, vocab):
    return jax.nn.one_hot(tokens, vocab, dtype=jnp.bool_).any(axis=1)


REPETITION_PENALTY = LogitsHook(  # a per-row state: the tokens seen so far [B, V]
    apply=lambda logits, seen, step, args: logits - 3.0 * seen,
    init=lambda prompts, valid, vocab, args: _seen(jnp.where(valid, prompts, 0), vocab)
    & (jnp.arange(vocab) > 0),
    update=lambda seen, token, args: seen | _seen(token[:, None], seen.shape[1]))


def test_stateful_logits_hook_matches_static_sampler(split_model, prompts):
    """A hook with per-row state (a repetition penalty): initialised from each sequence's prompt
    when it takes a slot, updated with its own tokens; equal to the static sampler's."""
    graphdef, state = split_model
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
    keys = _keys(len(LENGTHS), seed=13)
    ref = make_sampler(graphdef, sampling, per_row_keys=True, logits_hook=REPETITION_PENALTY)(
        state, prompts, LENGTHS, keys)
    eng = RolloutEngine(graphdef, state, EngineConfig(slots=3, page_size=8, num_pages=40,
                                                      prefill_chunk=5, max_seq_len=P + N,
                                                      narrow_tables=False, bucket_rows=False,
                                                      decode_steps=2),
                        sampling, logits_hook=REPETITION_PENALTY)
    out = eng.generate(prompts, LENGTHS, keys)
    _assert_same(out, ref)
    # the same engine without the hook (the programs of the shared-prefix and mesh tests)
    plain = _engine(split_model, sampling).generate(prompts, LENGTHS, keys)
    assert (plain.tokens != out.tokens).any()  # the penalty changed the samples


def test_shared_prefix_groups_match_static_sampler(split_model, prompts):
    """G rows of one prompt share its prefilled pages (copy-on-write of the partial last page);
    each row equals the static sampler's row of the prompt repeated G times."""
    graphdef, state = split_model
    g = 4
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
    keys = _keys(len(LENGTHS) * g, seed=7)
    reps = np.repeat(prompts, g, axis=0)
    ref = make_sampler(graphdef, sampling, per_row_keys=True)(state, reps, np.repeat(LENGTHS, g),
                                                              keys)
    eng = _engine(split_model, sampling)
    out = eng.generate(prompts, LENGTHS, keys, group_size=g)
    _assert_same(out, ref)
    # rows of a group differ (own keys), and copies happened for the partial prefix pages:
    # G - 1 per prompt whose prefix (L - 1 tokens) ends inside a page
    assert len({tuple(r) for r in out.tokens[:g]}) > 1
    partial = sum((n - 1) % 8 != 0 for n in LENGTHS)
    assert eng.stats.page_copies == partial * (g - 1)
    assert eng.scheduler.pages.in_use == 0 and eng.scheduler.pages.reserved == 0


def test_static_sampler_is_not_batch_invariant(split_model, prompts):
    """Why the end-to-end comparison has a tolerance: the static sampler on a sub-batch."""
    graphdef, state = split_model
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0)
    fn = make_sampler(graphdef, sampling, per_row_keys=True)
    keys = _keys(len(LENGTHS))
    full = fn(state, prompts, LENGTHS, keys)
    part = fn(state, prompts[:3], LENGTHS[:3], keys[:3])
    diff = np.abs(np.asarray(part.logprobs) - np.asarray(full.logprobs)[:3]).max()
    assert 0 < diff < LOGPROB_ATOL


def test_decode_step_and_prefill_bit_identical(split_model, prompts):
    """Same shapes, same arithmetic: the paged prefill (one chunk of the whole padded prompt
    for all rows) writes the static prefill's keys/values bit for bit, and a paged decode step
    from the static cache draws the static decode step's token and log-prob bit for bit."""
    graphdef, state = split_model
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0)
    b, s, ps, kvh, hd = len(LENGTHS), P + N, 8, TINY.n_kv_heads, TINY.head_dim
    width = s // ps
    table = (np.arange(b * width).reshape(b, width) + 1).astype(np.int32)
    keys = _keys(b)
    dec = make_decoder(graphdef, sampling, per_row_keys=True)
    carry, _ = jax.jit(dec.prefill)(state, prompts, LENGTHS, keys)
    steps = make_steps(graphdef, sampling, page_size=ps)

    pools = empty_pools(n_layers=TINY.n_layers, n_kv_heads=kvh, num_pages=1 + b * width,
                        page_size=ps, head_dim=hd, dtype=jnp.float32)
    pools = steps.prefill(state, pools, prompts, np.zeros(b, np.int32), LENGTHS, table)
    written = np.arange(s)[None, :] < LENGTHS[:, None]
    for paged, static in zip(pools.k + pools.v, carry.cache.k + carry.cache.v):
        np.testing.assert_array_equal(np.asarray(gather_pages(paged, table))[written],
                                      np.asarray(static)[written])

    def to_pool(x):  # the static cache [B, S, KVH, D] as pages 1.. of a pool
        pages = jnp.transpose(x.reshape(b * width, ps, kvh, hd), (2, 0, 1, 3))
        return jnp.concatenate([jnp.zeros((kvh, 1, ps, hd), x.dtype), pages], axis=1)

    pools = Pools(tuple(map(to_pool, carry.cache.k)), tuple(map(to_pool, carry.cache.v)))
    _, (token, logprob, _) = jax.jit(dec.decode, static_argnums=6)(
        state, carry, LENGTHS, keys, None, jnp.int32(1), 1)
    _, out, _ = steps.decode(state, pools, np.asarray(carry.token), LENGTHS + 1, table,
                             np.asarray(jax.random.key_data(keys)), np.ones(b, np.int32),
                             np.full(b, N - 1, np.int32), 1)
    np.testing.assert_array_equal(np.asarray(out.token[0]), np.asarray(token[0]))
    np.testing.assert_array_equal(np.asarray(out.logprob[0]), np.asarray(logprob[0]))


def test_bad_input_names_the_value(split_model):
    graphdef, state = split_model
    sampling = SamplingConfig(max_new_tokens=N)
    with pytest.raises(RolloutConfigError, match="page_size=0"):
        EngineConfig(page_size=0)
    with pytest.raises(RolloutConfigError, match=r"num_pages=4.*>= 5 pages"):
        RolloutEngine(graphdef, state, EngineConfig(page_size=8, num_pages=4, max_seq_len=32),
                      sampling)
    with pytest.raises(RolloutConfigError, match="max_seq_len=200 exceeds the model's"):
        RolloutEngine(graphdef, state, EngineConfig(max_seq_len=200), sampling)
    with pytest.raises(RolloutConfigError, match="attention='flash'"):
        EngineConfig(attention="flash")
    eng = _engine(split_model, sampling)
    with pytest.raises(RolloutConfigError, match=r"prompt length 13 \+ max_new_tokens 20 = 33"):
        eng.add_request(np.ones(13, np.int32), _keys(1))
    with pytest.raises(RolloutConfigError, match=r"max_new_tokens=21"):
        eng.add_request(np.ones(3, np.int32), _keys(1), max_new_tokens=21)
    with pytest.raises(RolloutConfigError, match="6 keys for 3 prompts x group_size 4"):
        eng.generate(np.ones((3, 4), np.int32), np.full(3, 4), _keys(6), group_size=4)
    with pytest.raises(RolloutConfigError, match="PRNG implementation"):
        eng.add_request(np.ones(3, np.int32), jax.random.split(jax.random.key(0, impl="rbg"), 2))
    with pytest.raises(RolloutConfigError, match=r"keys: need \[G >= 1\] PRNG keys"):
        eng.add_request(np.ones(3, np.int32), np.zeros((2, 2), np.int32))
    with pytest.raises(RolloutConfigError, match=r"prompt_lengths=0"):
        eng.generate(np.ones((2, 4), np.int32), np.array([0, 4]), _keys(2))
    other = nnx.split(Transformer(dataclasses.replace(TINY, n_layers=1), rngs=nnx.Rngs(0)))[1]
    with pytest.raises(RolloutConfigError, match="update_weights: the params' tree structure"):
        eng.update_weights(other, version=1)
    assert eng.idle() and eng.version == 0


def _long_tailed(n, seed=0):
    """n prompts (lengths 1..12) and per-request max_new_tokens: most short, a few at the cap."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, P + 1, n).astype(np.int32)
    prompts = [rng.integers(1, TINY.vocab_size, int(m)).astype(np.int32) for m in lengths]
    caps = np.where(rng.random(n) < 0.2, N, rng.integers(1, 6, n)).astype(np.int32)
    return prompts, caps


def _serve(eng, prompts, caps, order):
    """Adds the requests in ``order`` (keys by request index), runs, returns outputs by index."""
    rid = {i: eng.add_request(prompts[i], _keys(1, seed=100 + i), max_new_tokens=int(caps[i]))
           for i in order}
    eng.run()
    return [eng.result(rid[i]) for i in range(len(prompts))]


def test_pages_freed_and_reused(split_model):
    """16 requests through 2 slots and a pool of 2 maximal sequences: every request is served,
    pages are reused many times, the peak stays within the pool, and all pages come back."""
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
    prompts, caps = _long_tailed(16)
    width = (P + N) // 4
    eng = _engine(split_model, sampling, slots=2, page_size=4, num_pages=1 + 2 * width)
    outs = _serve(eng, prompts, caps, range(16))
    pages = eng.scheduler.pages
    assert all(o.lengths[0] >= 1 for o in outs)
    assert pages.allocations > 2 * pages.capacity  # reused
    assert pages.peak_in_use <= pages.capacity
    assert pages.in_use == 0 and pages.reserved == 0 and eng.idle()
    assert (pages.refcount == 0).all()


def test_continuous_batching_independent_of_slots_and_order(split_model):
    """More requests than slots, all served; a request's tokens do not depend on the slot count,
    the admission order or the decode steps per call (log-probs within the f32 batch-shape
    tolerance, see module doc)."""
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
    prompts, caps = _long_tailed(10, seed=1)
    base = _serve(_engine(split_model, sampling, slots=4, prefill_rows=2), prompts, caps,
                  range(10))
    for slots, order, steps in ((4, range(9, -1, -1), 1), (1, range(10), 1),
                                (3, [3, 1, 4, 0, 5, 9, 2, 6, 8, 7], 3)):
        eng = _engine(split_model, sampling, slots=slots, prefill_rows=2, decode_steps=steps,
                      narrow_tables=steps > 1, bucket_rows=steps > 1)
        outs = _serve(eng, prompts, caps, order)
        assert eng.stats.tokens == sum(o.lengths[0] for o in outs) <= eng.stats.decode_row_steps
        for a, b in zip(base, outs):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.lengths, b.lengths)
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL)
    assert [o.tokens.shape[1] for o in base] == list(caps)


def test_update_weights_mid_sequence(split_model, prompts, new_state):
    """An update after step k: tokens 0..k-1 carry version 0, the rest version 1, and they equal
    the static decoder run with the old weights up to token k-1 and the new ones after."""
    graphdef, state_a = split_model
    state_b = new_state
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0)
    rows, k = [0, 3], 4
    keys = _keys(2, seed=11)
    eng = _engine(split_model, sampling, slots=2, prefill_rows=2, prefill_chunk=P)
    rids = [eng.add_request(prompts[r, :LENGTHS[r]], keys[i:i + 1]) for i, r in enumerate(rows)]
    for _ in range(k):  # step 1 prefills both prompts and draws token 0
        eng.step()
    eng.update_weights(state_b, version=1)
    eng.run()
    outs = [eng.result(rid) for rid in rids]
    for o in outs:
        np.testing.assert_array_equal(o.versions[0], [0] * k + [1] * (N - k))

    dec = make_decoder(graphdef, sampling, per_row_keys=True)
    lengths = LENGTHS[rows]
    carry, (tok0, lp0, _) = jax.jit(dec.prefill)(state_a, prompts[rows], lengths, keys)
    decode = jax.jit(dec.decode, static_argnums=6)
    carry, (tok_a, lp_a, _) = decode(state_a, carry, lengths, keys, None, jnp.int32(1), k - 1)
    _, (tok_b, lp_b, _) = decode(state_b, carry, lengths, keys, None, jnp.int32(k), N - k)
    _, (tok_only_a, _, _) = decode(state_a, carry, lengths, keys, None, jnp.int32(k), N - k)
    ref_tokens = np.concatenate([np.asarray(tok0)[None], tok_a, tok_b]).T
    ref_lp = np.concatenate([np.asarray(lp0)[None], lp_a, lp_b]).T
    got = np.concatenate([o.tokens for o in outs])
    np.testing.assert_array_equal(got, ref_tokens)
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in outs]), ref_lp, rtol=0,
                               atol=LOGPROB_ATOL)
    assert (np.asarray(tok_only_a).T != got[:, k:]).any()  # the update took effect


def test_follows_sync_replica_in_place(split_model, prompts, new_state):
    """follow(replica): a SparseRL-Sync payload applied to the bf16 replica between steps is
    picked up by the next step (the replica's arrays themselves, no copy), per-token versions
    say so, and the tokens equal an engine given the same bf16 trees by update_weights."""
    from jaxflow.sync.replica import Replica
    from jaxflow.sync.sync_sender import SyncSender
    from jaxflow.sync.wire import to_bf16

    graphdef, state_a = split_model
    pure_b = nnx.to_pure_dict(new_state)
    bf16_a, bf16_b = to_bf16(nnx.to_pure_dict(state_a)), to_bf16(pure_b)
    sender = SyncSender(bf16_a, version=0)
    replica = Replica(jax.device_put(bf16_a), version=0, path="device")
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, top_k=8)
    keys = _keys(3, seed=5)
    model = nnx.merge(graphdef, state_a)  # a Transformer: the structure both engines take

    def run(follow: bool):
        eng = RolloutEngine(model, bf16_a if not follow else
                            replica.params, EngineConfig(slots=2, page_size=8, num_pages=20,
                                                         prefill_chunk=6, max_seq_len=P + N,
                                                         narrow_tables=False),
                            sampling)
        if follow:
            eng.follow(replica)
        rid = eng.add_request(prompts[0, :LENGTHS[0]], keys)
        for _ in range(3):
            eng.step()
        if follow:
            replica.receive(sender.publish(bf16_b, version=1).payload)
        else:
            eng.update_weights(bf16_b, version=1)
        eng.run()
        return eng, eng.result(rid)

    eng, followed = run(True)
    assert replica.version == 1 and eng.version == 1
    leaf = jax.tree.leaves(replica.params)[0]
    assert any(x is leaf for x in jax.tree.leaves(eng._state))  # the replica's array itself
    _, updated = run(False)
    np.testing.assert_array_equal(followed.tokens, updated.tokens)
    np.testing.assert_array_equal(followed.logprobs, updated.logprobs)
    np.testing.assert_array_equal(followed.versions, updated.versions)
    assert set(np.unique(followed.versions[followed.mask > 0])) == {0, 1}


def test_top_logprobs(split_model, prompts):
    """Top-K log-probs: the model's log_softmax at the K most likely tokens (temperature 1, no
    truncation: the sampled token's log-prob appears among them when it is in the top K)."""
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0)
    eng = _engine(split_model, sampling, top_logprobs=4)
    out = eng.generate(prompts, LENGTHS, _keys(len(LENGTHS)))
    assert out.topk_logprobs.shape == (len(LENGTHS), N, 4)
    assert (np.diff(out.topk_logprobs, axis=-1) <= 0).all()
    hit = out.topk_indices == out.tokens[..., None]
    assert hit.any()
    np.testing.assert_array_equal(out.topk_logprobs[hit], np.broadcast_to(
        out.logprobs[..., None], hit.shape)[hit])
    assert (out.topk_logprobs[..., 0] >= out.logprobs).all()


def test_engine_on_a_tensor_parallel_mesh(split_model, prompts):
    """On a 2-device mesh (model 2) the pools hold each device's K/V heads only and the engine
    samples what it samples on one device (tokens equal; log-probs within the tolerance:
    the head-split projections sum in another order)."""
    from jaxflow.mesh import make_mesh

    graphdef, state = split_model
    mesh = make_mesh({"model": 2}, jax.devices()[:2])
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
    keys = _keys(len(LENGTHS) * 2, seed=11)
    # the reference is test_shared_prefix_groups_match_static_sampler's engine (its programs)
    ref = _engine(split_model, sampling).generate(prompts, LENGTHS, keys, group_size=2)
    eng = _engine(split_model, sampling, mesh=mesh)
    out = eng.generate(prompts, LENGTHS, keys, group_size=2)
    _assert_same(out, ref)
    for pool in eng.pools.k + eng.pools.v:  # [KVH=2, pages, S, D]: one head per device
        assert pool.sharding.spec[0] == "model"
        assert {s.data.shape[0] for s in pool.addressable_shards} == {1}
