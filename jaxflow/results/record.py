"""Records: a finished run's headline figures as a small JSON file under ``experiments/results/``.

A record is ``experiments/results/<experiment>/<date>-<machine>-<variant>.json`` holding the
experiment, variant and overrides; the summary's ``headlines`` (each with its strongest baseline,
spread, target and whether it is met; an experiment that declares none yet keeps the numeric
figures of its summary line under ``key_figures`` and says so); the commit and whether the
measured paths were dirty; their content hash (:func:`jaxflow.provenance.measured_hash`);
the machine (:mod:`jaxflow.results.machine`); the 1-minute load at the start and the end; the
jax / jaxlib versions, the date and the wall time; and ``digest``, the sha256 of the record's
canonical JSON without the digest, so an edit by hand is detected (:func:`digest_problem`).

``python -m jaxflow.run ... --record`` writes ``measured.json`` into the run directory at the
start (:func:`mark_start`: the hash of the code as it ran, the load) and records at the end;
``python -m jaxflow.results record RUN_DIR`` records an existing run directory.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import shlex
from typing import Any, Mapping

from jaxflow import provenance
from jaxflow.results.machine import machine_info
from jaxflow.results.registry import ResultsError, measured_paths

SCHEMA = 1
#: Where records live, relative to the repository root.
RESULTS_DIR = "experiments/results"
#: Summary keys that are bookkeeping, not figures (the conventions' common keys).
_NOT_FIGURES = frozenset({"seed", "seeds", "wall_seconds", "device_count", "process_count"})
_HEADLINE_KEYS = ("name", "value", "unit", "higher_is_better")


def canonical_json(obj: Any) -> str:
    """The JSON text the digest is taken over: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def record_digest(record: Mapping) -> str:
    """sha256 (hex) of ``record``'s canonical JSON without its ``digest`` field."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def digest_problem(record: Mapping) -> str | None:
    """None when ``record["digest"]`` matches its content, else why not (one line)."""
    if "digest" not in record:
        return "has no digest"
    if record["digest"] != record_digest(record):
        return (f"digest {str(record['digest'])[:12]}... does not match its content "
                f"({record_digest(record)[:12]}...): edited by hand? record the run again")
    return None


def load_average() -> float | None:
    """The 1-minute load average now (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def code_state(experiment: str, root: pathlib.Path) -> dict:
    """The measured paths of ``experiment``, their content hash under ``root`` and which of
    them differ from HEAD (git; None without it)."""
    paths = list(measured_paths(experiment))
    dirty = provenance.git_dirty_paths([p for p in paths if not p.startswith(":")], root)
    return {"measured_paths": paths, "measured_hash": provenance.measured_hash(paths, root),
            "dirty_paths": dirty, "dirty": None if dirty is None else bool(dirty)}


def mark_start(run_dir: "str | os.PathLike", experiment: str, root: pathlib.Path | None = None) -> dict:
    """Writes ``run_dir/measured.json`` (the code state as the run starts, the load, the time)
    and returns it; :func:`build_record` prefers it (and its commit) to a state taken later. ``root``: the
    repository (default :data:`jaxflow.provenance.REPO_ROOT`, read at the call)."""
    path = _local(run_dir)
    root = provenance.REPO_ROOT if root is None else root
    state = code_state(experiment, root)
    # the commit the run started from: the summary's is read at the end, after others may commit
    state |= {"commit": provenance.git_commit(root), "load_start": load_average(), "started": _now()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "measured.json").write_text(json.dumps(state, indent=1) + "\n")
    return state


def _local(run_dir: "str | os.PathLike") -> pathlib.Path:
    if "://" in str(run_dir):
        raise ResultsError(f"--record with run directory {str(run_dir)!r}; valid: a local directory "
                           f"(record a remote run after copying it here)")
    return pathlib.Path(run_dir)


def _read_json(path: pathlib.Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no {what} there; valid: a finished run directory "
                           f"(runs/<experiment>/<run>, with summary.json)") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None


def _overrides(run_dir: pathlib.Path, summary: Mapping) -> list[str]:
    config = run_dir / "config.json"
    if config.exists():
        return list(_read_json(config, "config.json").get("overrides") or [])
    argv = list(summary.get("argv") or [])
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"] + \
        [a.split("=", 1)[1] for a in argv if a.startswith("--set=")]


def _headlines(summary: Mapping) -> list[dict]:
    heads = summary.get("headlines")
    if heads is None:
        return []
    if not isinstance(heads, list) or not all(isinstance(h, dict) for h in heads):
        raise ResultsError(f"summary 'headlines'={str(heads)[:80]!r}; valid: a list of dicts "
                           f"(jaxflow.study.headline)")
    for h in heads:
        absent = [k for k in _HEADLINE_KEYS if k not in h]
        if absent:
            raise ResultsError(f"headline {h.get('name')!r} lacks {absent}; valid: the keys of "
                               f"jaxflow.study.headline ({', '.join(_HEADLINE_KEYS)}, spread, target, met, ...)")
    return heads


def _no_headlines(summary: Mapping) -> str:
    if summary.get("headlines_error"):
        return f"the headline builder failed ({summary['headlines_error']}): key_figures are its summary line"
    return "the experiment declares no headlines yet: key_figures are its summary line"


def key_figures(summary: Mapping) -> dict:
    """The numeric top-level figures of a summary (those its one-line summary prints), without
    the bookkeeping keys (seed, wall time, device and process counts)."""
    return {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k not in _NOT_FIGURES}


def build_record(run_dir: "str | os.PathLike", *, root: pathlib.Path = provenance.REPO_ROOT,
                 load_start: float | None = None, load_end: float | None = None) -> dict:
    """The record of the finished run in ``run_dir`` (its digest set). The code state comes from
    ``run_dir/measured.json`` when the run wrote one (``--record``); otherwise it is taken now,
    and ResultsError is raised when the run's commit differs from this tree in the measured
    paths (the hash would describe other code). ``load_*``: the 1-minute load at the run's start
    and end when known (``load_end`` defaults to now)."""
    run_dir = _local(run_dir)
    summary = _read_json(run_dir / "summary.json", "summary.json")
    experiment, variant = summary.get("experiment"), summary.get("variant")
    if not experiment or not variant:
        raise ResultsError(f"{run_dir}/summary.json has no experiment / variant; valid: a jaxflow.run summary")
    paths = measured_paths(experiment)
    commit = summary.get("git_commit")
    if (run_dir / "measured.json").exists():
        state = _read_json(run_dir / "measured.json", "measured.json")
        measured_at = "run start"
        commit = state.get("commit") or commit
    else:
        if commit and commit != provenance.git_commit(root):
            stale, why = provenance.stale_calibration(commit, list(paths), root)
            if stale is not False:
                raise ResultsError(f"{run_dir}: run at {commit[:12]} but {why or 'the measured code changed'}; "
                                   f"valid: a run of this tree (rerun it with --record)")
        state = code_state(experiment, root) | {"load_start": load_start}
        measured_at = "record"
    heads = _headlines(summary)
    import jax
    import jaxlib

    record = {
        "schema": SCHEMA, "experiment": experiment, "variant": variant,
        "overrides": _overrides(run_dir, summary),
        "headlines": heads,
        "headlines_note": None if heads else _no_headlines(summary),
        "key_figures": {} if heads else key_figures(summary),
        "commit": commit, "dirty": state.get("dirty"), "dirty_paths": state.get("dirty_paths"),
        "measured_paths": list(state.get("measured_paths") or paths),
        "measured_hash": state["measured_hash"], "measured_at": measured_at,
        "machine": machine_info(),
        "load": {"start_1min": state.get("load_start", load_start),
                 "end_1min": load_average() if load_end is None else load_end},
        "jax_version": summary.get("jax_version"), "jaxlib_version": jaxlib.version.__version__,
        "backend": summary.get("backend", jax.default_backend()),
        "device_count": summary.get("device_count"),
        "date": _now(), "started": state.get("started"),
        "wall_seconds": summary.get("wall_seconds"),
        "command": shlex.join(summary["argv"]) if isinstance(summary.get("argv"), list) else None,
    }
    return record | {"digest": record_digest(record)}


def record_path(record: Mapping, root: pathlib.Path = provenance.REPO_ROOT) -> pathlib.Path:
    """``experiments/results/<experiment>/<date>-<machine>-<variant>.json`` under ``root``; a
    second record of the same day, machine and variant gets ``-2``, ``-3``, ..."""
    folder = pathlib.Path(root) / RESULTS_DIR / record["experiment"]
    stem = f"{record['date'][:10]}-{record['machine']['short']}-{record['variant']}"
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def write_record(record: Mapping, root: pathlib.Path = provenance.REPO_ROOT) -> pathlib.Path:
    """Writes ``record`` at :func:`record_path` (folders created) and returns the path."""
    path = record_path(record, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(record), indent=1, sort_keys=True, allow_nan=False) + "\n")
    return path


def record_run(run_dir: "str | os.PathLike", *, root: pathlib.Path = provenance.REPO_ROOT,
               **loads: float | None) -> pathlib.Path:
    """:func:`build_record` then :func:`write_record`; returns the record's path."""
    return write_record(build_record(run_dir, root=root, **loads), root)


def read_records(root: pathlib.Path = provenance.REPO_ROOT) -> dict[str, list[tuple[pathlib.Path, dict]]]:
    """experiment -> [(path, record)], oldest first (by date, then path), from ``experiments/results``.
    A file that is not valid JSON raises ResultsError naming it."""
    out: dict[str, list[tuple[pathlib.Path, dict]]] = {}
    base = pathlib.Path(root) / RESULTS_DIR
    for path in sorted(base.glob("*/*.json")):
        rec = _read_json(path, "record")
        out.setdefault(path.parent.name, []).append((path, rec))
    for recs in out.values():
        recs.sort(key=lambda pr: (str(pr[1].get("date")), pr[0].name))
    return out
