"""The engine's multi-step compiled decode (EngineConfig.loop_steps) equals single-step decode
(decode_steps=1) bit for bit -- tokens, log-probs, top-K, masks, versions -- with more requests
than slots (slots free at EOS and are refilled mid-run), shared group prefixes, a per-row logits
hook state, fixed and narrow / bucketed shapes; its pages allocated ahead all come back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import SamplingConfig, Transformer, TransformerConfig
from jaxflow.models.sampler import LogitsHook
from jaxflow.rollout import EngineConfig, RolloutConfigError, RolloutEngine
from jaxflow.rollout.decode_loop import loop_min_live, step_widths
from jaxflow.rollout.pages import PageAllocator
from jaxflow.rollout.scheduler import Scheduler

TINY = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                         max_seq_len=24)
P, N, EOS = 8, 16, 5
SAMPLING = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))


def _workload(r, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, P + 1, r).astype(np.int32)
    prompts = np.zeros((r, P), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = rng.integers(1, TINY.vocab_size, n)
    return prompts, lengths


def _keys(n, seed=3):
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.arange(n))


def _run(split_model, prompts, lengths, keys, group_size=1, hook=None, **kw):
    graphdef, state = split_model
    cfg = dict(slots=4, page_size=4, num_pages=60, prefill_chunk=5, max_seq_len=P + N,
               narrow_tables=False, bucket_rows=False)
    cfg.update(kw)
    eng = RolloutEngine(graphdef, state, EngineConfig(**cfg), SAMPLING, logits_hook=hook)
    out = eng.generate(prompts, lengths, keys, group_size=group_size)
    pages = eng.scheduler.pages
    assert pages.in_use == 0 and pages.reserved == 0 and (pages.refcount == 0).all()
    return out, eng.stats


def _assert_bit_identical(a, b):
    for field in a._fields:
        x, y = getattr(a, field), getattr(b, field)
        assert x.shape == y.shape and x.dtype == y.dtype, field
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=field)


def _check_loop(split_model, prompts, lengths, keys, **kw):
    single, s1 = _run(split_model, prompts, lengths, keys, decode_steps=1, **kw)
    looped, s2 = _run(split_model, prompts, lengths, keys, loop_steps=N, **kw)
    _assert_bit_identical(single, looped)
    assert s1.loop_calls == 0 and s2.loop_calls >= 1
    assert s2.decode_calls < s1.decode_calls  # many steps per host round trip
    assert s2.tokens == s1.tokens == int(single.mask.sum())
    assert s2.decode_row_steps == s1.decode_row_steps  # no row idles past its end
    # pages allocated ahead are counted once written; a row that ends inside a loop (nothing
    # queued) holds its pages until the loop returns
    assert s1.peak_pages <= s2.peak_pages <= s1.peak_pages + kw.get("slots", 4) * (P + N)
    return single, s2


def _seen(tokens, vocab):
    return jax.nn.one_hot(tokens, vocab, dtype=jnp.bool_).any(axis=1)


REPETITION_PENALTY = LogitsHook(  # a per-row state: the tokens seen so far [B, V]
    apply=lambda logits, seen, step, args: logits - 3.0 * seen,
    init=lambda prompts, valid, vocab, args: _seen(jnp.where(valid, prompts, 0), vocab),
    update=lambda seen, token, args: seen | _seen(token[:, None], seen.shape[1]))


def test_loop_equals_single_step_with_refills_groups_hook_state_and_top_k(split_model):
    """10 sequences (5 prompts x G = 2, copy-on-write prefixes) through 4 slots, with a per-row
    logits hook state (rows by slot): rows end at EOS and their slots are refilled between
    loops."""
    prompts, lengths = _workload(5)
    kw = dict(group_size=2, top_logprobs=2, hook=REPETITION_PENALTY)
    out, stats = _check_loop(split_model, prompts, lengths, _keys(10), **kw)
    assert (out.lengths < N).sum() >= 2 and (out.lengths == N).sum() >= 2  # EOS and the cap
    assert stats.page_copies > 0 and stats.loop_calls >= 3
    # refills in batches of 3 (ended rows idle until then): fixed shapes, the same draws
    batched, s3 = _run(split_model, prompts, lengths, _keys(10), loop_steps=N, loop_refill=3, **kw)
    _assert_bit_identical(out, batched)
    assert s3.loop_calls < stats.loop_calls and s3.decode_row_steps > stats.decode_row_steps


def test_loop_equals_single_step_narrow_bucketed(split_model):
    """Narrow page tables (an inner loop per width) and bucketed rows (the loop returns when
    the live rows fit half the bucket)."""
    prompts, lengths = _workload(6, seed=1)
    _check_loop(split_model, prompts, lengths, _keys(6, seed=5), slots=2, page_size=8,
                num_pages=30, narrow_tables=True, bucket_rows=True)


def test_loop_policy_widths_and_give_back():
    sched = Scheduler(slots=4, page_size=4, num_pages=20, pages_per_seq=4, prefill_chunk=4,
                      prefill_rows=2)
    sched.slots[:3] = [object()] * 3
    assert loop_min_live(sched, packed=True) == 3  # nothing queued: until 2 fit 2 rows
    assert loop_min_live(sched, packed=False) == 1
    sched.waiting.append(object())
    assert loop_min_live(sched, packed=True) is None  # a request waits for the free slot
    sched.slots[3] = object()
    assert loop_min_live(sched, packed=False) == 4  # back when one ends
    assert step_widths(10, 10, True) == (1, 2, 4, 8, 10)
    assert step_widths(4, 10, True) == (1, 2, 4) and step_widths(6, 6, False) == (6,)
    pages = PageAllocator(6)
    pages.reserve(4)
    kept, ahead = pages.alloc(), [pages.alloc(ahead=True) for _ in range(3)]
    assert pages.peak_in_use == 1 and pages.in_use == 4
    pages.give_back(ahead[1:])
    pages.note_peak()
    assert pages.peak_in_use == 2 and pages.reserved == 2 and pages.allocations == 2
    with pytest.raises(RuntimeError, match=f"give_back of page {kept}"):
        pages.incref(kept) or pages.give_back([kept])
    with pytest.raises(RolloutConfigError, match="loop_steps=-1: must be an int >= 0"):
        EngineConfig(loop_steps=-1)
