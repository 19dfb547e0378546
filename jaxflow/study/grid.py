"""Seed grids: every setting of a study crossed with its seeds, seeds innermost.

A study's cells are (setting, seed) pairs. Runs with the same seed share their warm start,
prompts and sampling keys, which is what lets :func:`jaxflow.study.intervals.paired_by_seed`
compare two settings seed by seed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

__all__ = ["seed_grid", "cell_seed"]


def seed_grid(blocks: Iterable[tuple[Sequence[Hashable], int]]) -> list[tuple[Hashable, int]]:
    """(setting, seed) of every cell, block by block, seeds innermost.

    Args:
      blocks: ``(settings, seeds)`` pairs: each setting of a block runs seeds ``0..seeds-1``.
        A setting already listed (in this block or an earlier one) is dropped, so a later
        block's seed count never overrides an earlier one's.

    Returns:
      ``[(setting, seed), ...]`` in order.
    """
    seen: set = set()
    out: list[tuple[Hashable, int]] = []
    for settings, seeds in blocks:
        if seeds < 0:
            raise ValueError(f"seeds={seeds} in a seed grid block; valid: >= 0")
        for setting in settings:
            if setting in seen:
                continue
            seen.add(setting)
            out += [(setting, s) for s in range(seeds)]
    return out


def cell_seed(base: int, index: int, *, stride: int = 1000) -> int:
    """The RNG seed of a study's cell or draw ``index`` under the run's base seed:
    ``base * stride + index`` (distinct for ``0 <= index < stride``)."""
    if not 0 <= index < stride:
        raise ValueError(f"index={index}; valid: 0 <= index < stride={stride}")
    return base * stride + index
