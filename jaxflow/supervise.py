"""A thin parent process for each process of a multi-process run: JAX's C++ aborts as one line.

When the coordination service fails -- the coordinator (process 0) dies, a second process
registers with a process id already in use, not every process joins within the rendezvous
timeout -- JAX's client aborts the process from C++ (SIGABRT, a fatal log line and a stack
trace; no Python code runs). The runner therefore starts every process of a multi-process run
under :func:`supervise`: the process runs as a child in its own session (it dies with the
parent, :func:`die_with_parent`), SIGINT / SIGTERM sent to the parent are forwarded to it once,
and its stderr passes through the parent. Lines of JAX's C++ log (``E1206 12:00:00.000 ...``) and
what follows them are held back for a few seconds; when the child then dies by SIGABRT they are
replaced by one line:

- the service saw a process id register twice: the id, exit ``LOST_PEER_EXIT``;
- the registration deadline passed (this process could not join): the likely causes, exit
  ``LOST_PEER_EXIT``;
- the coordinator's address no longer accepts connections: "lost process 0", exit
  ``LOST_PEER_EXIT``;
- any other fatal status of the coordination service: its first line, exit ``LOST_PEER_EXIT``
  (an abort from anywhere else keeps its log).

If the child lives on (or ends otherwise), the held lines are printed as they were. Any other
outcome passes the child's exit status through (a signal ``s`` as ``128 + s``).
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from jaxflow.distributed import LOST_PEER_EXIT

#: Set in the worker's environment, so the worker does not supervise itself.
SUPERVISED_ENV = "JAXFLOW_SUPERVISED"
#: The supervisor's pid, in the worker's environment (:func:`die_with_parent`).
PARENT_ENV = "JAXFLOW_SUPERVISOR_PID"
#: Seconds C++ log lines are held back before they are printed as they are.
HOLD_S = 5.0

_CPP_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w./-]+:\d+\]")
_FATAL_STATUS = re.compile(r"absl::Status: (.*)")
_DUPLICATE = re.compile(r"(\d+) unexpectedly tried to connect with a different incarnation")


def reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True when ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    """In a supervised worker: asks Linux to SIGKILL this process when its supervisor dies (so
    killing a process's pid kills the run it started); exits at once if the supervisor is
    already gone. Does nothing outside a supervised worker or off Linux."""
    parent = os.environ.get(PARENT_ENV)
    if os.environ.get(SUPERVISED_ENV) != "1" or not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(128 + signal.SIGKILL)


def explain_abort(held: str, *, host: str, port: int, process_id: int,
                  rendezvous_timeout_s: float | None = None) -> str | None:
    """The one line for a worker that JAX aborted, from its held-back C++ log ``held``; None
    when the abort is not the coordination service's (the held lines are then shown)."""
    me = f"[jaxflow] process {process_id}:"
    if (dup := _DUPLICATE.search(held)) is not None:
        return (f"{me} process id {dup.group(1)} registered twice with the coordinator at {host}:{port} "
                f"(two processes started with --process-id={dup.group(1)}, or one restarted into a "
                "running job); the job is stopped; exiting")
    if "RegisterTask" in held and "DEADLINE_EXCEEDED" in held:
        waited = f" within --rendezvous-timeout {rendezvous_timeout_s:g} s" if rendezvous_timeout_s else ""
        return (f"{me} not every process joined the job at {host}:{port}{waited} (a process not "
                "started, started with another --coordinator or --num-processes, or a duplicate "
                "--process-id); exiting")
    if process_id != 0 and not reachable(host, port):
        return (f"{me} lost process 0 (the coordinator at {host}:{port} no longer answers); exiting")
    if "distributed service detected fatal errors" in held and (status := _FATAL_STATUS.search(held)):
        return f"{me} the JAX coordination service stopped the job: {status.group(1).strip()}; exiting"
    return None


def _pump(stream, lines: queue.Queue) -> None:
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", "replace"))
    lines.put(None)


def supervise(command: Sequence[str], *, host: str, port: int, process_id: int,
              stream=None, rendezvous_timeout_s: float | None = None) -> int:
    """Runs ``command`` (the worker) to completion; returns the exit status to use."""
    out = stream or sys.stderr
    env = dict(os.environ, **{SUPERVISED_ENV: "1", PARENT_ENV: str(os.getpid())})
    child = subprocess.Popen(list(command), env=env, start_new_session=True, stderr=subprocess.PIPE)
    forwarded = {}

    def forward(signum, frame):
        child.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        forwarded[s] = signal.signal(s, forward)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(child.stderr, lines), daemon=True).start()
    held: list[str] = []
    held_at = 0.0
    try:
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if child.poll() is not None and lines.empty():  # ended; a grandchild may hold the pipe
                    break
                line = ""
            if line is None:  # the child closed its stderr (it ended)
                break
            if line and (held or _CPP_LOG.match(line)):
                if not held:
                    held_at = time.monotonic()
                held.append(line)
            elif line:
                out.write(line)
                out.flush()
            if held and time.monotonic() - held_at > HOLD_S and child.poll() is None:
                out.write("".join(held))  # the child lives on: not the abort they announced
                out.flush()
                held = []
        rc = child.wait()
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)
    if rc == -signal.SIGABRT and held:
        line = explain_abort("".join(held), host=host, port=port, process_id=process_id,
                             rendezvous_timeout_s=rendezvous_timeout_s)
        if line is not None:
            print(line, file=out, flush=True)
            return LOST_PEER_EXIT
    if held:
        out.write("".join(held))
        out.flush()
    if rc == -signal.SIGABRT and process_id != 0 and not reachable(host, port):
        print(f"[jaxflow] process {process_id}: lost process 0 (the coordinator at {host}:{port} no "
              "longer answers); exiting", file=out, flush=True)
        return LOST_PEER_EXIT
    return rc if rc >= 0 else 128 - rc
