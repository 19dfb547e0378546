"""Checkpoints of whole train states via orbax ``CheckpointManager`` (async save, keep-last-N).

A train state is any pytree of arrays (params, optimizer state, step, RNG key). Restoring takes
an abstract target (``jax.eval_shape`` output with shardings) so arrays come back with the
shardings the caller wants, on any mesh. In multi-process runs every process calls save/restore
(orbax coordinates: the primary process writes metadata, each process its own shards).

A checkpoint that cannot be read back (truncated or deleted files) raises
:class:`CheckpointError` naming its directory, never a restart from step 0. Every save records
its step in orbax's step metadata (``custom_metadata={"step": N}``), and a resume trusts the
step directory's name only when it agrees (:func:`check_step_name`). A training loop
calls :meth:`Checkpointer.stop_if_requested` after each step: on SIGINT / SIGTERM (or a JAX
preemption notice in a multi-process run) it saves that step and raises ``RunStopped``.
"""

from __future__ import annotations

import json
import os
import pathlib
import weakref
from typing import Any, Callable

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


def recorded_step(step_dir: "str | os.PathLike") -> int | None:
    """The step the checkpoint in ``step_dir`` was saved at, from the custom metadata every
    :meth:`Checkpointer.save` writes (``{"step": N}`` in orbax's ``_CHECKPOINT_METADATA``);
    None for a checkpoint written without it."""
    # Read as the JSON file it is: the manager's metadata() logs a warning per item.
    try:
        meta = json.loads((run_path(step_dir) / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError):  # unreadable metadata: restore names the checkpoint
        return None
    custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
    recorded = custom.get("step") if isinstance(custom, dict) else None
    return int(recorded) if isinstance(recorded, int) and not isinstance(recorded, bool) else None


def check_step_name(step_dir: "str | os.PathLike") -> None:
    """CheckpointError when the name of checkpoint directory ``step_dir`` is not the step it
    recorded (a renamed directory would resume from the wrong step)."""
    path = run_path(step_dir)
    recorded = recorded_step(path)
    if recorded is not None and str(recorded) != path.name:
        raise CheckpointError(
            f"checkpoint directory {path} holds step {recorded} (its own metadata), not "
            f"{path.name}: it was renamed; rename it back to {recorded} to resume from it")


_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def wait_for_saves() -> None:
    """Waits until every open :class:`Checkpointer`'s pending save is committed."""
    for ckpt in list(_OPEN):
        ckpt.wait()


def has_progress(out: "str | os.PathLike") -> bool:
    """Whether run directory ``out`` holds something to resume from: a complete checkpoint
    under ``out/checkpoints`` or an experiment's own progress record (a ``*.jsonl`` other than
    metrics.jsonl, e.g. finished study cells)."""
    path = run_path(out)
    if finalized_steps(path / "checkpoints"):
        return True
    return any(p.name.endswith(".jsonl") and p.name != "metrics.jsonl" for p in path.iterdir())


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
        self._loop_state: Callable[[], Any] | None = None
        _OPEN.add(self)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None; checked against the step the
        checkpoint records of itself (:func:`check_step_name`).

        Raises:
          CheckpointError: the directory's name is not the step it holds (a renamed directory).
        """
        step = self._manager.latest_step()
        if step is not None:
            check_step_name(self.directory / str(int(step)))
        return step

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def attach_loop_state(self, get: Callable[[], Any] | None) -> None:
        """``get()``: a JSON-able object saved beside the state in every later save (the
        training loop's metric window, read back by :meth:`loop_state`); None: nothing."""
        self._loop_state = get

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Starts saving ``state`` at ``step`` (async); returns whether a save was started.

        Signals wait while it runs (``signals.deferred``): a stop never interrupts a save."""
        if self._last_saved == int(step):
            return False
        with signals.deferred():
            items = {"state": ocp.args.StandardSave(state)}
            if self._loop_state is not None and (force or self._manager.should_save(int(step))):
                if (loop := self._loop_state()) is not None:
                    items["loop"] = ocp.args.JsonSave(loop)
            saved = self._manager.save(int(step), args=ocp.args.Composite(**items), force=force,
                                       custom_metadata={"step": int(step)})
        if saved:
            self._last_saved = int(step)
        return saved

    def loop_state(self, step: int) -> Any | None:
        """What :meth:`attach_loop_state` saved at ``step``; None when that save had none."""
        try:
            return self._manager.restore(int(step), args=ocp.args.Composite(
                loop=ocp.args.JsonRestore()))["loop"]
        except KeyError:
            return None

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
        with signals.deferred():  # a second signal waits for the checkpoint to be complete
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
            if "not compatible with the stored shape" in reason:  # intact, but not this model's
                raise CheckpointError(
                    f"checkpoint {where} holds arrays of other shapes than this run's "
                    f"({reason.split('. Truncating')[0]}); "
                    "the config or the code changed since it was written: resume with those, or "
                    "start a new run in another --out") from None
            raise CheckpointError(
                f"checkpoint {where} is unreadable ({type(e).__name__}: {reason}); delete that "
                "directory to resume from an older checkpoint, or start fresh with another --out"
            ) from None
        return restored["state"]

    def wait(self) -> None:
        """Waits for the pending async save to be committed (signals wait meanwhile)."""
        with signals.deferred():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the pending save, then releases the manager (signals wait meanwhile)."""
        _OPEN.discard(self)
        with signals.deferred():
            self._manager.wait_until_finished()
            self._manager.close()


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) describing ``state``, for ``Checkpointer.restore``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state
    )

