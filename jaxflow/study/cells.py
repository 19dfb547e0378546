"""Cell resume: a study's finished cells in ``cells.jsonl``, and the loop that skips them.

Each cell of a study is an independent run with a unique label. When one finishes, its record
(a JSON-able dict holding ``"label"``) is appended to ``cells.jsonl`` in the run directory and
its checkpoints (``checkpoints/<label>/``) are deleted. On ``--resume`` the finished cells are
read back instead of run again, and the cell that was running continues from its checkpoint
(its training loop, :func:`jaxflow.train.loop.run_steps`, does that); the metrics rows it had
logged before the checkpoint are read back with :func:`rows_of_cell`.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from jaxflow.experiment import RunContext

__all__ = ["CELLS_FILE", "CellsRun", "finished_cells", "read_cells", "record_cell", "rows_of_cell",
           "run_cells"]

#: where a study's finished cells go, one JSON record per line
CELLS_FILE = "cells.jsonl"


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def finished_cells(run: RunContext, *, filename: str = CELLS_FILE, key: str = "label") -> dict[Any, dict]:
    """On ``--resume`` (``run.resume``): the records of the cells that had finished, by their
    ``key`` field (a later record of the same key wins); ``{}`` for a fresh run or no file."""
    path = run.out_dir / filename
    if not run.resume or not path.exists():
        return {}
    return {r[key]: r for r in _read_jsonl(path)}


def read_cells(directory: str | pathlib.Path, *, filename: str = CELLS_FILE,
               key: str = "label") -> dict[Any, dict]:
    """The finished cells of another run directory (a study reusing a finished one's cells), by
    ``key``. FileNotFoundError names the directory when it holds no ``filename``."""
    path = pathlib.Path(directory) / filename
    if not path.exists():
        raise FileNotFoundError(f"reuse={str(directory)!r}: {path} does not exist; valid: run "
                                f"directories of a study holding {filename}")
    return {r[key]: r for r in _read_jsonl(path)}


def record_cell(run: RunContext, record: Mapping[str, Any], *, filename: str = CELLS_FILE) -> None:
    """Appends a finished cell's ``record`` (JSON-able) to ``filename`` (process 0 only)."""
    if run.is_primary:
        with open(run.out_dir / filename, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def rows_of_cell(run: RunContext, *, field: str, value: Any, upto: int,
                 counter: str = "rollout") -> list[dict]:
    """The metrics.jsonl rows logged for one cell (``row[field] == value``) with ``counter`` in
    ``1..upto``: what a cell resumed from its checkpoint at ``upto`` had logged before it
    (``[]`` for ``upto == 0`` or no metrics yet)."""
    path = run.out_dir / "metrics.jsonl"
    if upto == 0 or not path.exists():
        return []
    return [r for r in _read_jsonl(path)
            if r.get(field) == value and counter in r and r[counter] <= upto]


class CellsRun(NamedTuple):
    """What :func:`run_cells` returns: the ``records`` of the cells in order (finished ones
    read back, the others run) and the labels ``missing`` because ``report_only`` skipped them."""

    records: list[dict]
    missing: list[str]


def run_cells(cells: Sequence[Any], run_one: Callable[[Any, int], dict], *, run: RunContext,
              done: dict[str, dict], indices: Iterator[int] | None = None,
              report_only: bool = False, describe: Callable[[dict], str] | None = None,
              filename: str = CELLS_FILE) -> CellsRun:
    """Runs every cell not in ``done`` (by ``cell.label``), one after another.

    Args:
      cells: the study's cells, each with a unique ``label``.
      run_one: ``(cell, index) -> record`` (its record holds ``"label"``); ``index`` orders the
        cell's rows in the run (e.g. its global step offset ``index * steps``).
      done: finished records by label (:func:`finished_cells`); each cell run here is added to
        it, so a later call skips it too.
      indices: the index of each cell that is run (in turn); None: the cell's position in
        ``cells``.
      report_only: run nothing; the labels of the cells not in ``done`` come back as missing.
      describe: ``record -> line`` logged with ``run.info`` once a cell finishes.

    Each finished cell is appended to ``filename`` (:func:`record_cell`) and its checkpoints
    (``run.checkpoint_dir / label``) are deleted.
    """
    records, missing = [], []
    for position, cell in enumerate(cells):
        if cell.label in done:
            records.append(done[cell.label])
            continue
        if report_only:
            missing.append(cell.label)
            continue
        record = run_one(cell, position if indices is None else next(indices))
        record_cell(run, record, filename=filename)
        shutil.rmtree(run.checkpoint_dir / cell.label, ignore_errors=True)
        if describe is not None:
            run.info(describe(record))
        done[cell.label] = record
        records.append(record)
    return CellsRun(records, missing)
