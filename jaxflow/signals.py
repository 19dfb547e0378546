"""SIGINT / SIGTERM during a run: finish the step, checkpoint, stop with a resume command.

The runner installs :func:`install` for the length of a run. Inside a training loop that polls
(``jaxflow.train.loop.run_steps`` runs its steps in :func:`polling`; a hand-written loop calls
``Checkpointer.stop_if_requested`` after each step) a signal only sets a flag: the loop
finishes its step, saves a checkpoint and raises :class:`RunStopped`. Where nothing polls (an
experiment without a loop, or set-up between loops) the signal abandons the work at once by
raising :class:`RunStopped` with ``step=None`` (raised again where Python would drop it: in a
GC callback or a ``__del__``). A second signal during a step abandons it at
once too, but never a checkpoint being written: inside :func:`deferred` (every save and wait of
``jaxflow.checkpoint.Checkpointer``) signals only wait, and the stop comes when the save is
complete.

With several processes every one must stop at the same step (checkpoints are collective), so
SIGTERM is left to JAX's preemption service (the loop asks orbax ``reached_preemption``, a step
all processes agree on) and a polled SIGINT is turned into that same notice.

Before any of that, ``python -m jaxflow.run`` calls :func:`exit_before_start` first thing, so a
signal during its imports and set-up ends the process with one line and nothing written.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

_STATE: dict[str, Any] = {"requested": None, "polled": False, "multi_process": False,
                          "polling": 0, "deferring": 0, "deferred": False, "started": False}


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
    """The signal number asked to stop the run (the first one received), or None."""
    return _STATE["requested"]


def multi_process() -> bool:
    """True when the installed handlers defer to JAX's preemption service."""
    return _STATE["multi_process"]


def mark_polled() -> None:
    """Called by a loop that checks :func:`requested` after every step (so a signal can wait).

    Outside :func:`polling` this lasts until the handlers are restored (a hand-written loop);
    inside it, the scope decides."""
    if not _STATE["polling"]:
        _STATE["polled"] = True


def _waits() -> bool:
    return bool(_STATE["polled"] or _STATE["polling"])


@contextlib.contextmanager
def polling() -> Iterator[None]:
    """The block polls :func:`requested` after every step: a first signal waits for the poll.

    A signal that arrived after the block's last poll stops the run as the block ends (it is
    never dropped)."""
    _STATE["polling"] += 1
    try:
        yield
    finally:
        _STATE["polling"] -= 1
    if not _waits() and _STATE["requested"] is not None:
        raise RunStopped(_STATE["requested"])


def abandon_if_requested() -> None:
    """A safe point between two steps of work with nothing to checkpoint (run inside
    :func:`polling`): raises :class:`RunStopped` (``step=None``) when a stop was asked for."""
    if _STATE["requested"] is not None:
        raise RunStopped(_STATE["requested"])


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Signals wait until the block ends (a checkpoint being written or committed).

    Where nothing will poll afterwards, a signal that waited stops the run as the block ends."""
    _STATE["deferring"] += 1
    try:
        yield
    finally:
        _STATE["deferring"] -= 1
    if not _STATE["deferring"] and _STATE["deferred"]:
        _STATE["deferred"] = False
        if not _waits():
            raise RunStopped(_STATE["requested"])


def _handler(signum, frame):
    first = _STATE["requested"] is None
    if first:
        _STATE["requested"] = signum
        if _STATE["multi_process"] and _waits():  # JAX's SIGTERM handler syncs a stop step
            os.kill(os.getpid(), signal.SIGTERM)
    if _STATE["deferring"]:
        _STATE["deferred"] = True  # the save finishes; then the stop (or the poll) comes
        return
    if first and _waits():
        return  # the loop finishes its step, checkpoints and raises RunStopped
    if _swallowing(frame):
        _raise_again(signum)
        return
    raise RunStopped(_STATE["requested"])


def _swallowing(frame) -> bool:
    """Whether an exception raised at ``frame`` would be printed and dropped by Python (a GC
    callback such as JAX's ``_xla_gc_callback``, a ``__del__``): a stop raised there is lost."""
    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code in codes or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _raise_again(signum: int) -> None:
    """The abandon, raised again shortly (by the same signal) where it can propagate."""
    timer = threading.Timer(0.01, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def _unraisable(hook):
    def unraisable(info):
        if isinstance(info.exc_value, RunStopped):  # dropped where it was raised: again
            _raise_again(info.exc_value.signum)
            return
        hook(info)
    return unraisable


def outcome(stop: RunStopped, resume: str, out_dir: Any, *, finished: bool,
            has_checkpoint: bool) -> str:
    """What a stop left in ``out_dir``, for the runner's one line: the checkpoint and the
    ``resume`` command, or why there is none (``finished``: the run had written its summary;
    ``has_checkpoint``: an earlier checkpoint exists)."""
    if stop.step is not None:
        return f"checkpoint at step {stop.step} saved; resume: {resume}"
    if finished:
        return f"the run had finished (summary.json written in {out_dir}); nothing to resume"
    if has_checkpoint:
        return f"the step in flight was abandoned; resume from the last checkpoint: {resume}"
    return (f"abandoned, no checkpoint to resume from (partial output stays in {out_dir}); "
            "run it again with another --out")


def install(*, multi_process: bool = False) -> Callable[[], None]:
    """Installs the stop handlers (main thread only); returns a function restoring the old ones.

    ``multi_process``: SIGINT only (SIGTERM stays with JAX's preemption service)."""
    signals = (signal.SIGINT,) if multi_process else (signal.SIGINT, signal.SIGTERM)
    _STATE.update(requested=None, polled=False, multi_process=multi_process, deferred=False,
                  started=True)
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.signal(s, _handler) for s in signals}
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)

    def restore():
        for s, h in previous.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
        _STATE.update(requested=None, polled=False, multi_process=False, deferred=False)

    return restore


def exit_now(code: int) -> None:
    """Ends the process with ``code`` without the interpreter's teardown: flushes stdio, waits
    for checkpoint saves still being committed, leaves the multi-controller runtime, then
    ``os._exit``. For the runner after a stop: XLA work the stop abandoned (a compilation on
    XLA's thread pool, say) may still be running, and the teardown would destroy the PjRt
    client under it (a SIGSEGV after the stop line)."""
    with contextlib.suppress(Exception):
        if "jaxflow.checkpoint" in sys.modules:
            sys.modules["jaxflow.checkpoint"].wait_for_saves()
        if "jax" in sys.modules:
            from jax._src import distributed

            if distributed.global_state.client is not None:
                distributed.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_before_start(prog: str) -> None:
    """For the runner's ``__main__``, before its heavy imports: until :func:`install` takes over,
    SIGINT / SIGTERM end the process at once with one line on stderr and exit 128 + signal
    (nothing has been written yet; after a run, the same exit without the claim)."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        when = "while exiting" if _STATE["started"] else "before the run started; nothing was written"
        os.write(2, f"{prog}: stopped by {name} {when}\n".encode())
        os._exit(128 + signum)  # nothing to save or flush: no Python-level unwinding

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)
