"""JAX's multi-controller runtime: one process per host, one global device set.

``initialize`` wraps ``jax.distributed.initialize``: explicit coordinator/process flags (e.g.
two processes on 127.0.0.1 with gloo CPU collectives), or auto-detection of the cluster
environment JAX knows (TPU pods, SLURM, Open MPI) when ``auto=True``. Never a home-made cluster.

Flags are checked before JAX sees them (``parse_coordinator``: HOST:PORT, port in 1-65535, the
host resolved within a few seconds), so a typo is one line, not a stall or a crash in C++.

A lost peer: every process runs a :class:`PeerWatchdog` thread that bumps its own counter in
the coordination service's key-value store and watches the others'; a peer whose counter has
not moved for ``peer_timeout_s`` is reported by process id and this process exits with
``LOST_PEER_EXIT`` (JAX's own heartbeat timeout is set past it, so its C++ abort never comes
first). The coordinator's own death is reported by JAX itself: the client aborts at once, from
C++; ``jaxflow.supervise`` turns that abort into one line.

Starting together: ``jax.distributed.initialize`` waits ``--rendezvous-timeout`` for every
process to register, but gloo (the CPU collectives) gives the processes of a device group only
30 s to meet when a program first reduces over it, and that cannot be configured. So every
cross-process collective is first connected by :func:`connect_collectives`, which compiles its
tiny program, then meets the other processes at a coordination-service barrier
(:func:`rendezvous`, the same timeout) and only then runs it: a process that compiles or starts
late is waited for, and one that never comes is named in one line. :func:`check_same_config`
compares every process's resolved config through the key-value store before anything is
compiled. Two coordinators for one address (two ``--process-id=0``) are refused at once
(:func:`initialize`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import jax

from jaxflow import rendezvous as _rendezvous
from jaxflow.rendezvous import (  # noqa: F401 (re-exported: the start checks live there)
    DEFAULT_RENDEZVOUS_TIMEOUT_S,
    StartError,
    check_same_config,
    rendezvous,
)

#: Exit status of a process that lost a peer.
LOST_PEER_EXIT = 75
#: Default seconds without a sign of life before a peer counts as lost.
DEFAULT_PEER_TIMEOUT_S = 60.0


def set_cpu_device_count(n: int) -> None:
    """Gives ``n`` fake CPU devices (per process); call before JAX initialises its backends."""
    if n < 1:
        raise ValueError(f"--devices {n}: need at least 1")
    jax.config.update("jax_num_cpu_devices", int(n))


def parse_coordinator(text: str, *, resolve_timeout_s: float = 5.0) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port), the host resolved within ``resolve_timeout_s``.

    Raises ValueError naming the bad part: no ``:``, a port outside 1-65535 or not a number, a
    host that does not resolve (or not in time). IPv6 hosts go in brackets: ``[::1]:1234``.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--coordinator {text!r}: expected HOST:PORT, e.g. 127.0.0.1:1234")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--coordinator {text!r}: port {port_text!r} is not a number; "
                         "valid: 1-65535") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"--coordinator {text!r}: port {port}; valid: 1-65535")
    result: dict = {}

    def lookup():
        try:
            result["addr"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:  # socket.gaierror and friends
            result["error"] = e

    worker = threading.Thread(target=lookup, daemon=True)  # getaddrinfo has no timeout of its own
    worker.start()
    worker.join(resolve_timeout_s)
    if worker.is_alive():
        raise ValueError(f"--coordinator {text!r}: host {host!r} did not resolve within "
                         f"{resolve_timeout_s:g} s")
    if "error" in result:
        raise ValueError(f"--coordinator {text!r}: unknown host {host!r} ({result['error']})")
    return host, port


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
) -> bool:
    """Starts the multi-controller runtime when asked; returns True if it was started.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes, process_id: this job's size and this process's index.
      auto: let JAX detect the cluster (TPU pod metadata, SLURM, Open MPI env vars).
      peer_timeout_s: a peer silent this long is reported and this process exits
        (``LOST_PEER_EXIT``); see :class:`PeerWatchdog`.
      rendezvous_timeout_s: how long to wait for every process to join, and at every later
        :func:`rendezvous` (e.g. before the first collective, :func:`connect_collectives`).

    Raises:
      ValueError: a bad flag (named, with the valid range), before JAX is touched.
      StartError: process 0 while another process 0 holds the coordinator's port on this host.
    """
    if coordinator is None and not auto:
        if num_processes is not None or process_id is not None:
            raise ValueError("--num-processes / --process-id need --coordinator HOST:PORT")
        return False
    if not peer_timeout_s > 0 or peer_timeout_s != peer_timeout_s:
        raise ValueError(f"--peer-timeout {peer_timeout_s}; valid: seconds > 0")
    if not 0 < rendezvous_timeout_s < float("inf"):
        raise ValueError(f"--rendezvous-timeout {rendezvous_timeout_s}; valid: seconds > 0")
    if coordinator is not None:
        if num_processes is None or process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        if num_processes < 1:
            raise ValueError(f"--num-processes {num_processes}; valid: >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id}; valid: 0..{num_processes - 1}")
        _, port = parse_coordinator(coordinator)
        if process_id == 0:
            _rendezvous.claim_coordinator_port(port, coordinator)
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        # Cross-process collectives on CPU (no-op where the default already is gloo).
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # noqa: BLE001 - option absent on builds without CPU collectives
            pass
    # JAX aborts (C++ trace) when its heartbeat times out: keep that past our own report.
    _rendezvous.set_timeout(rendezvous_timeout_s)
    timeouts = dict(heartbeat_timeout_seconds=int(peer_timeout_s * 2 + 30),
                    initialization_timeout=max(1, int(rendezvous_timeout_s)))
    if coordinator is not None:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id, **timeouts)
    else:
        jax.distributed.initialize(**timeouts)
    global _WATCHDOG
    if jax.process_count() > 1:
        _WATCHDOG = PeerWatchdog(peer_timeout_s)
        _WATCHDOG.start()
    return True


_WATCHDOG: "PeerWatchdog | None" = None


def await_lost_peer() -> None:
    """After a collective failed: gives the watchdog time to name a lost peer (it exits the
    process when it does); returns if every peer is still alive (the failure is something else)."""
    if _WATCHDOG is not None and _WATCHDOG.is_alive():
        _WATCHDOG.join(_WATCHDOG.timeout_s * 1.5 + 1.0)


class PeerWatchdog(threading.Thread):
    """Reports a lost peer by process id and exits this process (``LOST_PEER_EXIT``).

    Each process increments ``jaxflow/alive/<id>`` in the coordination service every
    ``timeout_s / 6`` seconds and reads every peer's; a counter unchanged for ``timeout_s`` (by
    this process's own clock, so clocks need not agree) means that process is gone or hung.
    """

    def __init__(self, timeout_s: float, *, exit_fn=os._exit, stream=None):
        super().__init__(name="jaxflow-peer-watchdog", daemon=True)
        from jax._src import distributed as _jd  # the live coordination-service client

        self.client = _jd.global_state.client
        self.timeout_s = float(timeout_s)
        self.me, self.n = jax.process_index(), jax.process_count()
        self._exit, self._stream = exit_fn, stream
        self.lost: int | None = None

    def run(self) -> None:
        period = max(self.timeout_s / 6, 0.05)
        seen: dict[int, tuple[str, float]] = {}
        beat, start = 0, time.monotonic()
        while True:
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"jaxflow/alive/{self.me}", str(beat), allow_overwrite=True)
                values = dict(self.client.key_value_dir_get("jaxflow/alive/"))
            except Exception:  # noqa: BLE001 - the service is going away (shutdown or abort)
                return
            for peer in range(self.n):
                if peer == self.me:
                    continue
                value = values.get(f"jaxflow/alive/{peer}")
                last = seen.get(peer)
                if last is None or value != last[0]:
                    seen[peer] = (value, now)
                elif now - last[1] >= self.timeout_s and now - start >= self.timeout_s:
                    self.lost = peer
                    self._report(peer, now - last[1])
                    return
            time.sleep(period)

    def _report(self, peer: int, silent_s: float) -> None:
        stream = self._stream or sys.stderr
        print(f"[jaxflow] process {self.me}: lost process {peer} (no sign of life for "
              f"{silent_s:.0f} s, --peer-timeout {self.timeout_s:g}); exiting", file=stream,
              flush=True)
        self._exit(LOST_PEER_EXIT)


def is_primary() -> bool:
    """True on process 0, the only one that writes run outputs."""
    return jax.process_index() == 0


def to_host(x) -> "numpy.ndarray":  # noqa: F821  (numpy is imported where it runs)
    """A global jax.Array as a numpy array on every process (all-gathers across processes)."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def global_batch(np_batch: dict, sharding) -> dict:
    """Places a host batch (identical on every process) as global arrays with ``sharding``.

    Args:
      np_batch: ``{name: np.ndarray}``, the same full global batch on every process.
      sharding: a ``NamedSharding`` for every array (leading axis usually over ``"data"``).
    Returns:
      ``{name: jax.Array}``; each process supplies only its own devices' slices.
    """
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in np_batch.items()
    }


_AGREE_COUNTS: dict[str, int] = {}
_AGREE_LOCK = threading.Lock()


def agree(name: str, value: float | int, *, timeout_s: float = 600.0) -> float | int:
    """Process 0's ``value`` on every process (one process: ``value`` itself).

    For decisions taken from a clock (which split or mode is fastest): each process measures
    its own, but all must then run the same programs. The n-th call with ``name`` on each
    process returns process 0's n-th value for ``name``, through the coordination service's
    key-value store (no device collective, so a thread may call it while others run programs).

    Raises:
      TypeError: ``value`` is neither an int nor a float.
    """
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"agree({name!r}, {value!r}): an int or a float")
    if jax.process_count() == 1:
        return value
    from jax._src import distributed as _jd  # the live coordination-service client

    with _AGREE_LOCK:
        n = _AGREE_COUNTS[name] = _AGREE_COUNTS.get(name, -1) + 1
    key, client = f"jaxflow/agree/{name}/{n}", _jd.global_state.client
    if jax.process_index() == 0:
        is_int = isinstance(value, (int, np.integer))
        client.key_value_set(key, f"i{int(value)}" if is_int else f"f{float(value)!r}")
        return value
    text = client.blocking_key_value_get(key, int(timeout_s * 1000))
    return int(text[1:]) if text[0] == "i" else float(text[1:])


def connect_collectives(mesh) -> None:
    """Sets up ``mesh``'s cross-process collectives now (multi-process CPU runs; else nothing).

    gloo connects the processes of a device group the first time a program reduces over it and
    gives them 30 s to meet; a process still compiling a large program (minutes on a loaded
    host) misses that and the run fails ("Gloo context initialization failed: Connect
    timeout"). Once connected, a collective waits as long as XLA's collective timeout. So every
    process compiles one tiny all-reduce over the whole mesh and over each of its axes (the
    groups data- and tensor-parallel programs reduce over), meets the others at a
    :func:`rendezvous` (``--rendezvous-timeout``, a late process is waited for) and runs it, in
    step. Every process must call it for the same meshes in the same order.

    Raises:
      StartError: a process did not reach the rendezvous in time (named).
    """
    if jax.process_count() == 1 or mesh.devices.flat[0].platform != "cpu":
        return
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = tuple(mesh.axis_names)
    spec = P(*names)
    groups = [names] + [(a,) for a in names if len(names) > 1 and mesh.shape[a] > 1]

    def body(x):
        return tuple(jax.lax.psum(x, g) for g in groups)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                               out_specs=tuple(spec for _ in groups), check_vma=False))
    x = jax.make_array_from_callback(mesh.devices.shape, NamedSharding(mesh, spec),
                                     lambda idx: np.ones(mesh.devices.shape, np.float32)[idx])
    compiled = fn.lower(x).compile()  # before the rendezvous: compile times differ per process
    rendezvous("connect_collectives")
    jax.block_until_ready(compiled(x))


def put(tree, shardings):
    """``jax.device_put`` of host data that holds the same value on every process, without
    JAX's cross-process equality check.

    ``jax.device_put`` of a numpy array onto a sharding that spans several processes first
    all-gathers it over every device to check that the processes agree: a collective, started
    by whichever thread places data, which interleaves with other threads' collectives in a
    different order on each process (gloo then fails with "Received data size doesn't match").
    Here each process puts its own devices' slices (``jax.make_array_from_callback``). Fully
    addressable shardings, and arrays already on the target's device set, go to
    ``jax.device_put``.

    Args:
      tree: a pytree of numpy arrays / scalars / jax Arrays.
      shardings: one ``jax.sharding.Sharding`` for every leaf, or a matching pytree of them.
    """
    import numpy as np

    def one(x, s):
        if s.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, s)
        x = np.asarray(x)
        x = x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
        return jax.make_array_from_callback(x.shape, s, lambda idx: np.asarray(x[idx]))

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)
