"""Host scheduler of the rollout engine: requests, shared prompt prefixes, slots, page bookkeeping.

A *request* is one prompt and G *sequences* sampled from it (G = 1, or a GRPO group). Its life:

1. **waiting** -> **prefilling**: admitted when the pool can reserve the prompt prefix's pages
   plus one sequence's pages (so every admitted request can make progress, and none is ever
   preempted), and fewer than ``slots`` sequences are already queued for slots. The prompt's
   first ``L - 1`` tokens are prefilled ONCE for the whole group, ``prefill_chunk`` tokens per
   engine step (chunked prefill, interleaved with decode steps).
2. **ready** -> **running**: each sequence takes a free decode slot (reserving its own pages then).
   Copy-on-write of the prefix: the prefix's full pages are shared (reference-counted); the
   partially filled last prefix page is copied into a private page for every sequence but the
   last one to take a slot, which takes the request's page itself. A sequence's first decode
   step feeds the prompt's last token (so each sequence writes only into its own pages) and
   draws its token 0.
3. **finished**: at EOS or after ``max_new_tokens``; its pages are released at once (shared
   ones when the last sharer ends) and its slot is free for the next step.

No jax here: the engine turns :meth:`Scheduler.prefill_batch` / :meth:`Scheduler.decode_batch`
into device calls and hands the draws back to :meth:`Scheduler.finish_decode`.
"""

from __future__ import annotations

import collections
import dataclasses
import typing

import numpy as np

from jaxflow.rollout.pages import NULL_PAGE, PageAllocator, bucket, page_table_row, pages_for


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sampled continuation (host state)."""

    request: "Request"
    member: int
    key_data: np.ndarray
    pages: list = dataclasses.field(default_factory=list)
    budget: int = 0            # reserved pages not yet allocated
    length: int = 0            # tokens in the cache after the next step's write
    next_token: int = 0
    slot: int = -1
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    topk_logprobs: list = dataclasses.field(default_factory=list)
    topk_indices: list = dataclasses.field(default_factory=list)
    done: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt [L] and its G sequences."""

    rid: int
    prompt: np.ndarray
    max_new_tokens: int
    sequences: list
    prefix_pages: list = dataclasses.field(default_factory=list)
    prefilled: int = 0         # prefix tokens written
    held: int = 0              # pages reserved at admission for the first sequence to run
    unassigned: int = 0        # sequences that have not taken a slot yet
    finished: int = 0

    @property
    def prefix_len(self) -> int:
        """Tokens prefilled once for the group: all but the prompt's last."""
        return len(self.prompt) - 1

    def sequence_pages(self, page_size: int) -> int:
        """Pages one sequence may allocate beyond the shared full prefix pages."""
        total = pages_for(len(self.prompt) + self.max_new_tokens - 1, page_size)
        return total - self.prefix_len // page_size


class Scheduler:
    """FIFO admission, chunked prefill, slot assignment and page accounting (see module doc)."""

    def __init__(self, *, slots: int, page_size: int, num_pages: int, pages_per_seq: int,
                 prefill_chunk: int, prefill_rows: int, narrow_tables: bool = True,
                 bucket_rows: bool = True):
        self.slots = [None] * slots
        self.page_size, self.width = page_size, pages_per_seq
        self.prefill_chunk, self.prefill_rows = prefill_chunk, prefill_rows
        self.narrow_tables, self.bucket_rows = narrow_tables, bucket_rows
        self.decode_rows: list = []  # the sequence of each row of the last decode batch
        self.pages = PageAllocator(num_pages)
        self.waiting: collections.deque = collections.deque()
        self.prefilling: collections.deque = collections.deque()
        self.ready: collections.deque = collections.deque()
        self.copies: list[tuple[int, int]] = []   # (src, dst) page copies due before decode
        self.assigned: list[Sequence] = []         # sequences that took a slot since the last take

    # -- admission -------------------------------------------------------------------------

    def admission_pages(self, request: Request) -> int:
        """Pages reserved when ``request`` is admitted: its prefix and its first sequence's."""
        return (pages_for(request.prefix_len, self.page_size)
                + self._sequence_need(request, len(request.sequences)))

    def _sequence_need(self, request: Request, unassigned: int) -> int:
        """Pages the next sequence of ``request`` to take a slot will allocate: all but the
        shared full prefix pages, less the partial prefix page if it is the last sharer (it
        takes that page over instead of copying it)."""
        takeover = unassigned == 1 and request.prefix_len % self.page_size != 0
        return request.sequence_pages(self.page_size) - takeover

    def add(self, request: Request) -> None:
        """Queues a request (validated by the engine)."""
        request.unassigned = len(request.sequences)
        self.waiting.append(request)

    def _queued_sequences(self) -> int:
        return len(self.ready) + sum(r.unassigned for r in self.prefilling)

    def admit(self) -> None:
        """Moves waiting requests to prefill while pages can be reserved and slots will follow."""
        while self.waiting and self._queued_sequences() < len(self.slots):
            request = self.waiting[0]
            need = self.admission_pages(request)
            if need > self.pages.available:
                return
            self.waiting.popleft()
            self.pages.reserve(need)
            request.prefix_pages = [self.pages.alloc()
                                    for _ in range(pages_for(request.prefix_len, self.page_size))]
            request.held = need - len(request.prefix_pages)
            if request.prefilled == request.prefix_len:
                self.ready.extend(request.sequences)
            else:
                self.prefilling.append(request)

    # -- prefill ---------------------------------------------------------------------------

    def prefill_batch(self):
        """The next prefill call's inputs, or None: (requests, tokens [R, C] int32, start [R],
        n_valid [R], page_table [R, W] (W = :meth:`table_width` of the longest prefix)); one
        chunk of each of the first ``prefill_rows`` prefilling requests, R = :meth:`row_count`
        of them (rows past the requests are padding: n_valid 0)."""
        if not self.prefilling:
            return None
        batch = list(self.prefilling)[:self.prefill_rows]
        r, c = self.row_count(len(batch), self.prefill_rows), self.prefill_chunk
        tokens = np.zeros((r, c), np.int32)
        start = np.zeros((r,), np.int32)
        n_valid = np.zeros((r,), np.int32)
        width = self.table_width(max(len(req.prefix_pages) for req in batch))
        table = np.full((r, width), NULL_PAGE, np.int32)
        for i, req in enumerate(batch):
            n = min(c, req.prefix_len - req.prefilled)
            tokens[i, :n] = req.prompt[req.prefilled:req.prefilled + n]
            start[i], n_valid[i] = req.prefilled, n
            table[i] = page_table_row(req.prefix_pages, table.shape[1])
        return batch, tokens, start, n_valid, table

    def finish_prefill(self, batch) -> None:
        """Advances the requests of a prefill call; complete ones queue their sequences."""
        for req in batch:
            req.prefilled = min(req.prefix_len, req.prefilled + self.prefill_chunk)
            if req.prefilled == req.prefix_len:
                self.prefilling.remove(req)
                self.ready.extend(req.sequences)

    # -- slots -----------------------------------------------------------------------------

    def assign_slots(self) -> None:
        """Ready sequences into free slots (FIFO; one that cannot reserve its pages yet waits,
        later ones with a reservation may pass it). Queues the copy-on-write page copies."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        for seq in list(self.ready):
            if not free:
                return
            req = seq.request
            need = self._sequence_need(req, req.unassigned)
            if req.held:  # the first sequence of the request: reserved at admission
                seq.budget, req.held = req.held, 0
            elif need <= self.pages.available:
                self.pages.reserve(need)
                seq.budget = need
            else:
                continue
            self.ready.remove(seq)
            self._take_prefix(seq)
            seq.slot = free.pop(0)
            self.slots[seq.slot] = seq
            self.assigned.append(seq)

    def _take_prefix(self, seq: Sequence) -> None:
        req, s = seq.request, self.page_size
        full = req.prefix_len // s
        for page in req.prefix_pages[:full]:
            self.pages.incref(page)
        seq.pages = list(req.prefix_pages[:full])
        req.unassigned -= 1
        if req.prefix_len % s:
            partial = req.prefix_pages[full]
            if req.unassigned == 0:      # the last sharer takes the page itself
                seq.pages.append(partial)
            else:                        # copy-on-write: a private copy to append to
                copy = self.pages.alloc()
                seq.budget -= 1
                self.copies.append((partial, copy))
                seq.pages.append(copy)
        if req.unassigned == 0:          # the request's own references to the full pages go
            self.pages.release(req.prefix_pages[:full])
        seq.length = len(req.prompt)
        seq.next_token = int(req.prompt[-1])

    def take_assigned(self) -> list[Sequence]:
        """The sequences that took a slot since the last call (to initialise per-slot state)."""
        assigned, self.assigned = self.assigned, []
        return assigned

    def take_copies(self) -> list[tuple[int, int]]:
        """The page copies queued since the last call (to run before the next decode)."""
        copies, self.copies = self.copies, []
        return copies

    # -- decode ----------------------------------------------------------------------------

    def table_width(self, pages: int) -> int:
        """Page-table width of a call whose longest row holds ``pages`` pages: the next power of
        two, at most ``pages_per_seq``. Attention then reads the pages the rows hold rather than
        a whole maximal sequence, at a few compiled shapes (log2(pages_per_seq) + 1).
        ``pages_per_seq`` without ``narrow_tables``."""
        return bucket(pages, self.width) if self.narrow_tables else self.width

    def row_count(self, n: int, cap: int) -> int:
        """Rows of a call carrying ``n`` sequences (or prompts) at most ``cap``: the next power
        of two (a few compiled shapes, log2(cap) + 1) with ``bucket_rows``; else ``cap``."""
        return bucket(n, cap) if self.bucket_rows else cap

    def free_slots(self) -> int:
        """Slots without a sequence."""
        return sum(s is None for s in self.slots)

    def running(self) -> list[Sequence]:
        """Sequences in slots."""
        return [s for s in self.slots if s is not None]

    def decode_batch(self, pad_id: int, key_shape: tuple[int, ...], n_steps: int, *,
                     by_slot: bool = False, ahead: bool = False):
        """The next decode call's inputs, allocating the pages its ``n_steps`` steps may write
        (``ahead``: not counted in the peak until :meth:`finish_decode` trims them):
        tokens [B], lengths [B], page_table [B, W] (W = :meth:`table_width` of the longest
        row), key_data [B, ...], t [B], remaining [B] (0 for padding rows). Rows: the running
        sequences packed in slot order, B = :meth:`row_count` of them (``bucket_rows``), or
        with ``by_slot`` (or without ``bucket_rows``) row i = slot i, B = slots (a per-slot
        logits-hook state needs that). ``decode_rows`` holds each row's sequence (None: empty)."""
        if by_slot or not self.bucket_rows:
            rows = list(self.slots)
        else:
            running = self.running()
            rows = running + [None] * (self.row_count(len(running), len(self.slots))
                                       - len(running))
        self.decode_rows = rows
        b = len(rows)
        tokens = np.full((b,), pad_id, np.int32)
        lengths = np.ones((b,), np.int32)
        key_data = np.zeros((b,) + key_shape, np.uint32)
        t = np.zeros((b,), np.int32)
        remaining = np.zeros((b,), np.int32)
        for i, seq in enumerate(rows):
            if seq is None:
                continue
            left = seq.request.max_new_tokens - len(seq.tokens)
            last = seq.length - 1 + min(n_steps, left) - 1  # the last position this call writes
            while last // self.page_size >= len(seq.pages):
                seq.pages.append(self.pages.alloc(ahead=ahead))
                seq.budget -= 1
            tokens[i], lengths[i], t[i] = seq.next_token, seq.length, len(seq.tokens)
            remaining[i] = left
            key_data[i] = seq.key_data
        width = self.table_width(max((len(s.pages) for s in rows if s is not None), default=1))
        table = np.full((b, width), NULL_PAGE, np.int32)
        for i, seq in enumerate(rows):
            if seq is not None:
                table[i] = page_table_row(seq.pages, width)
        return tokens, lengths, table, key_data, t, remaining

    def finish_decode(self, out, version: int,
                      eos_id: int | typing.Sequence[int] | None, *,
                      trim: bool = False) -> list[Request]:
        """Records a decode call's draws (host DecodeOut, fields [n, B, ...], rows as
        ``decode_rows``); retires finished sequences (their last token one of ``eos_id``, an
        id or every stop id, or their ``max_new_tokens`` drawn). ``trim``: first gives back the
        pages allocated ahead that the call did not write (a multi-step decode's) and counts
        the rest in the peak. Returns the requests completed by this call."""
        stops = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
        completed = []
        counts = out.live.sum(axis=0)
        if trim:
            self._trim(counts)
        # one conversion per call, not per row: rows [B] of python lists
        tokens, logprobs, counts = out.token.T.tolist(), out.logprob.T.tolist(), counts.tolist()
        top_k = out.topk_logprobs.shape[-1] > 0
        for i, seq in enumerate(self.decode_rows):
            if seq is None:
                continue
            c = counts[i]
            if c == 0:  # (a running row always draws; kept for callers feeding partial outputs)
                continue
            seq.tokens.extend(tokens[i][:c])
            seq.logprobs.extend(logprobs[i][:c])
            seq.versions.extend([version] * c)
            if top_k:
                seq.topk_logprobs.extend(out.topk_logprobs[:c, i])
                seq.topk_indices.extend(out.topk_indices[:c, i])
            req = seq.request
            if seq.tokens[-1] in stops or len(seq.tokens) == req.max_new_tokens:
                seq.done = True
                self.slots[seq.slot] = None
                self.pages.release(seq.pages)
                self.pages.unreserve(seq.budget)
                seq.pages, seq.budget = [], 0
                req.finished += 1
                if req.finished == len(req.sequences):
                    completed.append(req)
            else:
                seq.next_token, seq.length = seq.tokens[-1], len(req.prompt) + len(seq.tokens)
        return completed

    def _trim(self, counts) -> None:
        """Gives back each row's pages past the positions written (prompt + drawn tokens - 1:
        the last draw is written by the next step), then notes the peak."""
        for i, seq in enumerate(self.decode_rows):
            if seq is None:
                continue
            keep = pages_for(len(seq.request.prompt) + len(seq.tokens) + int(counts[i]) - 1,
                             self.page_size)
            if len(seq.pages) > keep:
                extra, seq.pages = seq.pages[keep:], seq.pages[:keep]
                self.pages.give_back(extra)
                seq.budget += len(extra)
        self.pages.note_peak()

    def idle(self) -> bool:
        """Nothing waiting, prefilling, ready or running."""
        return not (self.waiting or self.prefilling or self.ready or self.running())


def request_arrays(req: Request, pad_id: int, top_k: int) -> tuple[np.ndarray, ...]:
    """A completed request's outputs as host arrays, N = its max_new_tokens: tokens [G, N]
    (``pad_id`` after the last), logprobs [G, N], mask [G, N], lengths [G], versions [G, N]
    (-1 where masked), top-K log-probs [G, N, K] and indices [G, N, K] (K = ``top_k``)."""
    g, n, k = len(req.sequences), req.max_new_tokens, top_k
    tokens = np.full((g, n), pad_id, np.int32)
    logprobs = np.zeros((g, n), np.float32)
    mask = np.zeros((g, n), np.float32)
    versions = np.full((g, n), -1, np.int32)
    top_lp = np.zeros((g, n, k), np.float32)
    top_idx = np.zeros((g, n, k), np.int32)
    for i, seq in enumerate(req.sequences):
        m = len(seq.tokens)
        tokens[i, :m], logprobs[i, :m], mask[i, :m] = seq.tokens, seq.logprobs, 1.0
        versions[i, :m] = seq.versions
        if k:
            top_lp[i, :m], top_idx[i, :m] = seq.topk_logprobs, seq.topk_indices
    return tokens, logprobs, mask, mask.sum(1).astype(np.int32), versions, top_lp, top_idx


def copy_batches(copies: list[tuple[int, int]], b: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Page copies (src, dst) as page-copy calls of ``b`` rows: [(src [b], dst [b]) int32],
    unused rows copying the null page onto itself."""
    calls = []
    for i in range(0, len(copies), b):
        part = copies[i:i + b]
        src, dst = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        src[:len(part)] = [s for s, _ in part]
        dst[:len(part)] = [d for _, d in part]
        calls.append((src, dst))
    return calls


def hook_init_arrays(assigned: list[Sequence], b: int, width: int, pad_id: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The logits hook's ``init`` inputs for sequences that took slots: rows [b] (each one's
    slot; ``b``: none, dropped), prompts [b, width] right-padded with ``pad_id``, valid [b, width]."""
    rows = np.full((b,), b, np.int32)
    prompts = np.full((b, width), pad_id, np.int32)
    valid = np.zeros((b, width), bool)
    for i, seq in enumerate(assigned):
        n = len(seq.request.prompt)
        rows[i], prompts[i, :n], valid[i, :n] = seq.slot, seq.request.prompt, True
    return rows, prompts, valid
