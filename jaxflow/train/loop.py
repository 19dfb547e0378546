"""One training loop: resume, checkpoint cadence, metrics rows, evaluation, signal stops, faults.

Every driver that trains hands :func:`run_steps` a step function and a state::

    result = run_steps(lambda state, step: train_step(state, batch_at(step)), state,
                       steps=cfg.steps, run=run, checkpointer=ckpt, log_every=10,
                       eval_fn=lambda state, done: {"heldout_accuracy": evaluate(state.params)},
                       eval_every=cfg.eval_every)

The loop owns what is the same everywhere:

- **resume**: with ``run.resume`` and a checkpoint in ``checkpointer``, the state is restored
  (laid out like the fresh one) and the metrics file is cut back to that step (without one,
  back to the loop's first step); a checkpoint beyond ``steps`` is refused before anything is
  restored (:class:`StepsBelowCheckpoint`), as is one whose directory was renamed
  (``Checkpointer.latest_step``);
- **rows**: the metrics of the steps since the last row are reduced by ``summarize`` every
  ``log_every`` steps (and at the last) and written with ``run.log``; an evaluation, every
  ``eval_every`` steps and at the last, joins the row of its step;
- **checkpoints**: ``checkpointer.save`` after every step (it keeps its own cadence), forced at
  the last step; the metrics of the steps since the last row go into the checkpoint too
  (``Checkpointer.attach_loop_state``), so a resumed run logs the same rows as one that never
  stopped;
- **signal stops**: the steps run in ``signals.polling`` and after every step
  ``checkpointer.stop_if_requested`` (SIGINT / SIGTERM during a step, its compilation
  included, save that step and raise ``signals.RunStopped``); when the loop is left any other
  way, the save in flight is waited for (never a half-written checkpoint);
- **faults**: ``fault.kill_after_checkpoint = N`` SIGKILLs the process right after the
  checkpoint of step N is committed (the resume tests' crash), a parameter of the run
  (``RunContext.fault``, the CLI's ``--kill-after-checkpoint``), never an environment variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import numpy as np

from jaxflow import signals
from jaxflow.errors import UserError

Metrics = Mapping[str, Any]
StepFn = Callable[[Any, int], "tuple[Any, Metrics]"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """A deliberate failure for resume tests.

    ``kill_after_checkpoint``: SIGKILL the process once the checkpoint of this step (the loop's
    global step, ``step_offset`` included) has been committed; None for no fault."""

    kill_after_checkpoint: int | None = None

    def __post_init__(self):
        k = self.kill_after_checkpoint
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"kill_after_checkpoint={k!r}: expected a step >= 1 or None")


class StepsBelowCheckpoint(UserError, ValueError):
    """A resumed run's step total is below the step of the checkpoint it would resume from."""


class LoopCheckpointer(Protocol):
    """What the loop needs of a checkpointer (``jaxflow.checkpoint.Checkpointer`` has it)."""

    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step, or None."""

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The state saved at ``step``, laid out like ``abstract_state``."""

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save ``state`` at ``step`` if due (always with ``force``); whether it saved."""

    def stop_if_requested(self, step: int, state: Any) -> None:
        """Checkpoint and stop the run if a signal asked for it."""

    def wait(self) -> None:
        """Block until pending asynchronous saves are committed."""

    def close(self) -> None:
        """Wait for pending saves and release the checkpointer."""


@dataclasses.dataclass
class LoopResult:
    """``state``: after the last step; ``start``: the step this process began at (the restored
    checkpoint's, else 0); ``rows``: the rows this process logged; ``last_metrics``: the final
    step's metrics (None when nothing was left to run)."""

    state: Any
    start: int
    rows: list[dict]
    last_metrics: Metrics | None


def mean_rows(window: Sequence[Metrics]) -> dict:
    """The default row: each metric's mean over the steps since the last row (host floats)."""
    rows = jax.device_get(list(window))
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def last_row(window: Sequence[Metrics]) -> dict:
    """A row that is the last step's metrics as they are (left on device: the loop then never
    waits for a step; ``jax.device_get`` the rows once at the end)."""
    return dict(window[-1])


def run_steps(step_fn: StepFn, state: Any, *, steps: int, run=None,
              checkpointer: LoopCheckpointer | None = None, log_every: int = 1,
              summarize: Callable[[Sequence[Metrics]], dict] = mean_rows,
              eval_fn: Callable[[Any, int], Mapping[str, Any]] | None = None,
              eval_every: int | None = None,
              hooks: Sequence[Callable[[int, Any, dict], None]] = (),
              step_offset: int = 0, row_fields: Mapping[str, Any] | None = None,
              restore: Callable[[LoopCheckpointer, int, Any], Any] | None = None,
              fault: Fault | None = None) -> LoopResult:
    """Runs ``state, metrics = step_fn(state, step)`` for ``step`` in ``[start, steps)``.

    Args:
      step_fn: ``(state, step) -> (state, metrics)``; ``step`` counts from 0 (the batch to
        build); metrics are any mapping (device scalars or host floats).
      state: the fresh state (also the layout a checkpoint is restored into).
      steps: the last step (exclusive).
      run: the ``RunContext`` (rows, resume, progress, its ``fault``); None runs silently.
      checkpointer: saves / restores / polls for stop signals; None for no checkpoints (signals
        then abandon the run at once, as the runner's handlers do where nothing polls).
      log_every: a row every this many steps and at the last.
      summarize: the row from the metrics since the last row (default :func:`mean_rows`).
      eval_fn: ``(state, done) -> metrics`` merged into the row of step ``done``.
      eval_every: evaluate every this many steps and at the last (default: at the last only).
      hooks: ``hook(done, state, row)`` after every row is written.
      step_offset: added to the step in ``run.log`` and ``fault`` (several loops in one metrics
        file, e.g. the cells of a sweep).
      row_fields: constant fields put first in every row (e.g. ``{"cell": label}``).
      restore: ``(checkpointer, step, state) -> state`` when not ``checkpointer.restore(step,
        abstract_like(state))``.
      fault: overrides ``run.fault``.

    Returns:
      a :class:`LoopResult`.
    """
    with signals.polling():
        return _run(step_fn, state, steps, run, checkpointer, log_every, summarize, eval_fn,
                    eval_every, hooks, step_offset, row_fields, restore, fault)


def _run(step_fn, state, steps, run, checkpointer, log_every, summarize, eval_fn, eval_every,
         hooks, step_offset, row_fields, restore, fault) -> LoopResult:
    from jaxflow.checkpoint import abstract_like

    if fault is None and run is not None:
        fault = getattr(run, "fault", None)
    kill_at = fault.kill_after_checkpoint if fault is not None else None
    start = 0
    window: list[Metrics] = []
    if checkpointer is not None and run is not None and run.resume:
        latest = checkpointer.latest_step()
        if latest is not None and latest > steps:
            raise StepsBelowCheckpoint(
                f"--resume with a total of {steps} steps, but the checkpoint in "
                f"{getattr(checkpointer, 'directory', 'the run')} is at step {latest} and a run "
                f"cannot go back; valid: a step total (train.steps, rollouts) >= {latest}")
        if latest is not None:
            state = (restore(checkpointer, latest, state) if restore is not None
                     else checkpointer.restore(latest, abstract_like(state)))
            start = int(latest)
            saved = checkpointer.loop_state(latest) if hasattr(checkpointer, "loop_state") else None
            window = decode_window(saved["window"]) if saved and saved.get("window") else []
            run.truncate_metrics_after(step_offset + start)
            run.info(f"resumed from checkpoint at step {start}")
        else:  # rows an attempt logged without leaving a checkpoint are logged again
            run.truncate_metrics_after(step_offset)
    if hasattr(checkpointer, "attach_loop_state"):
        checkpointer.attach_loop_state(lambda: {"window": encode_window(window)} if window else None)
    rows: list[dict] = []
    metrics: Metrics | None = None
    try:
        for step in range(start, steps):
            state, metrics = step_fn(state, step)
            window.append(metrics)
            done = step + 1
            last = done == steps
            evaluate = eval_fn is not None and (last or (eval_every and done % eval_every == 0))
            if done % log_every == 0 or last or evaluate:
                row = dict(row_fields or {})
                row.update(summarize(window))
                window = []
                if evaluate and eval_fn is not None:
                    row.update(eval_fn(state, done))
                if run is not None:
                    run.log(step_offset + done, row)
                rows.append(row)
                for hook in hooks:
                    hook(done, state, row)
            if checkpointer is not None:
                if checkpointer.save(done, state, force=last) and step_offset + done == kill_at:
                    checkpointer.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                checkpointer.stop_if_requested(done, state)
            elif (signum := signals.requested()) is not None:
                raise signals.RunStopped(signum)
    except BaseException:
        if checkpointer is not None:  # the save in flight completes: no half-written step
            with contextlib.suppress(Exception):
                checkpointer.close()
        raise
    finally:
        if hasattr(checkpointer, "attach_loop_state"):
            checkpointer.attach_loop_state(None)
    if checkpointer is not None:
        checkpointer.close()
    return LoopResult(state, start, rows, metrics)


def encode_window(window: Sequence[Metrics]) -> list | None:
    """The metrics since the last row as JSON (arrays and numpy scalars keep their dtype and
    shape, so :func:`decode_window` gives back values that summarize bit-identically); None
    when a value is not a number, string, array or a list / dict of them."""
    def enc(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, Mapping):
            return {"dict": [[str(k), enc(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            return {"list": [enc(x) for x in v]}
        if hasattr(v, "dtype") and hasattr(v, "shape"):
            a = np.asarray(jax.device_get(v))
            return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.ravel().tolist()}
        raise TypeError(type(v).__name__)

    try:
        return [enc(m) for m in window]
    except TypeError:
        return None  # then the window is not saved, and a resume starts a new one


def decode_window(saved: list) -> list:
    """The window :func:`encode_window` wrote (arrays as numpy arrays)."""
    def dec(v):
        if not isinstance(v, dict):
            return v
        if "dict" in v:
            return {k: dec(x) for k, x in v["dict"]}
        if "list" in v:
            return [dec(x) for x in v["list"]]
        return np.asarray(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])

    return [dec(m) for m in saved]
