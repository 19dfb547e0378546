"""Checkpoints of whole train states via orbax ``CheckpointManager`` (async save, keep-last-N).

A train state is any pytree of arrays (params, optimizer state, step, RNG key). Restoring takes
an abstract target (``jax.eval_shape`` output with shardings) so arrays come back with the
shardings the caller wants, on any mesh. In multi-process runs every process calls save/restore
(orbax coordinates: the primary process writes metadata, each process its own shards).

A checkpoint that cannot be read back (truncated or deleted files) raises
:class:`CheckpointError` naming its directory, never a restart from step 0. A training loop
calls :meth:`Checkpointer.stop_if_requested` after each step: on SIGINT / SIGTERM (or a JAX
preemption notice in a multi-process run) it saves that step and raises ``RunStopped``.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxflow import signals
from jaxflow.errors import UserError
from jaxflow.experiment import is_local, run_path


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing or unreadable; the message names it and how to go on."""


def finalized_steps(directory: "str | os.PathLike") -> list[epath.Path]:
    """Every complete orbax step directory under ``directory`` (recursively: per-cell
    sub-managers count), without opening a manager (so nothing is created or cleaned up)."""
    root = run_path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.isdigit() and (child / "_CHECKPOINT_METADATA").exists():
            found.append(child)
        elif child.is_dir() and not child.name.isdigit() and "orbax-checkpoint-tmp" not in child.name:
            found.extend(finalized_steps(child))
    return found


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
        path = run_path(directory)
        self.directory = path.absolute() if is_local(path) else path
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=max(int(save_every), 1),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._last_saved: int | None = None

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Starts saving ``state`` at ``step`` (async); returns whether a save was started."""
        if self._last_saved == int(step):
            return False
        saved = self._manager.save(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=force
        )
        if saved:
            self._last_saved = int(step)
        return saved

    def stop_if_requested(self, step: int, state: Any) -> None:
        """Call after each step. On a stop signal (or, with several processes, a preemption
        notice JAX synchronised across them): saves ``state`` at ``step``, waits for it and
        raises ``signals.RunStopped``; otherwise returns at once."""
        import signal as _signal

        signals.mark_polled()
        if jax.process_count() > 1:  # a step every process agrees on, or none
            if not self._manager.reached_preemption(int(step)):
                return
            signum: int = signals.requested() or _signal.SIGTERM
        else:
            requested = signals.requested()
            if requested is None:
                return
            signum = requested
        self.save(step, state, force=True)
        self.close()
        raise signals.RunStopped(signum, int(step))

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The state saved at ``step``, laid out like ``abstract_state`` (shapes/shardings).

        Raises:
          CheckpointError: the checkpoint's files are damaged or missing (named, with the way out).
        """
        try:
            restored = self._manager.restore(
                int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
            where = self.directory / str(int(step))
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            raise CheckpointError(
                f"checkpoint {where} is unreadable ({type(e).__name__}: {reason}); delete that "
                "directory to resume from an older checkpoint, or start fresh with another --out"
            ) from None
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

