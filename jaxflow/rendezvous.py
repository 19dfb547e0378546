"""Processes of one job starting together: a rendezvous before the first collective, one
resolved config, one coordinator per address.

:func:`rendezvous` is a coordination-service barrier (``wait_at_barrier``) that names the
processes that did not arrive when it expires; :func:`jaxflow.distributed.connect_collectives`
meets at one between compiling and running its first all-reduce, because gloo gives the
processes of a device group only 30 s to meet at their first collective (not configurable),
while one process may compile or start minutes after another on a loaded host.
:func:`check_same_config` compares every process's resolved config through the key-value store
before anything is compiled (processes that disagree would compile different programs and end in
a gloo abort). :func:`claim_coordinator_port` keeps a second process 0 from starting a second
coordination service on the same port (gRPC binds it with ``SO_REUSEPORT``, so both would start
and every process would wait for peers that registered with the other one).

All of it goes through JAX's live coordination-service client
(``jax._src.distributed.global_state.client``) once :func:`jaxflow.distributed.initialize` has
started the runtime; with one process every check returns at once.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import tempfile
import threading
from typing import Any, Mapping

import jax

from jaxflow.errors import UserError

#: Default seconds every process waits for the others at a start rendezvous.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0

_TIMEOUT_S = DEFAULT_RENDEZVOUS_TIMEOUT_S
_COUNTS: dict[str, int] = {}
_COUNTS_LOCK = threading.Lock()


class StartError(UserError, RuntimeError):
    """The processes of a job could not start together (a rendezvous expired, their configs
    differ, two processes claim one coordinator); the message is one line naming what and who."""


def set_timeout(seconds: float) -> None:
    """Sets the default wait of :func:`rendezvous` / :func:`check_same_config` (``--rendezvous-timeout``)."""
    global _TIMEOUT_S
    if not 0 < seconds < float("inf"):
        raise ValueError(f"--rendezvous-timeout {seconds}; valid: seconds > 0")
    _TIMEOUT_S = float(seconds)


def _client():
    from jax._src import distributed as _jd  # the live coordination-service client

    return _jd.global_state.client


_COORDINATOR_LOCK: int | None = None  # the fd of process 0's lock file, held while it lives


def claim_coordinator_port(port: int, coordinator: str = "") -> None:
    """Process 0: refuses to start a second coordination service on ``port`` of this host.

    gRPC binds its listener with ``SO_REUSEPORT``, so a second process 0 (two
    ``--process-id=0``) starts a second service on the same port and every process waits for
    peers that registered with the other one until the rendezvous expires. Here process 0
    takes an exclusive lock on a file named after the port (held while it lives, so two
    process 0s started at the same instant are told apart too) and checks that nothing listens
    on the port yet.

    Raises:
      StartError: the lock is held or the port is in use, naming the port.
    """
    global _COORDINATOR_LOCK
    where = f"--coordinator {coordinator or port}"
    path = os.path.join(tempfile.gettempdir(), f"jaxflow-coordinator-{port}.lock")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    except OSError:
        fd = None  # an unwritable temp dir: the port check below still runs
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StartError(f"{where}: another process 0 already coordinates a job on port {port} "
                             "of this host; each process of a job needs its own --process-id "
                             "(0..N-1) and each job its own port") from None
        if _COORDINATOR_LOCK is not None:
            os.close(_COORDINATOR_LOCK)
        _COORDINATOR_LOCK = fd
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
            try:
                probe.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    if fd is not None:  # not ours after all
                        os.close(fd)
                        _COORDINATOR_LOCK = None
                    raise StartError(f"{where}: port {port} is already in use on this host (another "
                                     "process started with --process-id=0, or another program); "
                                     "valid: a free port") from None
                continue
            return


def rendezvous(name: str, *, timeout_s: float | None = None) -> None:
    """Every process of the job meets at a coordination-service barrier (one process: returns).

    The n-th call with ``name`` on each process meets the others' n-th call. Waits
    ``timeout_s`` (default: the ``--rendezvous-timeout`` given to :func:`jaxflow.distributed.initialize`).

    Raises:
      StartError: the barrier expired, naming the processes that had not arrived.
    """
    if jax.process_count() == 1:
        return
    timeout = _TIMEOUT_S if timeout_s is None else float(timeout_s)
    with _COUNTS_LOCK:
        n = _COUNTS[f"rendezvous/{name}"] = _COUNTS.get(f"rendezvous/{name}", -1) + 1
    barrier, client, me = f"jaxflow/rendezvous/{name}/{n}", _client(), jax.process_index()
    client.key_value_set(f"{barrier}/arrived/{me}", "1", allow_overwrite=True)
    try:
        client.wait_at_barrier(barrier, max(1, int(timeout * 1000)))
    except Exception as e:  # noqa: BLE001 - jax's runtime error: DEADLINE_EXCEEDED (or a lost service)
        try:
            arrived = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{barrier}/arrived/")}
        except Exception:  # noqa: BLE001 - the service is gone: the watchdog / supervisor say so
            raise e from None
        missing = sorted(set(range(jax.process_count())) - arrived)
        who = (f"process(es) {', '.join(map(str, missing))} did not arrive" if missing else
               "this process arrived after the others had given up")
        raise StartError(f"process {me}: the start rendezvous {name!r} expired: {who} within "
                         f"--rendezvous-timeout {timeout:g} s (a process still starting or compiling "
                         "on a loaded host: raise --rendezvous-timeout; or it failed: see its log)") from None


def check_same_config(config: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
    """Every process compares its resolved config with every other process's (one process: returns).

    Each process publishes ``config`` (flat ``{"a.b": value}``, JSON-able values) and its
    SHA-256 in the coordination service's key-value store, reads every other process's hash
    (waiting up to ``timeout_s``, default ``--rendezvous-timeout``) and, for a hash that
    differs, that process's config, to name the keys. Processes that disagree would compile
    different programs and end in a gloo abort at the first collective.

    Raises:
      StartError: on every process, naming the differing keys and each process's values.
    """
    if jax.process_count() == 1:
        return
    timeout = _TIMEOUT_S if timeout_s is None else float(timeout_s)
    client, me = _client(), jax.process_index()
    mine = {k: json.dumps(v, sort_keys=True, default=str) for k, v in config.items()}
    text = json.dumps(mine, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    client.key_value_set(f"jaxflow/config/{me}", text, allow_overwrite=True)
    client.key_value_set(f"jaxflow/config_hash/{me}", digest, allow_overwrite=True)
    diffs = []
    for peer in range(jax.process_count()):
        if peer == me:
            continue
        try:
            if client.blocking_key_value_get(f"jaxflow/config_hash/{peer}",
                                             max(1, int(timeout * 1000))) == digest:
                continue
            theirs = json.loads(client.blocking_key_value_get(f"jaxflow/config/{peer}", 60_000))
        except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED
            raise StartError(f"process {me}: process {peer} did not publish its config within "
                             f"--rendezvous-timeout {timeout:g} s (still starting on a loaded host: "
                             "raise --rendezvous-timeout; or it failed: see its log)") from None
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                diffs.append(f"{key} (process {me}: {mine.get(key, '<absent>')}, "
                             f"process {peer}: {theirs.get(key, '<absent>')})")
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise StartError(f"process {me}: the processes resolved different configs: {shown}; every "
                         "process of a job needs the same --exp, --variant and --set values")
