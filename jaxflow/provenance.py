"""Where a measured number came from: the git commit, the command, the machine, and whether
the code it measured has changed since.

A calibration file (a simulator's measured inputs) carries a ``provenance`` block built by
:func:`run_provenance`; :func:`stale_calibration` compares the recorded commit with the working
tree of the measured paths (``git diff --quiet <commit> -- <paths>``) and returns a warning
when they differ, when the commit is unknown here, or when git cannot be asked.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from typing import Sequence

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
           "machine": machine(), "measured_paths": list(measured_paths)}
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
