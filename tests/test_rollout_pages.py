"""Host side of the rollout engine (no jax): the page allocator's reference counts and
reservations, and the scheduler's copy-on-write sharing of a group's prompt prefix."""
import numpy as np
import pytest

from jaxflow.rollout.pages import NULL_PAGE, PageAllocator, page_table_row, pages_for
from jaxflow.rollout.scheduler import Request, Scheduler, Sequence


def test_allocator_refcounts_and_reservations():
    pages = PageAllocator(5)
    assert pages.capacity == 4 and pages.available == 4
    pages.reserve(3)
    a, b = pages.alloc(), pages.alloc()
    assert NULL_PAGE not in (a, b) and pages.reserved == 1 and pages.available == 1
    pages.incref(a)
    pages.decref(a)
    assert pages.in_use == 2  # a still held once
    pages.release([a, b])
    assert pages.in_use == 0 and pages.peak_in_use == 2 and pages.allocations == 2
    assert pages.alloc() == a  # lowest id first: freed pages are reused
    with pytest.raises(RuntimeError, match="cannot reserve 4 pages: 3 available"):
        pages.reserve(4)
    with pytest.raises(RuntimeError, match="decref of page 0"):
        pages.decref(NULL_PAGE)
    with pytest.raises(ValueError, match=r"num_pages=1: need an int >= 2"):
        PageAllocator(1)
    assert pages_for(9, 4) == 3 and list(page_table_row([3, 1], 4)) == [3, 1, 0, 0]


def _request(prompt_len, group, max_new):
    req = Request(rid=0, prompt=np.arange(1, prompt_len + 1, dtype=np.int32),
                  max_new_tokens=max_new, sequences=[])
    req.sequences = [Sequence(request=req, member=g, key_data=np.zeros(2, np.uint32))
                     for g in range(group)]
    return req


def _finish(sched, seq, eos=7):
    """Feeds one decode call (row i = slot i) in which ``seq`` draws eos."""
    sched.decode_rows = list(sched.slots)

    class Out:
        live = np.zeros((1, len(sched.slots)), bool)
        token = np.zeros((1, len(sched.slots)), np.int32)
        logprob = np.zeros((1, len(sched.slots)), np.float32)
        topk_logprobs = np.zeros((1, len(sched.slots), 0), np.float32)
        topk_indices = np.zeros((1, len(sched.slots), 0), np.int32)
    Out.live[0, seq.slot], Out.token[0, seq.slot] = True, eos
    return sched.finish_decode(Out, 0, eos)


def test_group_prefix_copy_on_write():
    """Prompt of 11 tokens, page_size 4: the 10-token prefix fills 2 pages and part of a third.
    Three sequences share the 2 full pages; the first two copy the partial page, the last takes
    it over; pages are freed as the sharers end, the shared ones with the last."""
    sched = Scheduler(slots=3, page_size=4, num_pages=40, pages_per_seq=8, prefill_chunk=16,
                      prefill_rows=1)
    req = _request(11, 3, max_new=6)
    sched.add(req)
    sched.admit()
    assert len(req.prefix_pages) == 3 and sched.prefilling
    _, tokens, start, n_valid, table = sched.prefill_batch()
    assert list(tokens[0, :10]) == list(range(1, 11)) and n_valid[0] == 10 and start[0] == 0
    sched.finish_prefill([req])
    sched.assign_slots()
    full, partial = req.prefix_pages[:2], req.prefix_pages[2]
    seqs = req.sequences
    assert [s.pages[:2] for s in seqs] == [full] * 3
    assert seqs[2].pages[2] == partial and partial not in seqs[0].pages + seqs[1].pages
    assert sched.take_copies() == [(partial, seqs[0].pages[2]), (partial, seqs[1].pages[2])]
    assert [sched.pages.refcount[p] for p in full] == [3, 3] and sched.pages.refcount[partial] == 1
    # every sequence reserved exactly what it may still allocate: positions up to 11 + 6 - 2
    assert sched.pages.reserved == sum(s.budget for s in seqs) == 3 * (pages_for(16, 4) - 3)
    assert sched.pages.in_use == 5
    assert _finish(sched, seqs[0]) == []
    assert sched.pages.in_use == 4 and [sched.pages.refcount[p] for p in full] == [2, 2]
    _finish(sched, seqs[2])
    assert sched.pages.refcount[partial] == 0
    assert _finish(sched, seqs[1]) == [req]
    assert sched.pages.in_use == 0 and sched.pages.reserved == 0 and sched.idle()


def test_single_sequence_fits_a_pool_of_one_maximal_sequence():
    """G = 1 takes its partial prefix page over: a pool of exactly max_seq_len tokens admits it."""
    sched = Scheduler(slots=1, page_size=4, num_pages=1 + 4, pages_per_seq=4, prefill_chunk=16,
                      prefill_rows=1)
    req = _request(7, 1, max_new=9)   # 7 + 9 = 16 tokens = 4 pages
    assert sched.admission_pages(req) == 4
    sched.add(req)
    sched.admit()
    sched.finish_prefill([req])
    sched.assign_slots()
    assert sched.take_copies() == [] and sched.slots[0] is req.sequences[0]
    assert _finish(sched, req.sequences[0]) == [req] and sched.pages.in_use == 0


def test_decode_and_prefill_rows_follow_the_sequences_in_flight():
    """bucket_rows: a decode call carries the running sequences packed in slot order, padded to
    the next power of two; a prefill call the prompts being prefilled, likewise; by_slot (a
    per-slot hook state) or bucket_rows=False: every slot / prefill row."""
    sched = Scheduler(slots=8, page_size=4, num_pages=80, pages_per_seq=8, prefill_chunk=16,
                      prefill_rows=4)
    reqs = [_request(5, 1, max_new=6) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    sched.admit()
    batch, tokens, *_ = sched.prefill_batch()
    assert len(batch) == 3 and tokens.shape == (4, 16)  # 3 prompts -> 4 rows (of at most 4)
    sched.finish_prefill(batch)
    sched.assign_slots()
    tokens, lengths, table, *_ , remaining = sched.decode_batch(0, (2,), 1)
    assert tokens.shape == (4,) and list(remaining) == [6, 6, 6, 0]
    assert sched.decode_rows[:3] == [r.sequences[0] for r in reqs]
    _finish(sched, reqs[0].sequences[0])  # slot 0 frees; slots 1 and 2 run on
    tokens, *_ = sched.decode_batch(0, (2,), 1)
    assert tokens.shape == (2,) and sched.decode_rows == [reqs[1].sequences[0],
                                                          reqs[2].sequences[0]]
    assert sched.decode_batch(0, (2,), 1, by_slot=True)[0].shape == (8,)
    assert sched.decode_rows[0] is None and sched.decode_rows[1] is reqs[1].sequences[0]
    fixed = Scheduler(slots=8, page_size=4, num_pages=80, pages_per_seq=8, prefill_chunk=16,
                      prefill_rows=4, bucket_rows=False)
    fixed.add(_request(5, 1, max_new=6))
    fixed.admit()
    assert fixed.prefill_batch()[1].shape == (4, 16)
    assert [fixed.row_count(n, 8) for n in (1, 3, 8)] == [8, 8, 8]
    assert [sched.row_count(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
