"""SIGKILLs the corpus decoration after every committed batch, resumes it, and repeats until it
finishes; then compares the table with an uninterrupted run's, byte for byte.

    python experiments/scripts/decorate_kill_loop.py                # 640 documents, 10 batches
    python experiments/scripts/decorate_kill_loop.py --docs 0       # the whole quick pool (2560)

What runs: ``python -m jaxflow.run --exp=decoratelm --variant=quick`` builds its corpus,
annotates a sample with the teacher, distills the student and only then decorates (and a
``--resume`` redoes all of that before the decoration resumes), so a kill per batch through
the CLI would spend nearly all its time outside the decoration. This script therefore drives
the library decoration the CLI calls, ``jaxflow.decorate.decorate.decorate_corpus``, in a
child process, with the quick variant's corpus (its first ``--docs`` pool documents), student
architecture, seq_len, decoration batch size and mesh on ``--devices`` fake CPU devices. The
student's parameters are drawn from a seeded generator instead of distilled (the rows are
whatever the parameters give; what is checked is that kills do not change them).

The parent watches the table's ``manifest.json``; as soon as a child commits a batch it waits a
random fraction of one batch's time (so the kill lands anywhere in the next batch: in the
student's forward pass, inside a chunk write, between the writes and the commit, inside the
commit) and sends SIGKILL, then starts a new child on the same table. It prints the number of
kills, the batches each child started from, and ``identical: True/False``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (for ``configs``)

def _child(corpus: str, table: str, devices: int) -> None:
    """Decorates ``corpus`` into ``table`` (resuming it) and prints the stats as JSON."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import dataclasses

    import jax
    import numpy as np

    jax.config.update("jax_num_cpu_devices", devices)
    from configs import decoratelm as cfg_mod
    from jaxflow.decorate import corpus as C
    from jaxflow.decorate import decorate as D
    from jaxflow.decorate import student as ST
    from jaxflow.decorate.tagging import default_hierarchy
    from jaxflow.models.transformer import TransformerConfig

    cfg = cfg_mod.get_config("quick")
    sc, T = cfg.student, cfg.corpus.max_chars
    tok = C.text_tokenizer()
    trunk = TransformerConfig(vocab_size=tok.vocab_size, d_model=sc.d_model, n_layers=sc.n_layers,
                              n_heads=sc.n_heads, n_kv_heads=sc.n_heads, d_ff=sc.d_ff, max_seq_len=T)
    fns = ST.student_functions(trunk, default_hierarchy(), cfg.mesh.make())
    abstract = jax.eval_shape(lambda: ST.init_student(fns, jax.random.key(cfg.seed)))
    rng = np.random.default_rng(cfg.seed)
    params = jax.tree.map(lambda a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)
    params = jax.device_put(params, fns.param_shardings)
    stats = D.decorate_corpus(corpus, table, predict=ST.make_predict(fns), params=params,
                              tokenizer=tok, seq_len=T, batch_size=cfg.decorate.batch_size,
                              checkpoint_every=1)
    print(json.dumps(dataclasses.asdict(stats)))


def _write_corpus(path: pathlib.Path, docs: int) -> tuple[int, int]:
    """The quick variant's pool (its first ``docs`` documents; 0: all) as JSONL; (documents,
    batch size)."""
    from configs import decoratelm as cfg_mod
    from jaxflow.decorate import corpus as C
    from jaxflow.decorate.mixture import build_corpus
    from jaxflow.decorate.tagging import default_hierarchy

    cfg = cfg_mod.get_config("quick")
    pool = build_corpus(cfg.corpus, default_hierarchy(), cfg.seed)[0]
    pool = pool[:docs] if docs else pool
    C.write_jsonl(pool, path)
    return len(pool), cfg.decorate.batch_size


def _start(corpus: pathlib.Path, table: pathlib.Path, devices: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, __file__, "--child", str(corpus), str(table), str(devices)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _committed(table: pathlib.Path) -> int:
    try:
        return int(json.loads((table / "manifest.json").read_text())["batches_done"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def _left_behind(table: pathlib.Path) -> str:
    """What a kill left in ``table`` besides committed rows: torn chunk writes, a manifest temp."""
    torn = sorted(str(p.relative_to(table)) for p in table.glob("*/*.__lock"))
    tmp = (table / "manifest.json.tmp").exists()
    return "+".join((["torn " + " ".join(torn)] if torn else []) + (["tmp"] if tmp else [])) or "-"


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"decoration child failed (exit {proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def main(argv=None) -> int:
    """Runs the kill loop; prints the kills and whether the tables are identical."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=640, help="pool documents to decorate (0: all)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices of each child")
    p.add_argument("--out", help="work directory (default: a new temporary one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = pathlib.Path(args.out or tempfile.mkdtemp(prefix="decorate_kill_loop_"))
    work.mkdir(parents=True, exist_ok=True)
    corpus, reference, killed = work / "corpus.jsonl", work / "reference", work / "killed"
    for d in (reference, killed):
        if d.exists():
            sys.exit(f"{d} exists; use a fresh --out")
    n_docs, batch_size = _write_corpus(corpus, args.docs)
    n_batches = -(-n_docs // batch_size)
    print(f"corpus: {n_docs} documents, {n_batches} batches of {batch_size}; work dir {work}", flush=True)

    t0 = time.time()
    ref_stats = _finish(_start(corpus, reference, args.devices))
    batch_s = batch_size / ref_stats["texts_per_second"] if ref_stats["texts_per_second"] > 0 else 0.05
    print(f"uninterrupted run: {ref_stats['batches']} batches in {time.time() - t0:.0f} s "
          f"({batch_s * 1e3:.0f} ms per batch)", flush=True)

    rng = random.Random(args.seed)
    kills, starts, left, t0 = 0, [], [], time.time()
    while True:
        before = _committed(killed)
        starts.append(before)
        proc = _start(corpus, killed, args.devices)
        while proc.poll() is None and _committed(killed) <= before:
            time.sleep(0.005)
        if proc.poll() is None:
            time.sleep(rng.uniform(0.0, batch_s))  # somewhere inside the next batch
        if proc.poll() is not None:
            stats = _finish(proc)
            break
        proc.kill()  # SIGKILL
        proc.communicate()
        kills += 1
        left.append(_left_behind(killed))
    print(f"killed run: {kills} kills, children started from batches {starts}, "
          f"{time.time() - t0:.0f} s; last child resumed from batch {stats['resumed_from_batch']}")
    print("what each kill left: " + ", ".join(left) + " (torn: a chunk's tensorstore lock file, "
          "tmp: the manifest's temporary file)")

    from jaxflow.decorate import decorate as D

    a, b = D.read_table(reference), D.read_table(killed)
    same_arrays = all(a[c].dtype == b[c].dtype and a[c].tobytes() == b[c].tobytes() for c in D.COLUMNS)
    same_files = _files(reference) == _files(killed)
    identical = same_arrays and same_files and stats["rows"] == n_docs
    print(f"kills: {kills}")
    print(f"identical: {identical}  (arrays {same_arrays}, files {same_files}, rows {stats['rows']})")
    return 0 if identical else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
