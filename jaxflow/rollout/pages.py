"""Host-side page allocator of the paged KV pool: free list, reference counts, reservations.

The device pool (one ``[n_kv_heads, num_pages, page_size, head_dim]`` array per layer for keys
and one for values) is indexed by page ids that this allocator hands out. Page 0 is the *null
page*: never allocated, it is where the jitted steps write the keys/values of padding tokens
and empty slots, and what unused page-table entries point at (always masked out).

A page is freed when its last holder releases it (``decref`` to 0): a sequence's private pages
when it ends; a prompt prefix shared by a GRPO group's sequences when the last of them ends.

Reservations make admission safe without preemption: a request reserves the most pages it can
ever need when it is admitted and draws its pages from that reservation as it grows, so an
admitted request never finds the pool empty; :meth:`PageAllocator.available` is what new
admissions may still reserve.

:func:`pool_head_dim` decides the pool's last axis: the model's head_dim, or 128 lanes (zeros
past head_dim) where decode runs the TPU kernel, which needs them (the padded layout of
:mod:`jaxflow.rollout.paged_attention`): stored padded, the pool is not padded per call.
"""

from __future__ import annotations

import contextlib
import heapq

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflow.rollout.paged_attention import choose_paged_backend, padded_head_dim

NULL_PAGE = 0


class PageAllocator:
    """Page ids ``1 .. num_pages - 1`` (0 is the null page) with reference counts.

    Attributes:
      in_use: pages currently allocated; peak_in_use: the most ever allocated at once.
      reserved: pages promised to admitted requests but not yet allocated.
      allocations: pages handed out so far (a page reused counts each time).
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
            raise ValueError(f"num_pages={num_pages!r}: need an int >= 2 (page 0 is the null page)")
        self.num_pages = int(num_pages)
        self._free = list(range(1, self.num_pages))  # a heap: lowest id first (deterministic)
        self.refcount = np.zeros((self.num_pages,), np.int64)
        self.reserved = 0
        self.peak_in_use = 0
        self.allocations = 0

    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the null page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        """Pages not allocated."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Pages allocated."""
        return self.capacity - self.free

    @property
    def available(self) -> int:
        """Free pages not promised to an admitted request (what a new admission may reserve)."""
        return self.free - self.reserved

    def reserve(self, n: int) -> None:
        """Promises ``n`` pages to a request (``n <= available``)."""
        if n < 0 or n > self.available:
            raise RuntimeError(f"cannot reserve {n} pages: {self.available} available")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        """Returns ``n`` promised pages that will not be allocated (a sequence ended early)."""
        if n < 0 or n > self.reserved:
            raise RuntimeError(f"cannot unreserve {n} pages: {self.reserved} reserved")
        self.reserved -= n

    def alloc(self, *, reserved: bool = True, ahead: bool = False) -> int:
        """One page with reference count 1; by default drawn from a reservation. ``ahead``: a
        page allocated before it is written (a multi-step decode's), not counted in
        ``peak_in_use`` until :meth:`note_peak` (unwritten ones go back by :meth:`give_back`)."""
        if reserved:
            self.unreserve(1)
        if not self._free:
            raise RuntimeError("page pool exhausted (an allocation outside any reservation)")
        page = heapq.heappop(self._free)
        self.refcount[page] = 1
        self.allocations += 1
        if not ahead:
            self.note_peak()
        return page

    def give_back(self, pages) -> None:
        """Frees pages allocated ahead but never written (each held once) into the reservation
        they were drawn from: the reverse of ``alloc()``, not counted in ``allocations``."""
        for page in pages:
            if page == NULL_PAGE or self.refcount[page] != 1:
                raise RuntimeError(f"give_back of page {page} (reference count "
                                   f"{self.refcount[page]}): only a page held once")
            self.refcount[page] = 0
            heapq.heappush(self._free, page)
            self.allocations -= 1
        self.reserved += len(pages)

    def note_peak(self) -> None:
        """``peak_in_use`` = max(itself, pages in use now)."""
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def incref(self, page: int) -> None:
        """One more holder of an allocated ``page`` (a sequence sharing a prefix page)."""
        if page == NULL_PAGE or self.refcount[page] < 1:
            raise RuntimeError(f"incref of page {page}, which is not allocated")
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        """One holder fewer; the page is freed when none is left."""
        if page == NULL_PAGE or self.refcount[page] < 1:
            raise RuntimeError(f"decref of page {page}, which is not allocated")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            heapq.heappush(self._free, page)

    def release(self, pages) -> None:
        """``decref`` every page of ``pages``."""
        for page in pages:
            self.decref(page)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens: ceil(tokens / page_size)."""
    return -(-tokens // page_size)


def pool_pages(sequences: int, tokens: int, page_size: int) -> int:
    """Pages of a pool holding ``sequences`` sequences of ``tokens`` tokens, plus the null page
    (the KV budget of a static cache [sequences, tokens] + one page)."""
    return sequences * pages_for(tokens, page_size) + 1


def bucket(n: int, cap: int) -> int:
    """The next power of two >= ``n``, at most ``cap``: a call's row count or page-table width
    from a few compiled shapes (log2(cap) + 1)."""
    return min(cap, 1 << max(0, n - 1).bit_length())


def page_table_row(pages, width: int) -> np.ndarray:
    """[width] int32: ``pages`` then the null page."""
    row = np.full((width,), NULL_PAGE, np.int32)
    row[:len(pages)] = pages
    return row


def pool_head_dim(*, n_heads: int, n_kv_heads: int, head_dim: int, rows: int, num_pages: int,
                  page_size: int, pages_per_seq: int, dtype, backend: str = "auto",
                  interpret: bool = False, mesh: Mesh | None = None) -> int:
    """The last axis to allocate the K/V pools [KVH, num_pages, page_size, D'] with.

    ``padded_head_dim(head_dim)`` (128 for 64) where the decode attention ``backend`` resolves
    to the TPU kernel for a decode of ``rows`` rows over such a padded pool (the verdict the
    decode's trace takes, cached; on ``mesh``: under ``jax.set_mesh(mesh)``, as the engine's
    programs are traced); ``interpret`` with backend "tpu" pads too (the kernel runs). Else
    ``head_dim``: every other backend, and every head_dim that is already a multiple of 128,
    keeps the unpadded layout (CPU: nothing changes). Raises ValueError where
    :func:`jaxflow.rollout.paged_attention.resolve_paged_backend` does."""
    width = padded_head_dim(head_dim)
    if width == head_dim:
        return head_dim
    if interpret:
        return width if backend == "tpu" else head_dim
    sds = jax.ShapeDtypeStruct
    pool = sds((n_kv_heads, num_pages, page_size, width), dtype)
    args = (sds((rows, n_heads, head_dim), dtype), pool, pool, sds((rows,), np.int32),
            sds((rows, pages_per_seq), np.int32))
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        chosen = choose_paged_backend(*args, backend=backend)
    return width if chosen == "tpu" else head_dim
