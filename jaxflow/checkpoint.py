"""Checkpoints of whole train states via orbax ``CheckpointManager`` (async save, keep-last-N).

A train state is any pytree of arrays (params, optimizer state, step, RNG key). Restoring takes
an abstract target (``jax.eval_shape`` output with shardings) so arrays come back with the
shardings the caller wants, on any mesh. In multi-process runs every process calls save/restore
(orbax coordinates: the primary process writes metadata, each process its own shards).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves every ``save_every`` steps, keeps the last ``max_to_keep``.

    Example::

        ckpt = Checkpointer(run.checkpoint_dir, save_every=100)
        if (step := ckpt.latest_step()) is not None:
            state = ckpt.restore(step, abstract_state)
        ...
        ckpt.save(step, state)      # no-op unless step % save_every == 0 (or force=True)
        ckpt.close()                # waits for pending async saves
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        save_every: int = 1,
        max_to_keep: int = 3,
        async_save: bool = True,
    ):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=max(int(save_every), 1),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Starts saving ``state`` at ``step`` (async); returns whether a save was started."""
        return self._manager.save(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=force
        )

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The state saved at ``step``, laid out like ``abstract_state`` (shapes/shardings)."""
        restored = self._manager.restore(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )
        return restored["state"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) describing ``state``, for ``Checkpointer.restore``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state
    )


def params_checksum(params: Any) -> str:
    """sha256 over every parameter's bytes (in tree order): equal iff bit-identical."""
    import hashlib

    import numpy as np

    from jaxflow.distributed import to_host

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.ascontiguousarray(to_host(leaf)).tobytes())
    return h.hexdigest()
