"""Rows of prompts and answers for RL: local data files and reasoning-gym's procedural tasks.

A *row* is a dict of columns, one per example. The RL task over rows
(:class:`jaxflow.rl.dataset_task.DatasetTask`) reads the prompt from ``prompt_key`` and the gold
answer from ``answer_key`` and hands every other column to the reward.

Column names follow verl's RL parquet files where they fit: the prompt is ``prompt`` (a string,
or, as in verl, a list of chat messages ``{"role", "content"}`` rendered by the model's chat
template), and the answer is ``answer`` or, in verl's layout, the nested
``reward_model.ground_truth`` (a dotted key reads a nested column). With ``answer_key=None`` the
first of :data:`ANSWER_KEYS` that every row holds is used.

Example::

    rows = load_rows("train.jsonl")                    # [{"prompt": ..., "answer": ...}, ...]
    rows = reasoning_gym_rows("chain_sum", size=64, seed=0)
    train, heldout = heldout_split(rows, 16, seed=0)
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
from typing import Any, Sequence

import numpy as np

from jaxflow.errors import FileFormatError, MissingExtraError, UserError, read_text, text_lines

#: The prompt column verl's RL datasets use (a string or a list of chat messages).
PROMPT_KEY = "prompt"
#: Answer columns tried in order when no ``answer_key`` is given (plain files, verl's parquet).
ANSWER_KEYS = ("answer", "reward_model.ground_truth")
#: File kinds :func:`load_rows` reads (a ``datasets.save_to_disk`` directory besides).
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
#: The install command of the optional dependencies of RL on your own data.
RL_EXTRA = 'pip install -e ".[rl]"'


class DataSourceError(FileFormatError):
    """A data file or source that cannot give rows: names the path (and line), the key and the
    columns present."""


def require_module(name: str, what: str):
    """The imported module ``name``; :class:`MissingExtraError` naming ``what`` needs it and the
    ``rl`` extra's install command when it is not installed."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingExtraError(f"{what} needs the {name.split('.')[0]!r} package ({e}): {RL_EXTRA}") from None


def get_column(row: dict, key: str) -> Any:
    """The value of ``key`` in ``row``; a dotted key (``reward_model.ground_truth``) reads nested
    dicts when ``row`` has no column of that exact name. KeyError when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def has_column(row: dict, key: str) -> bool:
    """Whether :func:`get_column` finds ``key`` in ``row``."""
    try:
        get_column(row, key)
    except KeyError:
        return False
    return True


def find_answer_key(rows: Sequence[dict]) -> str | None:
    """The first of :data:`ANSWER_KEYS` that every row holds, or None."""
    for key in ANSWER_KEYS:
        if rows and all(has_column(r, key) for r in rows):
            return key
    return None


def check_columns(rows: Sequence[dict], keys: Sequence[str], source: str) -> None:
    """Raises :class:`DataSourceError` naming ``source``, the first row without one of ``keys``
    and the columns it has."""
    for key in keys:
        for i, row in enumerate(rows):
            if not has_column(row, key):
                raise DataSourceError(
                    f"{source}: row {i} has no column {key!r}; columns present: {sorted(row)} "
                    "(set data.prompt_key / data.answer_key to one of them; a dotted key reads a "
                    "nested column)")


def load_rows(path: str | os.PathLike, *, prompt_key: str | None = PROMPT_KEY,
              answer_key: str | None = None) -> list[dict]:
    """Rows (one dict per example) of a local data file, no network.

    Reads ``.jsonl`` (one JSON object per line; blank lines skipped), ``.json`` (a list of
    objects), ``.parquet`` (pyarrow; nested structs become dicts), ``.csv`` (the csv module; every
    value a string) or a directory written by ``datasets.Dataset.save_to_disk`` (a
    ``DatasetDict`` directory: point at its split, ``DIR/train``).

    Args:
      path: the file or directory.
      prompt_key: a column every row must hold (None: not checked).
      answer_key: a column every row must hold (None: not checked; see :func:`find_answer_key`).

    Raises:
      DataSourceError: a missing path, an unknown suffix, an empty file, a bad line (names
        ``file:line``) or a row without ``prompt_key`` / ``answer_key`` (names the columns
        present). MissingExtraError: parquet or a dataset directory without the ``rl`` extra.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataSourceError(f"data file {path!r} does not exist; valid: a {'/'.join(SUFFIXES)} "
                              "file or a datasets.save_to_disk directory")
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        rows = _dataset_dir_rows(path)
    elif suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".json":
        rows = _json_rows(path)
    elif suffix == ".parquet":
        pq = require_module("pyarrow.parquet", f"reading {path!r}")
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a corrupt file
            raise DataSourceError(f"data file {path!r} is not a readable parquet file: "
                                  f"{type(e).__name__}: {e}") from None
    elif suffix == ".csv":
        text = read_text(path, what="data file")
        rows = [dict(r) for r in csv.DictReader(io.StringIO(text, newline=""))]
    else:
        raise DataSourceError(f"data file {path!r} has an unknown suffix {suffix!r}; valid: "
                              f"{', '.join(SUFFIXES)} or a datasets.save_to_disk directory")
    if not rows:
        raise DataSourceError(f"data file {path!r} has no rows")
    check_columns(rows, [k for k in (prompt_key, answer_key) if k is not None], f"data file {path!r}")
    return rows


def _jsonl_rows(path: str) -> list[dict]:
    rows = []
    for number, line in text_lines(path, what="data file"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataSourceError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                                  "valid: one JSON object per line") from None
        if not isinstance(row, dict):
            raise DataSourceError(f"{path}:{number}: a JSON {type(row).__name__}, not an object; "
                                  "valid: one JSON object per line")
        rows.append(row)
    return rows


def _json_rows(path: str) -> list[dict]:
    text = read_text(path, what="data file")
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataSourceError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DataSourceError(f"data file {path!r} holds a JSON {type(data).__name__}; valid: a list "
                              "of objects (or use .jsonl, one object per line)")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataSourceError(f"data file {path!r}: item {i} is a JSON {type(row).__name__}, "
                                  "not an object; valid: a list of objects")
    return data


def _dataset_dir_rows(path: str) -> list[dict]:
    datasets = require_module("datasets", f"reading the dataset directory {path!r}")
    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise DataSourceError(f"directory {path!r} is not a datasets.save_to_disk directory ({e}); "
                              f"valid: such a directory or a {'/'.join(SUFFIXES)} file") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataSourceError(f"directory {path!r} holds the splits {sorted(ds)}; point at one of "
                              f"them, e.g. {os.path.join(path, sorted(ds)[0])!r}")
    return ds.to_list()


def heldout_split(rows: Sequence[dict], size: int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Splits ``rows`` into (train, held-out): ``size`` rows drawn by a permutation seeded by
    ``seed`` are held out, both parts keep the original order. ValueError/UserError when
    ``size`` is not in [1, len(rows) - 1]."""
    if not 1 <= size < len(rows):
        raise UserError(f"held-out size {size} is not in [1, {len(rows) - 1}] for {len(rows)} rows")
    held = set(np.random.default_rng([seed, 0x4E1D]).permutation(len(rows))[:size].tolist())
    return ([r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held])


# ----------------------------------------------------------------------------- reasoning-gym


def reasoning_gym_names() -> list[str]:
    """The names of reasoning-gym's procedural datasets (``reasoning_gym.factory.DATASETS``)."""
    require_module("reasoning_gym", "data.source=reasoning_gym:NAME")
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@functools.lru_cache(maxsize=32)
def reasoning_gym_dataset(name: str, size: int, seed: int):
    """``reasoning_gym.create_dataset(name, size=size, seed=seed)`` (cached; its entries are a
    pure function of the index). DataSourceError listing valid names for an unknown ``name``."""
    names = reasoning_gym_names()
    if name not in names:
        raise DataSourceError(f"reasoning-gym has no dataset {name!r}; valid names include "
                              f"{', '.join(names[:12])}, ... ({len(names)} in all: "
                              "reasoning_gym.factory.DATASETS)")
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed)
    except (TypeError, ValueError, AssertionError) as e:
        raise DataSourceError(f"reasoning-gym dataset {name!r} rejects size={size}, seed={seed}: "
                              f"{type(e).__name__}: {e}") from None


def reasoning_gym_rows(name: str, size: int, seed: int) -> list[dict]:
    """``size`` rows of reasoning-gym's generator ``name`` with ``seed`` (no download).

    Each row: ``prompt`` and ``question`` (the entry's question), ``answer`` (its oracle answer),
    ``metadata`` (the entry's metadata as JSON text), and what ``reward="reasoning_gym"`` needs to
    rebuild the exact entry for the dataset's own ``score_answer``: ``_rg_dataset`` (name),
    ``_rg_size``, ``_rg_seed`` and ``_rg_index``.

    Raises:
      DataSourceError: an unknown ``name`` (lists valid names) or ``size`` < 1.
      MissingExtraError: reasoning-gym is not installed.
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise DataSourceError(f"reasoning-gym size {size!r} is not an integer >= 1")
    ds = reasoning_gym_dataset(name, int(size), int(seed))
    rows = []
    for i in range(int(size)):
        entry = ds[i]
        rows.append({"prompt": entry["question"], "question": entry["question"],
                     "answer": str(entry["answer"]),
                     "metadata": json.dumps(entry.get("metadata", {}), default=str),
                     "_rg_dataset": name, "_rg_size": int(size), "_rg_seed": int(seed), "_rg_index": i})
    return rows
