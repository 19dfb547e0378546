"""Host-side batch layout for one global step: encoder patch rows and backbone token rows.

``padded`` rows put one sample per row, padded to the batch's own longest sample (bucketed);
``packed`` rows come from the packing scheduler. The image-embedding buffer the rows index
into is either the encoder's own output (monolithic: ``encoder_image_base``) or the samples'
pool entries concatenated in sample order (decoupled: ``pooled_image_base``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxflow.config_domains import COUNT, NON_NEGATIVE, Real, domains
from jaxflow.flow.packing import CostModel, Packing, pack, split_over_budget
from jaxflow.flow.vit import PatchBatch, ViTConfig, pack_patches
from jaxflow.flow.vlm import Piece, bucket, build_rows

LAYOUTS = ("padded", "packed")


@domains(token_budget=COUNT, row_granularity=COUNT, rows_per_device=COUNT, encoder_cost_per_patch=NON_NEGATIVE,
         max_imbalance=Real(1.0))
@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How backbone rows are formed (``--set flow.packing.algorithm=first_fit``)."""

    algorithm: str = "lpt"  # first_fit | lpt | karmarkar_karp
    token_budget: int = 384  # max tokens per micro-batch row
    row_granularity: int = 32  # row lengths are bucketed to multiples of this
    rows_per_device: int = 1  # usual micro-batch rows per data-parallel device (more if needed)
    over_budget: str = "error"  # error | split
    encoder_cost_per_patch: float = 0.0
    refine_lengths: bool = True  # even out row lengths after the cost packing (less padding)
    max_imbalance: float = 1.05  # the cost max / mean the length refinement may reach

    def __post_init__(self):
        if self.over_budget not in ("error", "split"):
            raise ValueError(f"packing.over_budget={self.over_budget!r}; valid: error, split")
        if not self.max_imbalance >= 1.0:
            raise ValueError(f"packing.max_imbalance={self.max_imbalance!r}; valid: >= 1.0")


@dataclasses.dataclass
class RowsLayout:
    rows: dict[str, np.ndarray]  # ROW_KEYS -> [R, T]
    pieces: list[Piece]
    packing: Packing | None  # None for padded rows
    n_tokens: int  # real tokens

    @property
    def padding_waste(self) -> float:
        return float(1.0 - self.n_tokens / self.rows["tokens"].size)


def sample_images(samples: Sequence) -> list[np.ndarray]:
    return [im for s in samples for im in s.images]


def encoder_image_base(samples: Sequence, patches: PatchBatch) -> Callable[[int, int], int]:
    """image_base for a buffer = the encoder's flat output (images in sample-major order)."""
    first = np.cumsum([0] + [len(s.images) for s in samples])
    return lambda s, i: patches.image_slots[first[s] + i]


def pooled_image_base(samples: Sequence) -> tuple[Callable[[int, int], int], np.ndarray]:
    """image_base for a buffer = each sample's image tokens concatenated in sample order;
    also the buffer offset of every sample ([n + 1])."""
    offsets = np.cumsum([0] + [s.n_image_tokens for s in samples])
    within = [np.cumsum((0,) + s.image_tokens) for s in samples]
    return (lambda s, i: int(offsets[s] + within[s][i])), offsets


def layout_rows(samples: Sequence, layout: str, image_base: Callable[[int, int], int], *,
                packing: PackingConfig, cost: CostModel, row_multiple: int) -> RowsLayout:
    """Backbone rows for ``samples``: padded (one per row) or packed (scheduler's bins)."""
    lengths = [s.length for s in samples]
    if layout == "padded":
        bins = [[Piece(i, 0, n)] for i, n in enumerate(lengths)]
        n_rows = bucket(len(bins), row_multiple)
        row_len = bucket(max(lengths), packing.row_granularity)
        return RowsLayout(build_rows(bins, samples, row_len, n_rows, image_base),
                          [p for b in bins for p in b], None, sum(lengths))
    if layout != "packed":
        raise ValueError(f"layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    if packing.over_budget == "split":
        pieces = [Piece(*p) for p in split_over_budget(lengths, packing.token_budget)]
    else:
        pieces = [Piece(i, 0, n) for i, n in enumerate(lengths)]
    n_patch = [sum(samples[p.sample].image_tokens) if p.start == 0 else 0 for p in pieces]
    costs = cost([p.length for p in pieces], n_patch)
    packed = pack([p.length for p in pieces], costs, packing.token_budget,
                  algorithm=packing.algorithm, bin_multiple=row_multiple,
                  min_bins=row_multiple * packing.rows_per_device,
                  refine=packing.refine_lengths, max_imbalance=packing.max_imbalance)
    bins = [[pieces[j] for j in b] for b in packed.bins]
    row_len = bucket(int(packed.bin_lengths.max()), packing.row_granularity)
    return RowsLayout(build_rows(bins, samples, row_len, len(bins), image_base), pieces,
                      packed, sum(lengths))


def encoder_patches(samples: Sequence, vit: ViTConfig, row_multiple: int) -> PatchBatch:
    return pack_patches(sample_images(samples), vit, row_multiple=row_multiple)


def loss_tokens(samples: Sequence) -> np.float32:
    """The global loss denominator (answer tokens of the whole step; >= 1)."""
    return np.float32(max(sum(s.loss_mask.sum() for s in samples), 1.0))


def zeros_like_arrays(arrays: dict) -> dict:
    return {k: np.zeros_like(v) for k, v in arrays.items()}


def eval_layout(samples: Sequence, vit: ViTConfig, row_multiple: int, cost: CostModel
                ) -> tuple[PatchBatch, RowsLayout]:
    """(patches, padded layout) of held-out ``samples`` in rows of a multiple of
    ``row_multiple`` (the backbone mesh's "data" size): what evaluation feeds its step."""
    patches = encoder_patches(samples, vit, row_multiple)
    lay = layout_rows(samples, "padded", encoder_image_base(samples, patches),
                      packing=PackingConfig(), cost=cost, row_multiple=row_multiple)
    return patches, lay
