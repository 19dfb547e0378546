"""A thin parent process for a multi-process run: names a lost coordinator.

When the coordinator (process 0) dies, JAX's client in every other process aborts at once
from C++ (SIGABRT and a stack trace; no Python code runs). The runner therefore starts each
non-coordinator worker under :func:`supervise`: the worker runs as a child in its own session,
SIGINT / SIGTERM sent to the parent are forwarded to it once, and when it dies by SIGABRT while
the coordinator's address no longer accepts connections, the parent prints one line naming
process 0 and exits with ``LOST_PEER_EXIT``. Any other outcome passes the child's exit status
through (a signal ``s`` as ``128 + s``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Sequence

from jaxflow.distributed import LOST_PEER_EXIT

#: Set in the worker's environment, so the worker does not supervise itself.
SUPERVISED_ENV = "JAXFLOW_SUPERVISED"


def reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True when ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def supervise(command: Sequence[str], *, host: str, port: int, process_id: int,
              stream=None) -> int:
    """Runs ``command`` (the worker) to completion; returns the exit status to use."""
    env = dict(os.environ, **{SUPERVISED_ENV: "1"})
    child = subprocess.Popen(list(command), env=env, start_new_session=True)
    forwarded = {}

    def forward(signum, frame):
        child.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        forwarded[s] = signal.signal(s, forward)
    try:
        rc = child.wait()
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)
    if rc == -signal.SIGABRT and process_id != 0 and not reachable(host, port):
        print(f"[jaxflow] process {process_id}: lost process 0 (the coordinator at {host}:{port} "
              "no longer answers); exiting", file=stream or sys.stderr, flush=True)
        return LOST_PEER_EXIT
    return rc if rc >= 0 else 128 - rc
