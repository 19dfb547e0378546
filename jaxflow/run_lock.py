"""One writer per run directory: the lock process 0 of a job holds on ``RUN_DIR/run.lock``.

The lock is an exclusive ``fcntl.flock`` on ``run.lock``, a small JSON file naming its holder
(host, PID, the PID's start time, since when). The kernel drops a flock when its process dies,
however it dies, so on one host a lock can never outlive its holder; the file it leaves behind
after a SIGKILL or a power cut names a holder that is gone, and the next run takes the lock over
with one info line. A file left by a holder on *another* host (a run directory on a shared
filesystem, where a flock may not reach across hosts) cannot be checked from here: taking it over
needs ``--break-lock``. A run directory given as a remote URI (``gs://...``) is not locked: object
stores have no exclusive create the runner could rely on, so two runs writing one bucket
directory are not detected.

Example::

    lock = RunLock.acquire(out_dir, break_lock=False, info=print)   # RunLocked: held by another
    try:
        ...
    finally:
        lock.release()
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Any, Callable

from jaxflow.errors import UserError

LOCK_NAME = "run.lock"


class RunLocked(UserError, RuntimeError):
    """The run directory is in use by another run (one line naming the holder and what to do)."""


def _pid_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22),
    so a PID reused by another process is not mistaken for the holder; None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_alive(holder: dict) -> bool:
    """Whether the process ``holder`` names runs on this host (same PID and start time)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    started = holder.get("pid_start")
    return started is None or _pid_start(pid) in (None, started)


def describe(holder: dict) -> str:
    """``host H, pid P, since T`` for a holder record."""
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"since {holder.get('since', '?')}")


def _read_holder(fd: int) -> dict | None:
    """The holder record in the open lock file, None when it is empty or not a record."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw.decode("utf-8", "replace"))
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _refusal(out_dir: str, holder: dict | None) -> RunLocked:
    who = describe(holder) if holder else "a process that has not yet written its name"
    return RunLocked(f"--out {out_dir!r} is in use by another run ({who}; {LOCK_NAME}); wait for "
                     "it to finish or stop it, or pick another --out")


def check_free(out_dir: Any, *, break_lock: bool = False) -> None:
    """Refuses early (``RunLocked``) when a live run holds ``out_dir``'s lock, or a holder on
    another host is named without ``break_lock``; reads only, writes nothing."""
    from jaxflow.experiment import is_local, run_path

    out = run_path(out_dir)
    if not is_local(out):
        return
    path = os.path.join(os.fspath(out), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or unreadable: acquire reports it)
    try:
        try:
            holder = _read_holder(fd)
        except OSError:
            return  # not a file: acquire reports it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(os.fspath(out), holder) from None
        except OSError:
            return
        if holder and holder.get("host") != socket.gethostname() and not break_lock:
            raise _other_host(os.fspath(out), holder)
    finally:
        os.close(fd)


def _other_host(out_dir: str, holder: dict) -> RunLocked:
    return RunLocked(f"--out {out_dir!r} is locked by a run on another host ({describe(holder)}; "
                     f"{LOCK_NAME}) whose process cannot be checked from here; if that run is "
                     "gone, add --break-lock")


class RunLock:
    """The held lock of one run directory (:meth:`acquire`); :meth:`release` gives it up."""

    def __init__(self, path: str | None, fd: int | None):
        self.path, self._fd = path, fd

    @classmethod
    def unlocked(cls) -> "RunLock":
        """A lock that holds nothing (remote run directories, processes other than 0)."""
        return cls(None, None)

    @classmethod
    def acquire(cls, out_dir: "str | os.PathLike", *, break_lock: bool = False,
                info: Callable[[str], None] = print) -> "RunLock":
        """Takes the lock of the local directory ``out_dir`` (created if missing) for this
        process; ``info`` gets one line when a dead holder's lock is taken over.

        Raises:
          RunLocked: another live process on this host holds it, or a holder on another host is
            named and ``break_lock`` is False.
        """
        out = os.fspath(out_dir)
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, LOCK_NAME)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunLocked(f"--out {out!r}: cannot open its lock file {path} ({e.strerror}); "
                                "valid: a run directory where run.lock is a writable file") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise _refusal(out, holder) from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    info(f"{out}: this filesystem has no file locks ({e.strerror}); the run "
                         "directory is not locked against a second run")
                    return cls.unlocked()
                raise
            # The holder before us may have removed the file between our open and our flock:
            # then we hold a lock on a name nobody will look at again, and must start over.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            previous = _read_holder(fd)
            if previous:
                if previous.get("host") != socket.gethostname():
                    if not break_lock:
                        raise _other_host(out, previous)
                    info(f"broke the lock of {describe(previous)} (--break-lock)")
                else:  # we hold the flock, so its process is gone (or no longer holds it)
                    state = "still running, no longer holding it" if holder_alive(previous) else "not running"
                    info(f"took over the lock of {describe(previous)} ({state})")
            me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                  "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(me) + "\n").encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)  # the flock goes with it; the previous holder's record stays
            raise
        return cls(path, fd)

    @property
    def held(self) -> bool:
        """Whether this object holds a lock now."""
        return self._fd is not None

    def release(self) -> None:
        """Removes ``run.lock`` and drops the flock (idempotent; a file already removed, e.g.
        by the rollback of a failed fresh run, is fine)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            if self.path is not None and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        os.close(fd)


def lock_run_dir(out_dir: Any, *, break_lock: bool = False, info: Callable[[str], None] = print) -> RunLock:
    """:meth:`RunLock.acquire` for a local run directory (an ``etils.epath.Path`` or a path);
    for a URI (``gs://...``) an unlocked :class:`RunLock` and one ``info`` line saying so."""
    from jaxflow.experiment import is_local, run_path

    path = run_path(out_dir)
    if not is_local(path):
        info(f"{path} is not a local directory, so it is not locked against a second run")
        return RunLock.unlocked()
    return RunLock.acquire(os.fspath(path), break_lock=break_lock, info=info)
