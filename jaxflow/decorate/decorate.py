"""Decorating a whole corpus with the student: streamed, sharded, jitted, resumable.

The corpus is read one batch at a time from a JSONL file (``corpus.read_jsonl``); each batch is
encoded to a fixed [B, T] shape (the last one padded), run through the student's jitted
``predict`` with the batch sharded over the mesh's "data" axis, and its rows written to a
table of zarr arrays (tensorstore):

  ratings  [N, 8] float32   the student's rating scores (z-scale of its training targets)
  tags     [N, 3] int32     tag paths
  ops      [N, T] uint8     edit operations of the first T characters
  lengths  [N] int32        tokens (characters + EOS) of the text
  edited_lengths [N] int32  tokens of the edited text

Row i is the i-th document ``corpus.read_jsonl`` yields from the file. After every ``checkpoint_every`` batches the
number of finished batches is saved with ``jaxflow.checkpoint.Checkpointer`` (after the rows
are written), so a killed run resumes at the next batch and rewrites the same rows with the
same compiled function: the finished table is bit-identical to an uninterrupted run's.
Only one batch of texts is in memory at a time.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.decorate.corpus import Document, read_jsonl
from jaxflow.decorate.editing import DELETE
from jaxflow.decorate.rating import CRITERIA
from jaxflow.decorate.student import encode_texts

COLUMNS = ("ratings", "tags", "ops", "lengths", "edited_lengths")


def _spec(path: pathlib.Path, shape, dtype: str, chunk_rows: int):
    chunks = [chunk_rows] + list(shape[1:])
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"shape": list(shape), "chunks": chunks, "dtype": dtype}}


def open_table(directory: str | pathlib.Path, *, n_rows: int | None = None, seq_len: int | None = None,
               chunk_rows: int = 256, create: bool = False) -> dict[str, ts.TensorStore]:
    """The decoration table's tensorstore arrays (created when ``create``)."""
    directory = pathlib.Path(directory)
    dtypes = {"ratings": "<f4", "tags": "<i4", "ops": "|u1", "lengths": "<i4", "edited_lengths": "<i4"}
    out = {}
    for col in COLUMNS:
        if create:
            shape = {"ratings": (n_rows, len(CRITERIA)), "tags": (n_rows, 3), "ops": (n_rows, seq_len),
                     "lengths": (n_rows,), "edited_lengths": (n_rows,)}[col]
            out[col] = ts.open(_spec(directory / col, shape, dtypes[col], chunk_rows), create=True,
                               open=True).result()
        else:
            if not (directory / col).exists():
                raise ValueError(f"{directory} holds no decoration table (missing {col!r})")
            out[col] = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                              "path": str(directory / col)}}).result()
    return out


def read_table(directory: str | pathlib.Path, columns=COLUMNS) -> dict[str, np.ndarray]:
    """Columns of a finished table as numpy arrays (the table, not the texts, is in memory)."""
    table = open_table(directory)
    return {c: table[c].read().result() for c in columns}


def count_documents(path: str | pathlib.Path, max_chars: int) -> int:
    """Documents ``corpus.read_jsonl`` yields from ``path`` (one streaming pass).

    Raises:
      ValueError: naming the first document longer than ``max_chars`` (stored documents with
        known fields are not re-chunked by the reader; chunk the corpus first).
    """
    n = 0
    for doc in read_jsonl(path, max_chars=max_chars):
        if len(doc.text) > max_chars:
            raise ValueError(f"document {n} ({doc.id!r}) has {len(doc.text)} characters > "
                             f"seq_len={max_chars}; chunk the corpus first (corpus.chunk_text)")
        n += 1
    return n


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


@dataclasses.dataclass(frozen=True)
class DecorationStats:
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
      batch_size: B, a multiple of the device count of predict's mesh.
      checkpoint_every: save progress every this many batches.
      stop_after_batches: stop (as if killed) after this many batches of this call; for tests.

    Resumes automatically when ``table_dir`` holds a checkpoint.
    """
    table_dir = pathlib.Path(table_dir)
    n_rows = count_documents(corpus_path, seq_len)  # validates every length before any write
    if n_rows == 0:
        raise ValueError(f"{corpus_path}: no documents to decorate")
    ckpt = Checkpointer(table_dir / "checkpoints", save_every=checkpoint_every, max_to_keep=2,
                        async_save=False)
    start = ckpt.latest_step() or 0
    table = open_table(table_dir, n_rows=n_rows, seq_len=seq_len, create=start == 0)
    if start:
        done = int(ckpt.restore(start, {"batches_done": jax.ShapeDtypeStruct((), jnp.int32)})["batches_done"])
        if done != start:
            raise ValueError(f"decoration checkpoint {start} records {done} batches")
    n_batches = -(-n_rows // batch_size)
    t0, t_steady, rows_steady, k = time.perf_counter(), None, 0, start
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
        lengths = valid[:m].sum(1).astype(np.int32) + 1
        edited = ((ops != DELETE) & valid[:m]).sum(1).astype(np.int32) + 1
        lo, hi = k * batch_size, k * batch_size + m
        writes = [table["ratings"][lo:hi].write(np.asarray(out["ratings"])[:m].astype(np.float32)),
                  table["tags"][lo:hi].write(np.asarray(out["tags"])[:m].astype(np.int32)),
                  table["ops"][lo:hi].write(ops), table["lengths"][lo:hi].write(lengths),
                  table["edited_lengths"][lo:hi].write(edited)]
        for w in writes:
            w.result()
        ckpt.save(k + 1, {"batches_done": jnp.int32(k + 1)}, force=k + 1 == n_batches)
        if t_steady is None:
            t_steady = time.perf_counter()
        else:
            rows_steady += m
    ckpt.close()
    elapsed = time.perf_counter() - t0
    steady = time.perf_counter() - t_steady if t_steady is not None else 0.0
    finished = ckpt.latest_step() or 0
    return DecorationStats(rows=min(finished * batch_size, n_rows), batches=finished,
                           resumed_from_batch=start,
                           texts_per_second=rows_steady / steady if steady > 0 else float("nan"),
                           seconds=elapsed)
