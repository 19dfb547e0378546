"""Dynamic packing scheduler: balanced micro-batches by LLM-side cost under a token budget.

Cost of a sample of ``length`` tokens (``n_patches`` of them image tokens), per transformer
layer of width h: ~12 h^2 per token (projections, MLP) + ~2 h per token pair (attention,
causal within the sample's own segment), i.e. ``a * length + b * length^2`` with a = 6 h,
b = 1 after dividing by 2h (verl's seqlen balancing), plus ``encoder * n_patches`` when the
encoder's work is counted too.

Algorithms (all pure functions on lists of ints/floats; a bin = one micro-batch = one row):
  first_fit       arrival order, first bin with room (grain's FirstFit); the comparison
  lpt             longest-processing-time: costliest first into the cheapest bin with room
  karmarkar_karp  multi-way largest differencing (verl), then a budget check
``pack`` tries the smallest bin count (a multiple of the data-parallel degree) that fits, and
with ``refine`` evens out the bins' token counts by local search within a cost-imbalance cap.
A sample longer than the budget raises ``OverBudgetError``, or with the explicit
``over_budget="split"`` policy becomes budget-sized pieces (later pieces do not attend to
earlier ones: an approximation the caller opts into).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

ALGORITHMS = ("first_fit", "lpt", "karmarkar_karp")


class OverBudgetError(ValueError):
    """A sample does not fit the token budget."""


@dataclasses.dataclass(frozen=True)
class CostModel:
    """cost = a * length + b * length^2 + encoder * n_patches."""

    a: float = 384.0
    b: float = 1.0
    encoder: float = 0.0

    @classmethod
    def for_width(cls, d_model: int, encoder: float = 0.0) -> "CostModel":
        """The cost model of a backbone of width ``d_model``: ``a = 6 * d_model``, ``b = 1``."""
        return cls(a=6.0 * d_model, b=1.0, encoder=encoder)

    def __call__(self, length, n_patches=0):
        length = np.asarray(length, np.float64)
        return self.a * length + self.b * length**2 + self.encoder * np.asarray(n_patches)


def check_budget(lengths: Sequence[int], budget: int) -> None:
    over = [(i, int(n)) for i, n in enumerate(lengths) if n > budget]
    if over:
        i, n = over[0]
        raise OverBudgetError(
            f"sample {i} has {n} tokens > token budget {budget} ({len(over)} such sample(s)); "
            "raise the budget or pack with over_budget='split'")


def split_over_budget(lengths: Sequence[int], budget: int) -> list[tuple[int, int, int]]:
    """Pieces ``(sample, start, stop)``: whole samples, and budget-sized cuts of long ones."""
    pieces = []
    for i, n in enumerate(lengths):
        for start in range(0, int(n), budget):
            pieces.append((i, start, min(int(n), start + budget)))
    return pieces


def first_fit(lengths: Sequence[int], budget: int) -> list[list[int]]:
    check_budget(lengths, budget)
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def lpt(costs: Sequence[float], lengths: Sequence[int], n_bins: int,
        budget: int) -> list[list[int]] | None:
    """Costliest item first into the cheapest bin with room; None if some item finds none."""
    check_budget(lengths, budget)
    bins = [[] for _ in range(n_bins)]
    load = np.zeros(n_bins)
    fill = np.zeros(n_bins, np.int64)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], -lengths[i], i)):
        fits = np.flatnonzero(fill + lengths[i] <= budget)
        if fits.size == 0:
            return None
        b = int(fits[np.argmin(load[fits])])
        bins[b].append(i)
        load[b] += costs[i]
        fill[b] += lengths[i]
    return bins


def karmarkar_karp(costs: Sequence[float], lengths: Sequence[int], n_bins: int,
                   budget: int) -> list[list[int]] | None:
    """Multi-way largest differencing; None if the result breaks the token budget."""
    check_budget(lengths, budget)
    # A partial solution: n_bins (sum, items) sets sorted by sum, descending.
    heap = []
    for i in range(len(costs)):
        sets = [(float(costs[i]), [i])] + [(0.0, []) for _ in range(n_bins - 1)]
        heapq.heappush(heap, (-float(costs[i]), i, sets))
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Largest of a with smallest of b, and so on.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        spread = merged[0][0] - merged[-1][0]
        heapq.heappush(heap, (-spread, tie, merged))
        tie += 1
    bins = [items for _, items in heap[0][2]] if heap else [[] for _ in range(n_bins)]
    if any(sum(lengths[i] for i in b) > budget for b in bins):
        return None
    return bins


def refine_lengths(bins: Sequence[Sequence[int]], costs: Sequence[float],
                   lengths: Sequence[int], budget: int, *,
                   max_imbalance: float = 1.05) -> list[list[int]]:
    """Local search that shortens the longest bins while keeping cost balance.

    Every row of a packed batch is computed at the longest row's length, so after a cost-balanced
    packing (LPT / KK) the tokens a row lacks are padding. Each iteration takes the best single
    move (one item from a longest bin to a shorter one) or swap (an item of a longest bin for a
    shorter item of another bin) that lowers ``(max bin length, bins at that length)``, subject
    to every bin staying within ``budget`` tokens and every bin's cost within
    ``max(max_imbalance, starting imbalance) * mean cost``; it stops when none does. The item
    multiset of each bin changes, never the set of items or the bin count.

    Args:
      bins: item indices per bin (a packing's ``bins``; empty bins allowed).
      costs, lengths: per item (``[n_items]``).
      budget: max tokens per bin.
      max_imbalance: the cost max / mean a move may reach (never below where it started).
    Returns:
      new bins, same count, item order within a bin unspecified.
    """
    bins = [list(b) for b in bins]
    n = len(bins)
    lengths_a = np.asarray(lengths, np.int64)
    costs_a = np.asarray(costs, np.float64)
    L = np.array([lengths_a[b].sum() if b else 0 for b in bins], np.int64)
    C = np.array([costs_a[b].sum() if b else 0.0 for b in bins])
    mean_c = C.mean() if n else 0.0
    if n < 2 or mean_c <= 0:
        return bins
    cap = max(max_imbalance, C.max() / mean_c) * mean_c * (1 + 1e-12)

    def ranks(others_max: int, others_count: int, la: np.ndarray, lb: np.ndarray) -> np.ndarray:
        """(max bin length, bins at it) as one sortable key, for every candidate at once."""
        m = np.maximum(others_max, np.maximum(la, lb))
        count = (others_max == m) * others_count + (la == m) + (lb == m)
        return m * (n + 1) + count

    while True:
        top = int(L.max())
        current = top * (n + 1) + int((L == top).sum())
        best = None  # (key, a, b, item of a, item of b or None)
        for a in np.flatnonzero(L == top):
            ia = np.asarray(bins[a], np.int64)
            for b in np.flatnonzero(L < L[a]):
                rest = np.delete(L, [a, b])
                o_max = int(rest.max()) if rest.size else 0
                o_cnt = int((rest == o_max).sum()) if rest.size else 0
                # moves: item x of a -> b
                d = lengths_a[ia]
                ok = (L[b] + d <= budget) & (C[b] + costs_a[ia] <= cap)
                if ok.any():
                    keys = np.where(ok, ranks(o_max, o_cnt, L[a] - d, L[b] + d), np.iinfo(np.int64).max)
                    x = int(np.argmin(keys))
                    if keys[x] < current and (best is None or keys[x] < best[0]):
                        best = (int(keys[x]), a, b, int(ia[x]), None)
                ib = np.asarray(bins[b], np.int64)
                if ib.size == 0:
                    continue
                # swaps: item x of a <-> shorter item y of b
                d = lengths_a[ia][:, None] - lengths_a[ib][None, :]
                dc = costs_a[ia][:, None] - costs_a[ib][None, :]
                ok = (d > 0) & (L[b] + d <= budget) & (C[b] + dc <= cap) & (C[a] - dc <= cap)
                if ok.any():
                    keys = np.where(ok, ranks(o_max, o_cnt, L[a] - d, L[b] + d), np.iinfo(np.int64).max)
                    x, y = np.unravel_index(int(np.argmin(keys)), keys.shape)
                    if keys[x, y] < current and (best is None or keys[x, y] < best[0]):
                        best = (int(keys[x, y]), a, b, int(ia[x]), int(ib[y]))
        if best is None:
            return bins
        _, a, b, i, j = best
        for item, src, dst in ((i, a, b),) + (((j, b, a),) if j is not None else ()):
            bins[src].remove(item)
            bins[dst].append(item)
            L[src] -= lengths_a[item]
            L[dst] += lengths_a[item]
            C[src] -= costs_a[item]
            C[dst] += costs_a[item]


@dataclasses.dataclass
class Packing:
    """A packing's result: item indices per bin, the algorithm, and each bin's cost and length."""
    bins: list[list[int]]  # item indices per bin; len(bins) is a multiple of bin_multiple
    algorithm: str
    bin_costs: np.ndarray
    bin_lengths: np.ndarray

    @property
    def imbalance(self) -> float:
        """max / mean cost per bin (1.0 = perfectly balanced; empty bins count as 0)."""
        mean = self.bin_costs.mean() if self.bin_costs.size else 0.0
        return float(self.bin_costs.max() / mean) if mean > 0 else 1.0

    def padding_waste(self, row_len: int) -> float:
        """Fraction of the ``len(bins) * row_len`` token slots that hold no token."""
        slots = len(self.bins) * row_len
        return float(1.0 - self.bin_lengths.sum() / slots) if slots else 0.0


def pack(lengths: Sequence[int], costs: Sequence[float], budget: int, *,
         algorithm: str = "lpt", bin_multiple: int = 1, min_bins: int = 1,
         refine: bool = False, max_imbalance: float = 1.05) -> Packing:
    """Bins of item indices, each within ``budget`` tokens, count a multiple of bin_multiple.

    Every item lands in exactly one bin. LPT / KK start from the fewest bins the total length
    allows and add ``bin_multiple`` bins until the budget is met; first-fit opens bins as
    needed and the count is then padded with empty bins. ``min_bins`` (rounded up to a
    multiple) fixes the usual bin count so row shapes, hence compilations, stay few.
    ``refine`` then shortens the longest bins (:func:`refine_lengths`, cost imbalance kept
    within ``max_imbalance``), which is what padding waste depends on.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"packing algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    lengths = [int(n) for n in lengths]
    costs = [float(c) for c in costs]
    check_budget(lengths, budget)
    m = max(1, int(bin_multiple))
    if algorithm == "first_fit":
        bins = first_fit(lengths, budget)
    else:
        fn = lpt if algorithm == "lpt" else karmarkar_karp
        n = max(math.ceil(max(min_bins, 1) / m) * m,
                math.ceil(max(sum(lengths), 1) / budget / m) * m)
        while (bins := fn(costs, lengths, n, budget)) is None:
            n += m
    bins = [b for b in bins if b]
    bins += [[] for _ in range((-len(bins)) % m or (m if not bins else 0))]
    if refine:
        bins = refine_lengths(bins, costs, lengths, budget, max_imbalance=max_imbalance)
    c = np.asarray(costs)
    ln = np.asarray(lengths)
    return Packing(bins=bins, algorithm=algorithm,
                   bin_costs=np.array([c[b].sum() if b else 0.0 for b in bins]),
                   bin_lengths=np.array([ln[b].sum() if b else 0 for b in bins]))
