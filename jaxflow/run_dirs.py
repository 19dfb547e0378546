"""The run directory of ``python -m jaxflow.run``: checks on a fresh ``--out``, what ``--resume``
reads from it, the default location, and the rollback of a fresh run that failed on a user error.
"""

from __future__ import annotations

import datetime
import errno
import gc
import json
import logging
import os
import sys
import threading
import time

from etils import epath

from jaxflow.errors import UserError
from jaxflow.experiment import is_local, run_path


class UsageError(UserError):
    """A user error in the flags: printed as one line, exit code 2."""


def fresh_hint(out) -> str:
    """What to do instead of resuming ``out``."""
    return f"start fresh with another --out (without --resume), or remove {str(out)!r}"


def read_saved_run(out: epath.Path) -> dict:
    """config.json of the run in ``out``, checked field by field (UsageError otherwise)."""
    saved = out / "config.json"
    if not saved.exists():
        raise UsageError(f"--resume: {saved} does not exist; is {str(out)!r} a jaxflow run directory?")
    try:
        meta = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        reason = " ".join(str(e).split())[:120]
        raise UsageError(f"--resume: {saved} is not readable JSON ({reason}); {fresh_hint(out)}") from None
    missing = [k for k in ("experiment", "variant", "overrides")
               if not isinstance(meta, dict) or k not in meta]
    if missing or not isinstance(meta.get("overrides"), list):
        raise UsageError(f"--resume: {saved} lacks {', '.join(missing) or 'a list of overrides'}; "
                         f"{fresh_hint(out)}")
    return meta


def resolve_run(args, out: epath.Path | None) -> tuple[str, str, list[str]]:
    """(experiment, variant, overrides); on --resume read from the run, which must match the
    flags given and hold something to resume from. Sets the flags left unset to the run's
    (``--devices``, ``--tensorboard``; a fresh run: TensorBoard on)."""
    if not args.resume:
        if not args.exp:
            raise UsageError("--exp NAME is required (or --list to see the experiments)")
        if args.tensorboard is None:
            args.tensorboard = True
        return args.exp, args.variant or "default", list(args.overrides)
    if out is None:
        raise UsageError("--resume needs --out DIR (the run directory to continue)")
    meta = read_saved_run(out)
    if args.exp and args.exp != meta["experiment"]:
        raise UsageError(f"--exp {args.exp!r} does not match the run in {str(out)!r} "
                         f"({meta['experiment']!r}); drop --exp to resume it, or {fresh_hint(out)}")
    if args.variant and args.variant != meta["variant"]:
        raise UsageError(f"--variant {args.variant!r} does not match the run in {str(out)!r} "
                         f"({meta['variant']!r}); drop --variant to resume it, or {fresh_hint(out)}")
    from jaxflow.checkpoint import check_step_name, finalized_steps, has_progress

    for step_dir in finalized_steps(out / "checkpoints"):
        check_step_name(step_dir)  # a renamed directory: refused before anything starts
    if not has_progress(out):
        raise UsageError(f"--resume: {out / 'checkpoints'} holds no complete checkpoint, so the run "
                         f"would restart at step 0; {fresh_hint(out)}")
    if args.devices is None:
        args.devices = meta.get("devices")
    if args.tensorboard is None:
        args.tensorboard = bool(meta.get("tensorboard", True))
    return meta["experiment"], meta["variant"], list(meta["overrides"]) + list(args.overrides)


def check_fresh_out(out: epath.Path) -> None:
    """--out for a new run: not a file, not a run already, and writable (before anything is
    written)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; valid: a directory (new or empty)")
    if (out / "config.json").exists():
        raise UsageError(f"--out {str(out)!r} already holds a run; add --resume to continue it "
                         "or pick another directory")
    if not is_local(out):
        return
    probe = os.path.abspath(os.fspath(out))
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"--out {str(out)!r}: {probe!r} is a file, so the directory cannot be "
                         "created; valid: a path under a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {str(out)!r}: cannot write under {probe!r} (permission denied); "
                         "valid: a writable location")



def roll_back(out_dir: epath.Path, existed: set[str] | None) -> None:
    """A fresh run that stopped on a user error leaves no trace: what it created goes."""
    if existed is None:
        if out_dir.exists():
            out_dir.rmtree()
        return
    for child in out_dir.iterdir():
        if child.name not in existed:
            child.rmtree() if child.is_dir() else child.unlink()


def out_dir_for(out: epath.Path | None, name: str, multi_process: bool) -> epath.Path:
    """``out``, else ``runs/NAME/<timestamp>`` (one timestamp for every process)."""
    if out is not None:
        return out
    stamp = int(time.time() * 1000)
    if multi_process:  # every process must agree on the directory
        import numpy as np
        from jax.experimental import multihost_utils

        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    when = datetime.datetime.fromtimestamp(stamp / 1000).strftime("%Y%m%d-%H%M%S")
    return run_path(os.path.join("runs", name, when))


#: Config fields a resumed run may change: how long it runs, how often it logs, evaluates and
#: checkpoints, and the device layout (a checkpoint restores onto any mesh). Matched on the
#: last part of a dotted key (``train.steps``) or, for ``mesh`` and ``devices``, the first.
RESUMABLE_FIELDS = frozenset({"steps", "rollouts", "log_every", "eval_every", "checkpoint_every",
                              "keep_checkpoints"})
RESUMABLE_SECTIONS = frozenset({"mesh", "devices"})


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out: dict = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def field_defaults(config) -> dict:
    """``{dotted key: JSON default}`` of every dataclass field in ``config`` (a tree of
    dataclasses and mappings) that declares a default: what a config field added after a run was
    saved means when the run left it out."""
    import dataclasses

    from jaxflow.experiment import to_jsonable

    out: dict = {}

    def walk(value, prefix: str) -> None:  # outer defaults first: a section's default wins
        if isinstance(value, dict):  # over its class's own field defaults
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                default = f.default
                if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                    default = f.default_factory()
                if default is not dataclasses.MISSING:
                    for key, item in _flatten(to_jsonable(default), f"{prefix}{f.name}.").items():
                        out.setdefault(key, item)
                walk(getattr(value, f.name), f"{prefix}{f.name}.")

    walk(config, "")
    return out


def config_changes(saved: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """``key: saved -> new`` for every dotted key whose value differs between two JSON configs
    (a key only in one: ``(absent)`` on the other side), resumable fields left out. A key absent
    from ``saved`` whose new value is its field's default (``defaults``, :func:`field_defaults`)
    is a field added to the code after the run was saved, at the value that keeps the old
    behaviour: not a change."""
    a, b = _flatten(saved), _flatten(new)
    defaults = defaults or {}
    changes = []
    for key in sorted(set(a) | set(b)):
        parts = key.split(".")
        if parts[-1] in RESUMABLE_FIELDS or parts[0] in RESUMABLE_SECTIONS:
            continue
        if key not in a and key in defaults and b.get(key) == defaults[key]:
            continue
        if a.get(key, "(absent)") != b.get(key, "(absent)"):
            changes.append(f"{key}: {a.get(key, '(absent)')} -> {b.get(key, '(absent)')}")
    return changes


def check_resumed_config(out: epath.Path, config) -> None:
    """Before anything is restored: the resolved ``config`` of a ``--resume`` must equal the one
    saved in ``out/config.json`` except in :data:`RESUMABLE_FIELDS` (a changed shape or setting
    would not fit the checkpoint, or would silently mean another experiment); UsageError naming
    the differing keys otherwise. A run directory saved without its resolved config is not
    compared."""
    from jaxflow.experiment import to_jsonable

    saved = read_saved_run(out).get("config")
    if not isinstance(saved, dict):
        return
    changes = config_changes(saved, json.loads(json.dumps(to_jsonable(config))),
                             json.loads(json.dumps(field_defaults(config))))
    if changes:
        shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
        raise UsageError(f"--resume: the config differs from the run's in {shown}; a run resumes "
                         "only with the config its checkpoints were written with (only steps, "
                         "rollouts, log/eval/checkpoint cadence and mesh may change): drop those "
                         "--set values, or start a new run with them in another --out")


def _is_disk_full(error: BaseException | None) -> OSError | bool:
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return error
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def disk_full_line(error: BaseException, out: epath.Path, resume_command: str) -> str | None:
    """The one line for a run that ran out of disk space (``error`` or an exception it came
    from is ENOSPC): the last committed checkpoint and the command to resume once there is
    space; None for any other error."""
    found = _is_disk_full(error)
    if found is False:
        return None
    name = getattr(found, "filename", None)
    what = f" writing {name}" if name else ""
    from jaxflow.checkpoint import finalized_steps

    try:
        committed = finalized_steps(out / "checkpoints")
        last = max(committed, key=lambda p: ((p / "_CHECKPOINT_METADATA").stat().mtime, int(p.name)),
                   default=None)
    except OSError:
        last = None
    if last is None:
        return (f"no space left on device{what}; no checkpoint of this run was committed, so there "
                f"is nothing to resume: free some space and start again with another --out")
    return (f"no space left on device{what}; the last committed checkpoint is {last} (intact): "
            f"free some space, then resume with: {resume_command}")


class HeldSaveErrors(logging.Filter):
    """Holds back what background writers report while a run is in flight: the error records
    orbax logs from its save threads (``absl``, each with a traceback), ``asyncio``'s "exception
    was never retrieved" for its abandoned writes, and exceptions that end a thread (TensorBoard's
    event writer) or that native callbacks report (``sys.excepthook``, ``sys.unraisablehook``).
    :meth:`release` reports them after all, unless :meth:`drop` was called because the runner
    reported their cause in one line (a full disk, a checkpoint of other shapes); then the
    unraisable exceptions of orbax's abandoned coroutines, finalized as late as the process's
    exit, stay discarded."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self.hooked: list[tuple] = []
        self._discard = False
        self._loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
        for logger in self._loggers:
            logger.addFilter(self)
        self._hooks = threading.excepthook, sys.excepthook, sys.unraisablehook
        threading.excepthook = lambda args: self._hold((self._hooks[0], args))
        sys.excepthook = lambda *exc: self._hold((self._hooks[1], *exc))
        sys.unraisablehook = self._unraisable

    def _hold(self, call: tuple) -> None:
        if not self._discard:
            self.hooked.append(call)

    def _unraisable(self, args) -> None:
        # (a tensorstore callback into orbax's closed event loop lands here) kept without the
        # object being finalized, which must not outlive the hook
        where = f"Exception ignored in: {args.object!r}" if args.object is not None else None
        self._hold((self._hooks[2], type(args)((args.exc_type, args.exc_value, args.exc_traceback,
                                                args.err_msg or where, None))))

    @staticmethod
    def _from_orbax(record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return False
        if "orbax" in record.pathname:
            return True
        text = record.getMessage()
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        return record.name == "asyncio" and "orbax" in text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._from_orbax(record):
            return True
        if not self._discard:
            self.held.append(record)
        return False

    def drop(self) -> None:
        """Forgets what is held (and discards what comes until :meth:`release`)."""
        self.held.clear()
        self.hooked.clear()
        self._discard = True

    def release(self) -> None:
        """Logs what is held (nothing after :meth:`drop`) and stops holding."""
        if self._discard:
            gc.collect()  # the abandoned writes' futures report now, into the filter, not at exit
        for logger in self._loggers:
            logger.removeFilter(self)
        threading.excepthook, sys.excepthook, sys.unraisablehook = self._hooks
        if self._discard:  # orbax's coroutines of the failed save may be finalized only at exit
            sys.unraisablehook = _without_orbax(self._hooks[2])
        held, self.held = self.held, []
        for record in held:
            logging.getLogger(record.name).handle(record)
        hooked, self.hooked = self.hooked, []
        for hook, *args in hooked:
            hook(*args)


def _without_orbax(hook):
    """``hook`` for every unraisable exception but those raised in orbax's code."""
    def unraisable(args) -> None:
        tb, frames = args.exc_traceback, []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if not any("orbax" in f for f in frames):
            hook(args)

    return unraisable


def one_line_failure(error: Exception, out: epath.Path, resume_command: str) -> UserError | None:
    """What the runner reports in one line for ``error``, raised while a run was in flight:
    the error itself when it is a UserError, a UsageError naming the last committed checkpoint
    for a full disk (:func:`disk_full_line`); None for anything else (a traceback)."""
    if isinstance(error, UserError):
        return error
    full = disk_full_line(error, out, resume_command)
    return None if full is None else UsageError(full)
