"""JAX's multi-controller runtime: one process per host, one global device set.

``initialize`` wraps ``jax.distributed.initialize``: explicit coordinator/process flags (e.g.
two processes on 127.0.0.1 with gloo CPU collectives), or auto-detection of the cluster
environment JAX knows (TPU pods, SLURM, Open MPI) when ``auto=True``. Never a home-made cluster.
"""

from __future__ import annotations

import os

import jax


def set_cpu_device_count(n: int) -> None:
    """Gives ``n`` fake CPU devices (per process); call before JAX initialises its backends."""
    if n < 1:
        raise ValueError(f"--devices {n}: need at least 1")
    jax.config.update("jax_num_cpu_devices", int(n))


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Starts the multi-controller runtime when asked; returns True if it was started.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes, process_id: this job's size and this process's index.
      auto: let JAX detect the cluster (TPU pod metadata, SLURM, Open MPI env vars).
    """
    if coordinator is None and not auto:
        return False
    if coordinator is not None and (num_processes is None or process_id is None):
        raise ValueError("--coordinator needs --num-processes and --process-id")
    if coordinator is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} must be in [0, {num_processes})")
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        # Cross-process collectives on CPU (no-op where the default already is gloo).
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # noqa: BLE001 - option absent on builds without CPU collectives
            pass
    if coordinator is not None:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    else:
        jax.distributed.initialize()
    return True


def is_primary() -> bool:
    """True on process 0, the only one that writes run outputs."""
    return jax.process_index() == 0


def to_host(x) -> "np.ndarray":
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
