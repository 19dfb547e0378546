"""The warm start in a study's report: point 0 of every curve, and the summary's ``warm_start``
block (which cached pretraining run, and how good it was before the study trained it).

Every cell of a study starts from the same warm start, so its evaluation is the first point of
each cell's curve (step 0) and is measured once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["curve_from_rows", "warm_start_report"]


def curve_from_rows(rows: Iterable[Mapping[str, Any]], key: str, *, start: float,
                    step: str = "rollout") -> list[tuple[Any, Any]]:
    """``[(0, start), (row[step], row[key]), ...]`` over the metrics rows holding ``key`` (the
    evaluated ones), the warm start's value ``start`` first."""
    return [(0, start)] + [(r[step], r[key]) for r in rows if key in r]


def warm_start_report(cache: str, pretrain_summary: Mapping[str, Any], **evaluations: Any) -> dict:
    """The summary's ``warm_start`` block: ``{"cache": cache entry name,
    "pretrain_heldout_accuracy": the pretraining run's own held-out accuracy (None if it has
    none), **evaluations}`` (the study's own measurements of the warm start)."""
    return {"cache": cache, "pretrain_heldout_accuracy": pretrain_summary.get("heldout_accuracy"),
            **evaluations}
