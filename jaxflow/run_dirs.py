"""The run directory of ``python -m jaxflow.run``: checks on a fresh ``--out``, what ``--resume``
reads from it, the default location, and the rollback of a fresh run that failed on a user error.
"""

from __future__ import annotations

import datetime
import json
import os
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
    from jaxflow.checkpoint import has_progress

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
