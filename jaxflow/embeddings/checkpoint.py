"""Checkpoint / resume of sharded embedding state and host-resident tables, in one orbax step.

Device state (sharded and replicated groups, their optimizer state, the step counter, and any
dense model state, e.g. a ``jaxflow.train.state.TrainState``) is saved as sharded arrays; each
host table is saved as host numpy arrays (table + optimizer state) in the same checkpoint, so a
step is committed atomically. Restore lays device arrays out with the caller's shardings and
writes the host tables back in place.

:class:`EmbeddingCheckpointer` is a :class:`jaxflow.checkpoint.Checkpointer` (so
``jaxflow.train.loop.run_steps`` drives it: cadence, forced last save, signal stops) whose
``save`` / ``restore`` also take the host tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxflow.checkpoint import Checkpointer, abstract_like
from jaxflow.embeddings.host import HostTable


def _host_tree(host_tables: dict[str, HostTable]) -> dict:
    tree = {}
    for name, table in host_tables.items():
        values, opt = table.to_numpy()  # fresh copies: safe under async save
        tree[name] = {"table": values, "opt": opt}
    return tree


class EmbeddingCheckpointer(Checkpointer):
    """``save(step, state, host_tables)`` / ``restore(step, state_like, host_tables)``.

    Without ``host_tables`` it checkpoints the device state alone (in the same layout:
    ``{"device": state, "host": {}}``), which is what ``run_steps`` and
    :meth:`Checkpointer.stop_if_requested` call.
    """

    def save(self, step: int, state: Any, host_tables: dict[str, HostTable] | None = None, *,
             force: bool = False) -> bool:
        """Starts saving ``state`` and the host tables at ``step``; whether a save started."""
        if not force and not self._manager.should_save(int(step)):
            return False  # skip copying host tables for a step that will not be saved
        return super().save(step, {"device": state, "host": _host_tree(host_tables or {})},
                            force=force)

    def restore(self, step: int, state_like: Any,
                host_tables: dict[str, HostTable] | None = None) -> Any:
        """Device state laid out like ``state_like`` (arrays or ``jax.ShapeDtypeStruct``);
        ``host_tables`` overwritten in place."""
        host_tables = host_tables or {}
        abstract_host = {}  # numpy targets (np.zeros is lazily allocated) -> numpy restores
        for name, t in host_tables.items():
            one_row = t.read_rows(np.arange(1))[1]
            abstract_host[name] = {
                "table": np.zeros((t.spec.vocab_size, t.spec.dim), np.float32),
                "opt": {k: np.zeros((t.spec.vocab_size,) + v.shape[1:], v.dtype) for k, v in one_row.items()}}
        restored = super().restore(step, {"device": abstract_like(state_like), "host": abstract_host})
        for name, t in host_tables.items():
            t.load(np.asarray(restored["host"][name]["table"]),
                   {k: np.asarray(v) for k, v in restored["host"][name]["opt"].items()})
        return restored["device"]
