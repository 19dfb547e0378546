"""Agent-centric state swapping: an idle agent's training state lives in host memory.

An agent's training state (params, optimizer state, step) is a pytree of device arrays on its
trainer mesh. :func:`swap_out` copies it to host numpy arrays and deletes the device buffers
(freeing the accelerator for another agent); :func:`swap_in` puts it back with the same
shardings. Both are exact copies, so a run that swaps is bit-identical to one that does not.
:class:`AgentStateSwapper` keeps one state per agent, tracks where it lives and, with a
directory, also writes each swapped-out state durably with orbax
(:class:`jaxflow.checkpoint.Checkpointer`, one manager per agent, step = policy version).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxflow.checkpoint import Checkpointer, abstract_like
from jaxflow.distributed import put, to_host


def swap_out(state: Any) -> Any:
    """Device pytree -> host numpy pytree; the device buffers are deleted."""
    host = jax.tree.map(lambda x: np.array(to_host(x)), state)  # also a multi-process array
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()
    return host


def swap_in(host: Any, shardings: Any) -> Any:
    """Host pytree -> device pytree laid out by ``shardings`` (a matching pytree)."""
    return put(host, shardings)


class AgentStateSwapper:
    """Per-agent training states that are either on device or swapped out to host.

    Args:
      directory: when given, every :meth:`swap_out` also saves the state with orbax under
        ``directory/<agent>`` (synchronous, keep the last 2), restorable by :meth:`restore`.
    """

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self._host: dict[str, Any] = {}
        self._shardings: dict[str, Any] = {}
        self._abstract: dict[str, Any] = {}
        self._ckpt: dict[str, Checkpointer] = {}
        self._lock = threading.Lock()
        self.swap_seconds = 0.0
        self.swaps = 0

    def swap_out(self, agent: str, state: Any, *, version: int | None = None) -> None:
        """Move ``agent``'s state to host memory, keeping its shardings for ``swap_in``."""
        t0 = time.perf_counter()
        shardings = jax.tree.map(lambda x: x.sharding, state)
        abstract = abstract_like(state)
        host = swap_out(state)
        with self._lock:
            self._shardings[agent], self._abstract[agent] = shardings, abstract
            self._host[agent] = host
        if self.directory is not None and version is not None:
            self._checkpointer(agent).save(version, host, force=True)
            self._checkpointer(agent).wait()
        self._account(t0)

    def swap_in(self, agent: str) -> Any:
        """Put ``agent``'s swapped-out state back on its devices (same shardings) and return it."""
        t0 = time.perf_counter()
        with self._lock:
            if agent not in self._host:
                raise KeyError(f"agent {agent!r} is not swapped out; swapped: {list(self._host)}")
            host, shardings = self._host.pop(agent), self._shardings[agent]
        state = swap_in(host, shardings)
        jax.block_until_ready(state)
        self._account(t0)
        return state

    def is_swapped(self, agent: str) -> bool:
        """Whether ``agent``'s state is on the host."""
        with self._lock:
            return agent in self._host

    def restore(self, agent: str, version: int | None = None) -> Any:
        """The durable copy of ``agent``'s state (latest version by default), on device."""
        ckpt = self._checkpointer(agent)
        version = ckpt.latest_step() if version is None else version
        if version is None:
            raise FileNotFoundError(f"no checkpoint of agent {agent!r} under {self.directory}")
        return ckpt.restore(version, self._abstract[agent])

    def close(self) -> None:
        """Close the orbax checkpointers of the ``directory`` saves."""
        for c in self._ckpt.values():
            c.close()

    def _checkpointer(self, agent: str) -> Checkpointer:
        if self.directory is None:
            raise ValueError("AgentStateSwapper has no directory: no durable copies")
        if agent not in self._ckpt:
            self._ckpt[agent] = Checkpointer(os.path.join(self.directory, agent), max_to_keep=2,
                                             async_save=False)
        return self._ckpt[agent]

    def _account(self, t0: float) -> None:
        with self._lock:
            self.swap_seconds += time.perf_counter() - t0
            self.swaps += 1
