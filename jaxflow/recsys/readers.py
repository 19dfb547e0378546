"""Readers for user-given files: Criteo TSV, MovieLens ratings and RecBole atomic files.
No downloads.

Criteo and MovieLens-clicks return in-memory arrays in the batch layout of ``synthetic.py``
(``{"dense": f32[N, F], "label": f32[N], "sparse": {name: int32[N, 1]}}``); ``file_batch``
slices batches from them. ``read_atomic_file`` reads RecBole's atomic files (``.inter``,
``.item``, ``.user``: a typed tab-separated header) into columns.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re

import numpy as np

from jaxflow.errors import DataError, FileFormatError, text_lines


def read_criteo_tsv(path: str | pathlib.Path, vocab_sizes: tuple[int, ...], *,
                    max_rows: int | None = None, num_dense: int = 13) -> dict:
    """Criteo TSV: ``label, 13 integer features, 26 hex categorical features`` per line.

    Missing dense values are 0 and counts go through ``log1p(max(x, 0))``; a categorical hex
    string is hashed into its table as ``int(hex, 16) % vocab`` (the hash-modulo policy, done
    here because raw values exceed int32); a missing one is padding (-1).
    """
    num_cat = len(vocab_sizes)
    labels, dense, cats = [], [], []
    for lineno, line in text_lines(path, what="Criteo file"):
        if max_rows is not None and len(labels) >= max_rows:
            break
        line = line.rstrip("\r\n")
        if not line:
            continue
        parts = line.split("\t")
        if len(parts) != 1 + num_dense + num_cat:
            raise FileFormatError(
                f"{path}:{lineno}: {len(parts)} tab-separated fields, expected "
                f"{1 + num_dense + num_cat} (label, {num_dense} dense, {num_cat} categorical)")
        try:
            labels.append(float(parts[0]))
            dense.append([float(x) if x else 0.0 for x in parts[1:1 + num_dense]])
            cats.append([int(x, 16) % v if x else -1
                         for x, v in zip(parts[1 + num_dense:], vocab_sizes)])
        except ValueError:
            raise FileFormatError(f"{path}:{lineno}: cannot parse {line[:80]!r}; valid: a numeric "
                                  "label, decimal dense counts, hex categorical values") from None
    if not labels:
        raise FileFormatError(f"{path}: no rows")
    cat = np.asarray(cats, np.int64)
    return {"dense": np.log1p(np.maximum(np.asarray(dense, np.float64), 0)).astype(np.float32),
            "label": np.asarray(labels, np.float32),
            "sparse": {f"c{i}": cat[:, i:i + 1].astype(np.int32) for i in range(num_cat)}}


def read_movielens(path: str | pathlib.Path, *, max_rows: int | None = None) -> dict:
    """MovieLens ratings ``user item rating timestamp``, separated by ``::``, tabs, commas or
    spaces (ml-1m, ml-100k, ml-latest); a non-numeric header line is skipped.

    Returns int64 ``user``, ``item``, ``timestamp`` and f32 ``rating`` arrays.
    """
    rows = []
    for lineno, line in text_lines(path, what="MovieLens ratings file"):
        if max_rows is not None and len(rows) >= max_rows:
            break
        line = line.strip()
        if not line:
            continue
        for sep in ("::", "\t", ","):
            if sep in line:
                parts = line.split(sep)
                break
        else:
            parts = line.split()
        if len(parts) < 4:
            if lineno == 1 and not _numeric(parts[0]):
                continue  # a header naming fewer columns
            raise FileFormatError(f"{path}:{lineno}: {len(parts)} fields in {line[:80]!r}; "
                                  "expected user item rating timestamp")
        try:
            user, item, rating, ts = int(parts[0]), int(parts[1]), float(parts[2]), float(parts[3])
        except (ValueError, OverflowError):
            if lineno == 1:
                continue  # header
            raise FileFormatError(f"{path}:{lineno}: cannot parse {line[:80]!r} as user item "
                                  "rating timestamp (integers, a number, an integer)") from None
        rows.append((user, item, _rating(rating, parts[2], path, lineno),
                     _timestamp(ts, parts[3], path, lineno)))
    if not rows:
        raise FileFormatError(f"{path}: no ratings")
    arr = list(zip(*rows))
    high = int(np.iinfo(np.int32).max)  # ids index int32 embedding rows
    for column, values in (("user", arr[0]), ("item", arr[1])):
        if min(values) < 0 or max(values) > high:
            row = next(i for i, v in enumerate(values) if not 0 <= v <= high)
            raise DataError(f"{path}: {column} id {values[row]} (rating {row + 1}) is out of "
                            f"range; valid: 0..{high} (ids index int32 embedding rows)")
    return {"user": np.asarray(arr[0], np.int64), "item": np.asarray(arr[1], np.int64),
            "rating": np.asarray(arr[2], np.float32), "timestamp": np.asarray(arr[3], np.int64)}


#: the largest timestamp accepted (seconds): float64 holds every integer up to it exactly
TIMESTAMP_MAX = 2 ** 53
_ID_MAX = int(np.iinfo(np.int32).max)  # ids index int32 embedding rows


def _rating(value: float, text: str, path, lineno: int) -> float:
    if not math.isfinite(value):
        raise DataError(f"{path}:{lineno}: rating {text.strip()!r} is not finite; valid: a finite "
                        "number")
    return value


def _timestamp(value: float, text: str, path, lineno: int) -> int:
    if not 0 <= value <= TIMESTAMP_MAX:  # nan fails too
        raise DataError(f"{path}:{lineno}: timestamp {text.strip()!r} is out of range; valid: "
                        f"seconds in [0, 2**53]")
    return int(value)


def _id(text: str, column: str, path, lineno: int) -> int:
    token = text.strip()
    if not re.fullmatch(r"[0-9]+", token):
        raise FileFormatError(f"{path}:{lineno}: {column} token {token[:40]!r} is not an integer "
                              f"id in 0..{_ID_MAX} (MovieLens ids)")
    if int(token) > _ID_MAX:
        raise DataError(f"{path}:{lineno}: {column} {token} is out of range; valid: 0..{_ID_MAX}")
    return int(token)


def _number(text: str, column: str, path, lineno: int) -> float:
    if not text.strip():
        raise FileFormatError(f"{path}:{lineno}: {column} is missing; valid: a finite number")
    try:
        return float(text)
    except ValueError:
        raise FileFormatError(f"{path}:{lineno}: {column} {text.strip()[:40]!r} is not a number"
                              "; valid: a finite number") from None


def read_atomic_ratings(path: str | pathlib.Path) -> dict:
    """RecBole ratings (an ``.inter`` file with ``user_id``, ``item_id``, ``rating`` and
    ``timestamp`` columns, any order) as int64 ``user``, ``item``, ``timestamp`` and f32
    ``rating`` arrays [R], in file order.

    Raises:
      FileFormatError / DataError: one line naming the file, the line and the value: an id that
        is not a decimal integer in 0..2**31-1, a rating that is missing or not finite, a
        timestamp that is missing or outside [0, 2**53] seconds.
    """
    need = ("user_id", "item_id", "rating", "timestamp")
    names, _, rows = _read_atomic(pathlib.Path(path), need, "utf-8-sig")
    if not rows:
        raise FileFormatError(f"{path}: no ratings")
    at = [names.index(c) for c in need]
    out: dict[str, list] = {"user": [], "item": [], "rating": [], "timestamp": []}
    for lineno, parts in rows:
        u, i, r, t = (parts[k] for k in at)
        out["user"].append(_id(u, "user_id", path, lineno))
        out["item"].append(_id(i, "item_id", path, lineno))
        out["rating"].append(_rating(_number(r, "rating", path, lineno), r, path, lineno))
        out["timestamp"].append(_timestamp(_number(t, "timestamp", path, lineno), t, path, lineno))
    return {"user": np.asarray(out["user"], np.int64), "item": np.asarray(out["item"], np.int64),
            "rating": np.asarray(out["rating"], np.float32),
            "timestamp": np.asarray(out["timestamp"], np.int64)}


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


ATOMIC_TYPES = ("token", "token_seq", "float", "float_seq")


def read_atomic_file(path: str | pathlib.Path, *, columns: tuple[str, ...] | None = None,
                     encoding: str = "utf-8") -> dict[str, list]:
    """A RecBole atomic file (``.inter`` / ``.item`` / ``.user`` / ...) as columns.

    Format (RecBole 1.x): tab-separated; the first line names every column as ``name:type``
    with type ``token`` (a string), ``token_seq`` (space-separated strings), ``float`` or
    ``float_seq`` (space-separated floats); an empty field is a missing value. Example (the
    ``ml-100k.item`` of RecBole's ``dataset_example``)::

        item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq
        1\tToy Story\t1995\tAnimation Children's Comedy

    Args:
      path: the file.
      columns: names to return (default: all); a name the header lacks is an error.
      encoding: text encoding.

    Returns:
      {name: list of R values} in file order: ``str`` (token, "" when missing),
      ``list[str]`` (token_seq, [] when missing), ``float`` (float, nan when missing) or
      ``list[float]`` (float_seq).

    Raises:
      FileFormatError (a ValueError): the file is missing or not in ``encoding``, a header
        field without a known type, a missing requested column, a row
        with more fields than the header or an unparsable float (naming the line).
    """
    path = pathlib.Path(path)
    if encoding.lower().replace("-", "").replace("_", "") in ("utf8", "utf8sig"):
        encoding = "utf-8-sig"  # a leading byte-order mark is not part of the first column's name
    names, types, rows = _read_atomic(path, columns, encoding)
    want = names if columns is None else list(columns)
    convert = {"token": str.strip, "token_seq": str.split,
               "float": lambda v: float(v) if v.strip() else float("nan"),
               "float_seq": lambda v: [float(x) for x in v.split()]}
    out: dict[str, list] = {}
    for c in want:
        i = names.index(c)
        kind = types[i]
        fn = convert[kind]
        try:
            out[c] = [fn(parts[i]) for _, parts in rows]
        except ValueError:
            lineno, parts = next((n, p) for n, p in rows if not _parses(fn, p[i]))
            raise FileFormatError(f"{path}:{lineno}: column {c!r} ({kind}) cannot parse "
                             f"{parts[i].strip()!r}") from None
    return out


def _read_atomic(path: pathlib.Path, columns, encoding: str) -> tuple[list, list, list]:
    """(column names, types, [(line number, fields)]) of an atomic file (read_atomic_file)."""
    with _text_errors(path, encoding), open(path, encoding=encoding) as f:
        header = f.readline().rstrip("\r\n").split("\t")
        names, types = [], []
        for field in header:
            name, _, kind = field.rpartition(":")
            if not name or kind not in ATOMIC_TYPES:
                raise FileFormatError(f"{path}: header field {field!r} is not name:type with type in "
                                 f"{ATOMIC_TYPES} (RecBole atomic-file header)")
            names.append(name)
            types.append(kind)
        want = names if columns is None else list(columns)
        missing = [c for c in want if c not in names]
        if missing:
            raise FileFormatError(f"{path}: header {header} lacks columns {missing}")
        rows = []
        for lineno, line in enumerate(f, 2):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) > len(names):
                raise FileFormatError(f"{path}:{lineno}: {len(parts)} tab-separated fields, the header "
                                 f"has {len(names)}")
            rows.append((lineno, parts + [""] * (len(names) - len(parts))))
    return names, types, rows


@contextlib.contextmanager
def _text_errors(path: pathlib.Path, encoding: str):
    """A missing file or undecodable text as FileFormatError naming ``path``."""
    if not path.is_file():
        raise FileFormatError(f"{str(path)!r} does not exist or is not a file")
    try:
        yield
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{str(path)!r} is not {encoding} text ({e.reason} at byte "
                              f"{e.start} of a block); valid: {encoding} text") from None


def _parses(fn, value) -> bool:
    try:
        fn(value)
    except ValueError:
        return False
    return True


def movielens_to_clicks(ratings: dict, *, positive_at: float = 4.0) -> dict:
    """Click-style rows: label = rating >= positive_at; features user, item; dense = the
    timestamp scaled to [0, 1]. User / item ids index tables of size max id + 1."""
    ts = ratings["timestamp"].astype(np.float64)
    span = max(ts.max() - ts.min(), 1.0)
    return {"dense": ((ts - ts.min()) / span).astype(np.float32)[:, None],
            "label": (ratings["rating"] >= positive_at).astype(np.float32),
            "sparse": {"user": ratings["user"].astype(np.int32)[:, None],
                       "item": ratings["item"].astype(np.int32)[:, None]}}


def file_batch(data: dict, step: int, batch_size: int, *, start: int = 0, stop: int | None = None) -> dict:
    """Batch ``step`` of rows [start, stop), cycling (a fixed order; shuffle the file upstream)."""
    stop = len(data["label"]) if stop is None else stop
    n = stop - start
    if n < 1:
        raise ValueError(f"empty row range [{start}, {stop})")
    idx = start + (np.arange(batch_size) + step * batch_size) % n
    return {"dense": data["dense"][idx], "label": data["label"][idx],
            "sparse": {k: v[idx] for k, v in data["sparse"].items()}}
