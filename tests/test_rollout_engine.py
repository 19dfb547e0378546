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
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import PRESETS, SamplingConfig, Transformer, make_sampler
from jaxflow.models.sampler import make_decoder
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
def prompts():
    rng = np.random.default_rng(0)
    out = np.zeros((len(LENGTHS), P), np.int32)
    for i, n in enumerate(LENGTHS):
        out[i, :n] = rng.integers(1, TINY.vocab_size, n)
    return out


def _keys(n, seed=3):
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.arange(n))


def _engine(split_model, sampling, **kw):
    graphdef, state = split_model
    cfg = dict(slots=3, page_size=8, num_pages=40, prefill_chunk=5, max_seq_len=P + N)
    cfg.update(kw)
    return RolloutEngine(graphdef, state, EngineConfig(**cfg), sampling)


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
    out = _engine(split_model, sampling).generate(prompts, LENGTHS, keys)
    _assert_same(out, ref)
    if sampling.eos_id is not None:  # the case is exercised: some rows end early
        assert (out.lengths < N).sum() >= 2, out.lengths


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
    eng = _engine(split_model, sampling, num_pages=60)
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
    _, out = steps.decode(state, pools, np.asarray(carry.token), LENGTHS + 1, table,
                          np.asarray(jax.random.key_data(keys)), np.ones(b, np.int32))
    np.testing.assert_array_equal(np.asarray(out.token), np.asarray(token[0]))
    np.testing.assert_array_equal(np.asarray(out.logprob), np.asarray(logprob[0]))


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
    with pytest.raises(RolloutConfigError, match=r"prompt_lengths=0"):
        eng.generate(np.ones((2, 4), np.int32), np.array([0, 4]), _keys(2))
    assert eng.idle()
