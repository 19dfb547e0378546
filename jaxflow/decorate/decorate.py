"""Decorating a whole corpus with the student: streamed, sharded, jitted, crash-safe resumable.

The corpus is read one batch at a time from a JSONL file (``corpus.read_jsonl``); each batch is
encoded to a fixed [B, T] shape (the last one padded), run through the student's jitted
``predict`` with the batch sharded over the mesh's "data" axis, and its rows written to a
table of zarr arrays (tensorstore):

  ratings  [N, 8] float32   the student's rating scores (z-scale of its training targets)
  tags     [N, 3] int32     tag paths
  ops      [N, T] uint8     edit operations of the first T characters
  lengths  [N] int32        tokens (characters + EOS) of the text
  edited_lengths [N] int32  tokens of the edited text

Row i is the i-th document ``corpus.read_jsonl`` yields from the file.

Crash safety. Every array is chunked by B rows, so batch k writes whole chunks of its own and
no other batch ever touches them. ``manifest.json`` records the table's fingerprint and how
many batches are committed; it is replaced atomically (written to a temporary file, fsynced,
``os.replace``) only after the batch's chunks are on disk (tensorstore fsyncs each chunk and
renames it into place). A kill at any point - inside a chunk write, between the writes and the
commit, inside the commit - leaves the committed rows intact and the manifest old or new, never
torn; a resumed call rewrites the uncommitted batches whole with the same compiled function, so
the finished table is bit-identical to an uninterrupted run's. Tensorstore writes a chunk into
``<chunk>.__lock`` and renames it, and reuses (without truncating) a stale lock file left by a
killed write, which would append the stale tail to the new chunk; a resumed call therefore
deletes stale lock files first, under an exclusive lock on the table (``.lock``) that also keeps
a second process out.

The fingerprint is everything that determines the rows: the corpus (sha256 of every document's
id and text in order), seq_len, batch_size, the tokenizer's alphabet, the student's parameters
(sha256 of every leaf) and its compiled program (sha256 of the lowered StableHLO). A resume
whose fingerprint differs is refused (:class:`DecorationTableError`) before anything is written.
Only one batch of texts is in memory at a time.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Callable, Iterator

import jax
import numpy as np
import tensorstore as ts

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.decorate.corpus import Document, read_jsonl
from jaxflow.decorate.editing import DELETE
from jaxflow.decorate.rating import CRITERIA
from jaxflow.decorate.student import encode_texts
from jaxflow.errors import FileFormatError

COLUMNS = ("ratings", "tags", "ops", "lengths", "edited_lengths")
MANIFEST = "manifest.json"
TABLE_FORMAT = "jaxflow.decorate.table/1"
_LOCK = ".lock"
_DTYPES = {"ratings": "<f4", "tags": "<i4", "ops": "|u1", "lengths": "<i4", "edited_lengths": "<i4"}
# What the fingerprint holds, in the words an error message uses.
_FIELDS = {"corpus_sha256": "corpus", "documents": "documents", "seq_len": "seq_len",
           "batch_size": "batch_size", "tokenizer_sha256": "tokenizer",
           "params_sha256": "student parameters", "program_sha256": "student program"}


class DecorationTableError(FileFormatError):
    """A decoration table directory that cannot be resumed or read as asked (another corpus or
    student, unfinished, not a table, in use); the message names the directory and what to do."""


def _spec(path: pathlib.Path, shape, dtype: str, chunk_rows: int):
    chunks = [chunk_rows] + list(shape[1:])
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"shape": list(shape), "chunks": chunks, "dtype": dtype}}


def open_table(directory: str | pathlib.Path, *, n_rows: int | None = None, seq_len: int | None = None,
               chunk_rows: int = 256, create: bool = False) -> dict[str, ts.TensorStore]:
    """The decoration table's tensorstore arrays (created, replacing any there, when ``create``;
    ``chunk_rows`` rows per chunk)."""
    directory = pathlib.Path(directory)
    out = {}
    for col in COLUMNS:
        if create:
            shape = {"ratings": (n_rows, len(CRITERIA)), "tags": (n_rows, 3), "ops": (n_rows, seq_len),
                     "lengths": (n_rows,), "edited_lengths": (n_rows,)}[col]
            shutil.rmtree(directory / col, ignore_errors=True)  # leftovers of an uncommitted start
            out[col] = ts.open(_spec(directory / col, shape, _DTYPES[col], chunk_rows), create=True).result()
        else:
            if not (directory / col / ".zarray").exists():
                raise DecorationTableError(f"{directory} holds no decoration table (missing {col!r}); "
                                           "decorate into a fresh directory")
            out[col] = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                              "path": str(directory / col)}}).result()
    return out


def read_manifest(directory: str | pathlib.Path) -> dict | None:
    """The table's manifest (fingerprint, rows, batches committed), or None when there is none.

    Raises:
      DecorationTableError: ``manifest.json`` is not a decoration manifest.
    """
    path = pathlib.Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DecorationTableError(f"{path} is not readable JSON ({e}); decorate into a fresh "
                                   "directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != TABLE_FORMAT:
        raise DecorationTableError(f"{path}: field 'format' is not {TABLE_FORMAT!r}; not a table "
                                   "this version writes, decorate into a fresh directory")
    return manifest


def read_table(directory: str | pathlib.Path, columns=COLUMNS, *, partial: bool = False) -> dict[str, np.ndarray]:
    """Columns of a table as numpy arrays (the table, not the texts, is in memory).

    ``partial``: return the committed rows of an unfinished table (a killed run's) instead of
    refusing it.

    Raises:
      DecorationTableError: no manifest, or the table is unfinished and not ``partial``.
    """
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise DecorationTableError(f"{directory} holds no decoration table ({MANIFEST} missing)")
    done = min(manifest["batches_done"] * manifest["batch_size"], manifest["rows"])
    if done < manifest["rows"] and not partial:
        raise DecorationTableError(
            f"decoration table {directory} is unfinished ({manifest['batches_done']} of "
            f"{manifest['batches']} batches committed); resume the decoration with the same "
            "corpus and student, or read it with partial=True")
    table = open_table(directory)
    return {c: table[c][:done].read().result() for c in columns}


def scan_corpus(path: str | pathlib.Path, max_chars: int) -> tuple[int, str]:
    """(documents, sha256 of their ids and texts in order) of what ``corpus.read_jsonl``
    yields from ``path``, in one streaming pass.

    Raises:
      ValueError: naming the first document longer than ``max_chars`` (stored documents with
        known fields are not re-chunked by the reader; chunk the corpus first).
    """
    n, h = 0, hashlib.sha256()
    for doc in read_jsonl(path, max_chars=max_chars):
        if len(doc.text) > max_chars:
            raise ValueError(f"document {n} ({doc.id!r}) has {len(doc.text)} characters > "
                             f"seq_len={max_chars}; chunk the corpus first (corpus.chunk_text)")
        h.update(doc.id.encode() + b"\0" + doc.text.encode() + b"\1")
        n += 1
    return n, h.hexdigest()


def count_documents(path: str | pathlib.Path, max_chars: int) -> int:
    """Documents ``corpus.read_jsonl`` yields from ``path`` (see :func:`scan_corpus`)."""
    return scan_corpus(path, max_chars)[0]


def params_sha256(params) -> str:
    """sha256 of a parameter pytree: every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        arr = np.asarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def table_fingerprint(*, corpus_sha256: str, documents: int, predict: Callable, params,
                      tokenizer: CharTokenizer, seq_len: int, batch_size: int) -> dict:
    """What determines a table's rows (see the module docstring); stored in its manifest."""
    lower = getattr(predict, "lower", None) or jax.jit(predict).lower
    program = lower(params, np.zeros((batch_size, seq_len), np.int32),
                    np.zeros((batch_size, seq_len), bool)).as_text()
    alphabet = getattr(tokenizer, "alphabet", None)
    return {"corpus_sha256": corpus_sha256, "documents": documents, "seq_len": seq_len,
            "batch_size": batch_size,
            "tokenizer_sha256": hashlib.sha256(repr(alphabet if alphabet is not None
                                                    else tokenizer).encode()).hexdigest(),
            "params_sha256": params_sha256(params),
            "program_sha256": hashlib.sha256(program.encode()).hexdigest()}


def _short(value) -> str:
    return value[:12] if isinstance(value, str) and len(value) == 64 else str(value)


def check_fingerprint(directory: pathlib.Path, stored: dict, current: dict) -> None:
    """Raises DecorationTableError naming what differs between a table's fingerprint and this
    call's (one line: the table, each field stored vs now, what to do)."""
    diffs = [f"{label} {_short(stored.get(key))} (now {_short(current[key])})"
             for key, label in _FIELDS.items() if stored.get(key) != current[key]]
    if diffs:
        raise DecorationTableError(
            f"decoration table {directory} was written for other input, so it cannot be resumed: "
            f"{', '.join(diffs)}; decorate into a fresh directory (a fresh --out) or delete it")


def _fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    """Commits ``manifest`` atomically: temporary file, fsync, ``os.replace``, fsync of the
    directory. A kill at any point leaves the previous manifest or this one."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)


def _lock_table(directory: pathlib.Path) -> int:
    """An exclusive lock on the table, held until the fd is closed; refused while another
    process holds it."""
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DecorationTableError(f"decoration table {directory} is in use by another process; "
                                   "wait for it or decorate into a fresh directory") from None
    return fd


def _drop_stale_chunk_locks(directory: pathlib.Path) -> None:
    # tensorstore reuses a stale "<chunk>.__lock" without truncating it (see module docstring).
    for col in COLUMNS:
        if (directory / col).is_dir():
            for stale in (directory / col).glob("*.__lock"):
                stale.unlink()


def _open_for_writing(table_dir: pathlib.Path, fingerprint: dict, n_rows: int, n_batches: int,
                      batch_size: int, seq_len: int) -> tuple[dict, int]:
    """(manifest, batches committed) of the table at ``table_dir``, created when new; called
    under the table lock (the fingerprint is checked again here, where no other process
    can change the manifest)."""
    manifest = read_manifest(table_dir)
    if manifest is not None:
        check_fingerprint(table_dir, manifest.get("fingerprint", {}), fingerprint)
    else:
        manifest = {"format": TABLE_FORMAT, "fingerprint": fingerprint, "rows": n_rows,
                    "batches": n_batches, "batch_size": batch_size, "seq_len": seq_len,
                    "batches_done": 0}
        write_manifest(table_dir, manifest)  # first, so a kill from here on leaves a table to resume
    _drop_stale_chunk_locks(table_dir)
    return manifest, int(manifest["batches_done"])


def _refuse_foreign(table_dir: pathlib.Path) -> None:
    """A directory with files but no manifest is not a table this module writes: refused."""
    if not table_dir.is_dir():
        return
    foreign = sorted(p.name for p in table_dir.iterdir() if p.name not in (_LOCK, MANIFEST + ".tmp"))
    if foreign:
        raise DecorationTableError(
            f"{table_dir} holds {', '.join(foreign[:4])} but no {MANIFEST}, so it is not a "
            "decoration table that can be resumed (an older jaxflow's, or other files); "
            "decorate into a fresh directory (a fresh --out)")


def _batches(path, batch_size: int, max_chars: int, start: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for i, doc in enumerate(read_jsonl(path, max_chars=max_chars)):
        if i < start * batch_size:
            continue
        batch.append(doc)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_batch(table: dict, lo: int, rows: dict[str, np.ndarray]) -> None:
    """Writes one batch's rows (whole chunks of its own) and waits until they are on disk."""
    writes = [table[c][lo: lo + len(rows[c])].write(rows[c]) for c in COLUMNS]
    for w in writes:
        w.result()


@dataclasses.dataclass(frozen=True)
class DecorationStats:
    """What one ``decorate_corpus`` call did: rows and batches written, the batch it resumed from, texts/s in the
    steady state (the first, compiling batch excluded) and wall seconds."""
    rows: int
    batches: int
    resumed_from_batch: int
    texts_per_second: float  # steady state: excludes the first batch of this call (compilation)
    seconds: float


def decorate_corpus(corpus_path: str | pathlib.Path, table_dir: str | pathlib.Path, *,
                    predict: Callable, params, tokenizer: CharTokenizer, seq_len: int,
                    batch_size: int, checkpoint_every: int = 1,
                    stop_after_batches: int | None = None) -> DecorationStats:
    """Decorates every document of ``corpus_path`` into the table at ``table_dir``.

    Args:
      predict: ``student.make_predict(fns)``; params: the student's parameters.
      seq_len: T of the student; documents must be at most T characters (corpus.chunk_text).
      batch_size: B, a multiple of the device count of predict's mesh; also the chunk rows.
      checkpoint_every: commit (rewrite the manifest) every this many batches.
      stop_after_batches: stop (as if killed) after this many batches of this call; for tests.

    Resumes automatically when ``table_dir`` holds a manifest with batches committed.

    Raises:
      ValueError: a document longer than ``seq_len``, or an empty corpus (nothing written).
      DecorationTableError: ``table_dir`` holds a table of another fingerprint (another corpus,
        batch size, student...), files that are not a table, or is in use by another process.
    """
    table_dir = pathlib.Path(table_dir)
    n_rows, corpus_sha = scan_corpus(corpus_path, seq_len)  # validates every length before any write
    if n_rows == 0:
        raise ValueError(f"{corpus_path}: no documents to decorate")
    fingerprint = table_fingerprint(corpus_sha256=corpus_sha, documents=n_rows, predict=predict,
                                    params=params, tokenizer=tokenizer, seq_len=seq_len,
                                    batch_size=batch_size)
    stored = read_manifest(table_dir)
    if stored is not None:
        check_fingerprint(table_dir, stored.get("fingerprint", {}), fingerprint)
    else:
        _refuse_foreign(table_dir)
    n_batches = -(-n_rows // batch_size)
    table_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_table(table_dir)
    try:
        manifest, start = _open_for_writing(table_dir, fingerprint, n_rows, n_batches, batch_size, seq_len)
        table = open_table(table_dir, n_rows=n_rows, seq_len=seq_len, chunk_rows=batch_size,
                           create=start == 0)
        t0, t_steady, rows_steady, done = time.perf_counter(), None, 0, start
        for k, docs in enumerate(_batches(corpus_path, batch_size, seq_len, start), start):
            if stop_after_batches is not None and k - start >= stop_after_batches:
                break
            texts = [d.text for d in docs]
            tokens, valid = encode_texts(texts, tokenizer, seq_len)
            m = len(texts)
            if m < batch_size:
                tokens = np.concatenate([tokens, np.zeros((batch_size - m, seq_len), np.int32)])
                valid = np.concatenate([valid, np.zeros((batch_size - m, seq_len), bool)])
            out = jax.device_get(predict(params, tokens, valid))
            ops = np.asarray(out["ops"])[:m].astype(np.uint8)
            _write_batch(table, k * batch_size, {
                "ratings": np.asarray(out["ratings"])[:m].astype(np.float32),
                "tags": np.asarray(out["tags"])[:m].astype(np.int32), "ops": ops,
                "lengths": valid[:m].sum(1).astype(np.int32) + 1,
                "edited_lengths": ((ops != DELETE) & valid[:m]).sum(1).astype(np.int32) + 1})
            if (k + 1) % checkpoint_every == 0 or k + 1 == n_batches:
                manifest = {**manifest, "batches_done": k + 1}
                write_manifest(table_dir, manifest)
                done = k + 1
            if t_steady is None:
                t_steady = time.perf_counter()
            else:
                rows_steady += m
    finally:
        os.close(lock)
    elapsed = time.perf_counter() - t0
    steady = time.perf_counter() - t_steady if t_steady is not None else 0.0
    return DecorationStats(rows=min(done * batch_size, n_rows), batches=done,
                           resumed_from_batch=start,
                           texts_per_second=rows_steady / steady if steady > 0 else float("nan"),
                           seconds=elapsed)
