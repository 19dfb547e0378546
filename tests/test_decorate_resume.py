"""Decoration killed (SIGKILL) anywhere resumes to the uninterrupted run's table, bit for bit;
a resume whose corpus, batch size or student differs is refused with one line.

Each kill is a real ``os.kill(getpid(), SIGKILL)`` in a child process (this file run as a
script) at a chosen point: inside the first batch's chunk writes, inside a later batch's chunk
writes, after a batch's chunks are written but before its commit, and inside the commit (the
manifest's temporary file half written). A kill inside tensorstore's own chunk write leaves
``<chunk>.__lock`` holding a torn write (tensorstore writes there, fsyncs, renames); the child
leaves exactly that behind, longer than the real chunk, because tensorstore reuses such a file
without truncating it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxflow.decorate import corpus as C
from jaxflow.decorate import decorate as D
from jaxflow.decorate import student as ST
from jaxflow.decorate.tagging import default_hierarchy
from jaxflow.errors import UserError
from jaxflow.mesh import make_mesh
from jaxflow.models.transformer import TransformerConfig

T, B, N = 32, 8, 29  # 4 batches: 8, 8, 8 and 5 rows
TRUNK = TransformerConfig(vocab_size=99, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                          max_seq_len=T)
KILL_BATCH = 2  # the later batch the mid-run kills hit


def _student():
    """(predict, params, tokenizer), the same in every process: parameters drawn from a seeded
    numpy generator (faster than the eager init on a busy CPU, and as deterministic)."""
    fns = ST.student_functions(TRUNK, default_hierarchy(), make_mesh({"data": 8}))
    abstract = jax.eval_shape(lambda: ST.init_student(fns, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)
    return ST.make_predict(fns), jax.device_put(params, fns.param_shardings), C.text_tokenizer()


def _write_corpus(path: pathlib.Path, *, changed: bool = False) -> None:
    docs = C.TemplateGenerator(default_hierarchy(), max_chars=T).generate(N, seed=0)
    if changed:  # one document of the last batch edited
        docs[-2] = dataclasses.replace(docs[-2], text=docs[-2].text[:-1] + "!")
    C.write_jsonl(docs, path)


def _decorate(corpus, table, student, **kw):
    predict, params, tok = student
    return D.decorate_corpus(corpus, table, predict=predict, params=params, tokenizer=tok,
                             seq_len=T, batch_size=B, **kw)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _committed_chunks(directory: pathlib.Path, batches: int) -> dict[str, int]:
    """Inode of every chunk file of the first ``batches`` batches (chunk keys "k" or "k.0")."""
    return {f"{col}/{p.name}": p.stat().st_ino for col in D.COLUMNS
            for p in (directory / col).iterdir()
            if p.name.split(".")[0].isdigit() and "__lock" not in p.name
            and int(p.name.split(".")[0]) < batches}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("decorate_resume")
    corpus = root / "corpus.jsonl"
    _write_corpus(corpus)
    student = _student()
    stats = _decorate(corpus, root / "full", student)
    assert (stats.rows, stats.batches, stats.resumed_from_batch) == (N, 4, 0)
    return corpus, root / "full", student


# point -> (batch the child is killed in, batches committed when it dies)
POINTS = {"first_batch_chunk": (0, 0), "mid_chunk": (KILL_BATCH, KILL_BATCH),
          "before_commit": (KILL_BATCH, KILL_BATCH), "in_commit": (KILL_BATCH, KILL_BATCH)}


@pytest.mark.parametrize("point", list(POINTS))
def test_sigkill_then_resume_is_bit_identical(reference, tmp_path, point):
    corpus, full, student = reference
    table = tmp_path / "table"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, __file__, str(corpus), str(table), point], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

    batch, committed = POINTS[point]
    manifest = json.loads((table / D.MANIFEST).read_text())
    assert manifest["batches_done"] == committed
    if point in ("first_batch_chunk", "mid_chunk"):
        assert (table / "ops" / f"{batch}.0.__lock").stat().st_size == 4096  # the torn write
    if point == "in_commit":
        assert (table / (D.MANIFEST + ".tmp")).exists()
    # Readable as it was left: the committed rows, equal to the uninterrupted run's.
    ref = D.read_table(full)
    left = D.read_table(table, partial=True)
    for col in D.COLUMNS:
        assert left[col].tobytes() == ref[col][: committed * B].tobytes(), col

    committed_chunks = _committed_chunks(table, committed)
    assert len(committed_chunks) == committed * len(D.COLUMNS)

    stats = _decorate(corpus, table, student)
    assert (stats.resumed_from_batch, stats.batches, stats.rows) == (committed, 4, N)
    assert _committed_chunks(table, committed) == committed_chunks  # never rewritten (same inodes)
    got = D.read_table(table)
    for col in D.COLUMNS:
        assert got[col].dtype == ref[col].dtype and got[col].shape == ref[col].shape, col
        assert got[col].tobytes() == ref[col].tobytes(), col
    assert _files(table) == _files(full)  # chunk files, metadata and manifest, byte for byte


def test_resume_with_other_input_is_refused_in_one_line(reference, tmp_path):
    corpus, full, student = reference
    table = tmp_path / "table"
    part = _decorate(corpus, table, student, stop_after_batches=1)
    assert part.batches == 1
    with pytest.raises(D.DecorationTableError, match=r"unfinished \(1 of 4 batches committed\)"):
        D.read_table(table)
    before = _files(table)

    changed = tmp_path / "changed.jsonl"
    _write_corpus(changed, changed=True)
    with pytest.raises(D.DecorationTableError) as e:
        _decorate(changed, table, student)
    msg = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in msg
    assert f"decoration table {table} was written for other input" in msg
    assert "corpus " in msg and "documents" not in msg  # same count, other text: only that named
    assert "batch_size" not in msg and "student" not in msg
    assert "a fresh --out" in msg

    predict, params, tok = student
    with pytest.raises(D.DecorationTableError, match=r"batch_size 8 \(now 16\)"):
        D.decorate_corpus(corpus, table, predict=predict, params=params, tokenizer=tok, seq_len=T,
                          batch_size=16)
    other = jax.tree.map(lambda x: x + 1, params)
    with pytest.raises(D.DecorationTableError, match=r"student parameters [0-9a-f]{12} \(now "):
        D.decorate_corpus(corpus, table, predict=predict, params=other, tokenizer=tok, seq_len=T,
                          batch_size=B)
    assert _files(table) == before  # refused before anything was written

    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    with pytest.raises(D.DecorationTableError, match=r"holds checkpoints but no manifest.json"):
        _decorate(corpus, legacy, student)
    assert sorted(p.name for p in legacy.iterdir()) == ["checkpoints"]

    # The same input resumes the partial table to the reference.
    _decorate(corpus, table, student)
    assert _files(table) == _files(full)


def _child(corpus: str, table: str, point: str) -> None:
    """Decorates ``corpus`` into ``table`` and SIGKILLs itself at ``point``."""
    jax.config.update("jax_num_cpu_devices", 8)
    batch, _ = POINTS[point]
    table_dir = pathlib.Path(table)
    real_write, real_commit = D._write_batch, D.write_manifest

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def write_batch(tab, lo, rows):
        if lo != batch * B or point not in ("first_batch_chunk", "mid_chunk"):
            return real_write(tab, lo, rows)
        for col in ("ratings", "tags"):  # some columns' chunks renamed into place
            tab[col][lo: lo + len(rows[col])].write(rows[col]).result()
        torn = np.random.default_rng(1).bytes(4096)  # "ops": killed inside its write
        (table_dir / "ops" / f"{batch}.0.__lock").write_bytes(torn)
        die()

    def commit(directory, manifest):
        if manifest["batches_done"] == batch + 1 and point == "before_commit":
            die()
        return real_commit(directory, manifest)

    def replace(src, dst):
        # Inside the commit: the manifest's temporary file written (cut to half, as a kill
        # inside its write leaves it), not yet renamed over the manifest.
        src = pathlib.Path(src)
        if point == "in_commit" and pathlib.Path(dst).name == D.MANIFEST:
            text = src.read_text()
            if json.loads(text)["batches_done"] == batch + 1:
                src.write_text(text[: len(text) // 2])
                die()
        return real_replace(src, dst)

    real_replace = os.replace
    D._write_batch, D.write_manifest, os.replace = write_batch, commit, replace
    _decorate(corpus, table, _student())
    sys.exit(3)  # not reached: the kill point was never hit


if __name__ == "__main__":
    _child(*sys.argv[1:4])
