"""Where a measured number came from: the git commit, the command, the machine, and whether
the code it measured has changed since.

A calibration file (a simulator's measured inputs) carries a ``provenance`` block built by
:func:`run_provenance` (a run writes its own with :func:`write_calibration_from_run`);
:func:`stale_calibration` compares the recorded commit with the working tree of the measured
paths (``git diff --quiet <commit> -- <paths>``) and returns a warning when they differ, when
the commit is unknown here, or when git cannot be asked. :func:`measured_hash` is the same
question asked of file contents instead of git: a sha256 over the measured files as they are on
disk, so two checkouts of one tree agree without git and a record names its code exactly.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import warnings
from typing import Callable, Mapping, Sequence

#: The repository root of this checkout (the parent of the ``jaxflow`` package).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _git(args: Sequence[str], root: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          timeout=20)


def git_commit(root: pathlib.Path = REPO_ROOT) -> str | None:
    """HEAD's full hash, or None without git / outside a repository."""
    try:
        out = _git(["rev-parse", "HEAD"], root)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def git_dirty_paths(paths: Sequence[str], root: pathlib.Path = REPO_ROOT) -> list[str] | None:
    """Files under ``paths`` that differ from HEAD in the working tree (None: git unavailable)."""
    try:
        out = _git(["status", "--porcelain", "--", *paths], root)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sorted(line[3:] for line in out.stdout.splitlines() if line.strip())


def display_path(path: "str | os.PathLike") -> str:
    """``path`` relative to the repository root when it lies inside it (else as given)."""
    p = pathlib.Path(path)
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def current_command(argv: Sequence[str] | None = None) -> str:
    """The command line of this process, as ``python -m jaxflow.run ...`` when it is the runner."""
    argv = list(sys.argv if argv is None else argv)
    head = argv[0] if argv else ""
    if head.endswith(os.path.join("jaxflow", "run.py")) or head == "-m":
        return shlex.join(["python", "-m", "jaxflow.run", *argv[1:]])
    return shlex.join(["python", *argv]) if argv else "python"


def machine() -> dict:
    """CPU count, platform and load averages (1, 5, 15 min) at the time of the call."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average_1_5_15_min": load}


def run_provenance(*, experiment: str, variant: str, devices: int, measured_paths: Sequence[str],
                   command: str | None = None, root: pathlib.Path = REPO_ROOT,
                   extra: dict | None = None) -> dict:
    """The ``provenance`` block of a calibration written by this process now.

    ``devices``: the device count the run used (fake CPU devices on a CPU: they share the cores,
    so per-device stage times are inflated by oversubscription). ``measured_paths``: the code
    the numbers measure (checked by :func:`stale_calibration`); ``git_dirty_paths`` lists those
    of them with uncommitted changes at write time (then the commit alone does not pin the code).
    """
    import jax

    out = {"experiment": experiment, "variant": variant, "git_commit": git_commit(root),
           "git_dirty_paths": git_dirty_paths(measured_paths, root),
           "command": command or current_command(),
           # a count <= 0 (e.g. "every device") is resolved to the devices this process has
           "devices": int(devices) if devices and int(devices) > 0 else jax.device_count(),
           "process_device_count": jax.device_count(),
           "backend": jax.default_backend(), "jax_version": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": machine(), "measured_paths": list(measured_paths),
           # the measured files' contents now (calibration_report compares it with the tree's)
           "measured_hash": measured_hash(measured_paths, root)}
    return out | dict(extra or {})


def write_record(path: "str | os.PathLike", *, what: str, provenance: dict, values,
                 context: dict) -> str:
    """Writes a calibration file ``{"what", "provenance", "values", "context"}`` (JSON; parent
    folders created) and returns the path written. ``provenance``: :func:`run_provenance`."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"what": what, "provenance": dict(provenance), "values": values, "context": context}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return str(path)


def write_calibration_from_run(write: Callable[[str, Mapping, dict], str], path: str,
                               summary: Mapping, *, measured_paths: Sequence[str],
                               experiment: str, variant: str, devices: int) -> str:
    """A driver's ``calibration_out``: ``write(path, summary, provenance)`` with the provenance
    of this process now (:func:`run_provenance` of ``measured_paths``); returns the path
    written. Each simulator binds its own writer and measured paths
    (``jaxflow.nestpipe.simulate.write_calibration_from_run``,
    ``jaxflow.marl.simulate.write_calibration_from_run``)."""
    prov = run_provenance(experiment=experiment, variant=variant, devices=devices,
                          measured_paths=measured_paths)
    return write(path, summary, prov)


def stale_calibration(commit: str | None, paths: Sequence[str],
                      root: pathlib.Path = REPO_ROOT) -> tuple[bool | None, str | None]:
    """(stale, warning): (False, None) when ``paths`` are unchanged since ``commit`` in this
    checkout (working tree included); (True, why) when they changed; (None, why) when it cannot
    be checked (no commit recorded, commit unknown here, git unavailable). Never raises."""
    if not commit:
        return None, "the calibration records no git commit; cannot check whether it is current"
    try:
        out = _git(["diff", "--quiet", commit, "--", *paths], root)
    except (OSError, subprocess.SubprocessError) as e:
        return None, (f"cannot check the calibration against commit {commit[:12]}: git "
                      f"unavailable ({type(e).__name__}: {e})")
    if out.returncode == 0:
        return False, None
    if out.returncode == 1:
        return True, (f"the measured code ({', '.join(paths)}) changed since the calibration's "
                      f"commit {commit[:12]}: regenerate it (the calibration file's command)")
    reason = " ".join(out.stderr.split())[:200] or f"git exit {out.returncode}"
    return None, f"cannot check the calibration against commit {commit[:12]} here: {reason}"


class CalibrationWarning(UserWarning):
    """A calibration that may not describe the current code (or cannot be checked)."""


def read_record(calibration: "str | os.PathLike", default: pathlib.Path, experiment: str
                ) -> tuple[pathlib.Path, dict]:
    """(path, JSON) of a calibration: "" = ``default``; a file written by :func:`write_record`;
    or an ``experiment`` run directory / its summary.json. FileNotFoundError names the value."""
    path = pathlib.Path(calibration) if calibration else default
    path = path / "summary.json" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"calibration={str(calibration)!r}: no calibration file or "
                                f"{experiment} summary.json there; use '' for the built-in file "
                                f"or a runs/{experiment}/<run> directory")
    return path, json.loads(path.read_text())


def is_record(record: dict) -> bool:
    """True for a file written by :func:`write_record` (else: a run's summary.json)."""
    return "values" in record and "provenance" in record


def summary_provenance(summary: dict, measured_paths: Sequence[str]) -> dict:
    """The provenance of a run's summary.json used as a calibration: its own git_commit,
    argv and device_count."""
    argv = summary.get("argv")
    return {"experiment": summary.get("experiment"), "variant": summary.get("variant"),
            "git_commit": summary.get("git_commit"),
            "command": " ".join(argv) if isinstance(argv, list) else None,
            "devices": summary.get("device_count"), "measured_paths": list(measured_paths)}


def calibration_report(prov: dict, path: str, measured_paths: Sequence[str],
                       root: pathlib.Path = REPO_ROOT) -> dict:
    """What a simulator's summary reports under ``calibration`` (commit, command, devices,
    path, date, machine, dirty paths, stale, warning); warns (CalibrationWarning) when the
    measured code changed since the recorded commit or that cannot be checked. A calibration
    with a ``measured_hash`` (:func:`run_provenance`) is stale exactly when the measured files'
    contents here differ from it (no git needed); one without is checked by git
    (:func:`stale_calibration`)."""
    paths = prov.get("measured_paths") or measured_paths
    if prov.get("measured_hash"):
        stale = prov["measured_hash"] != measured_hash(paths, root)
        since = (prov.get("git_commit") or "an unknown commit")[:12]
        warning = (f"the measured code ({', '.join(paths)}) changed since the calibration was measured at "
                   f"{since} (content hash differs): regenerate it (the calibration file's command)"
                   if stale else None)
    else:
        stale, warning = stale_calibration(prov.get("git_commit"), paths, root)
    if warning:
        warnings.warn(f"{path}: {warning}", CalibrationWarning, stacklevel=3)
    return {"git_commit": prov.get("git_commit"), "command": prov.get("command"),
            "devices": prov.get("devices"), "path": path, "date": prov.get("date"),
            "machine": prov.get("machine"), "git_dirty_paths": prov.get("git_dirty_paths"),
            "measured_hash": prov.get("measured_hash"), "stale": stale, "warning": warning}


_SKIPPED_PARTS = ("__pycache__", ".git", ".ipynb_checkpoints")
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".so", ".swp")


def _measured_files(paths: Sequence[str], root: pathlib.Path) -> list[pathlib.Path]:
    include, exclude = [], []
    for spec in paths:
        if spec.startswith(":(exclude)"):
            exclude.append(spec[len(":(exclude)"):].rstrip("/"))
        elif spec.startswith(":"):
            raise ValueError(f"measured path {spec!r}: only plain paths and ':(exclude)PATH' are valid")
        else:
            include.append(spec.rstrip("/"))
    files = set()
    for spec in include:
        base = root / spec
        found = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in found:
            rel = p.relative_to(root).as_posix()
            if any(part in _SKIPPED_PARTS or part.startswith(".") for part in p.relative_to(root).parts):
                continue
            if rel.endswith(_SKIPPED_SUFFIXES) or any(rel == x or rel.startswith(x + "/") for x in exclude):
                continue
            files.add(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def measured_hash(paths: Sequence[str], root: "str | os.PathLike" = REPO_ROOT) -> str:
    """A sha256 (hex) over the contents of the files under ``paths`` (relative to ``root``; a
    ``:(exclude)PATH`` entry leaves PATH out, as in git pathspecs), each file hashed with its
    relative path; bytecode caches and dot-files are skipped. Read from the working tree, not
    from git: a record made in a dirty tree names that tree. A path that does not exist adds
    nothing (so a removed package changes the hash)."""
    root = pathlib.Path(root)
    digest = hashlib.sha256()
    for p in _measured_files(paths, root):
        digest.update(p.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(p.read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()
