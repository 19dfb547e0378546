"""SIGINT / SIGTERM during a run: finish the step, checkpoint, stop with a resume command.

The runner installs :func:`install` for the length of a run. A signal only sets a flag while a
training loop polls it (``Checkpointer.stop_if_requested`` after each step): the loop finishes
its step, saves a checkpoint and raises :class:`RunStopped`. Where nothing polls (an experiment
without checkpoints, or start-up before the first step), the signal abandons the work at once
by raising :class:`RunStopped` with ``step=None``. A second signal always abandons at once.

With several processes every one must stop at the same step (checkpoints are collective), so
SIGTERM is left to JAX's preemption service (the loop asks orbax ``reached_preemption``, a step
all processes agree on) and a polled SIGINT is turned into that same notice.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

_STATE: dict[str, Any] = {"requested": None, "polled": False, "multi_process": False}


class RunStopped(BaseException):
    """The run stopped on a signal. ``step``: the checkpointed step, None when abandoned.

    A BaseException (like KeyboardInterrupt), so ``except Exception`` in library code does not
    swallow it."""

    def __init__(self, signum: int, step: int | None = None):
        self.signum, self.step = int(signum), step
        name = signal.Signals(self.signum).name
        super().__init__(f"stopped by {name}" + (f" at step {step}" if step is not None else ""))

    @property
    def exit_code(self) -> int:
        """128 + signal number: 130 for SIGINT, 143 for SIGTERM (the shell convention)."""
        return 128 + self.signum


def requested() -> int | None:
    """The signal number asked to stop the run, or None."""
    return _STATE["requested"]


def multi_process() -> bool:
    """True when the installed handlers defer to JAX's preemption service."""
    return _STATE["multi_process"]


def mark_polled() -> None:
    """Called by a loop that checks :func:`requested` after every step (so a signal can wait)."""
    _STATE["polled"] = True


def _handler(signum, frame):
    first = _STATE["requested"] is None
    _STATE["requested"] = signum
    if first and _STATE["polled"]:
        if _STATE["multi_process"]:  # JAX's SIGTERM handler syncs a stop step across processes
            os.kill(os.getpid(), signal.SIGTERM)
        return  # the loop finishes its step, checkpoints and raises RunStopped
    raise RunStopped(signum)


def install(*, multi_process: bool = False) -> Callable[[], None]:
    """Installs the stop handlers (main thread only); returns a function restoring the old ones.

    ``multi_process``: SIGINT only (SIGTERM stays with JAX's preemption service)."""
    signals = (signal.SIGINT,) if multi_process else (signal.SIGINT, signal.SIGTERM)
    _STATE.update(requested=None, polled=False, multi_process=multi_process)
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.signal(s, _handler) for s in signals}

    def restore():
        for s, h in previous.items():
            signal.signal(s, h)
        _STATE.update(requested=None, polled=False, multi_process=False)

    return restore
