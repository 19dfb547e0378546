"""The contract between the runner and an experiment's entry function.

An experiment is `configs/NAME.py` (``get_config(variant)`` -> frozen dataclass) plus an entry
function ``main(config, run: RunContext) -> dict`` named by the config module's ``ENTRY``.
The entry function does the work and returns its summary keys; the runner adds the common
keys of experiments/CONVENTIONS.md, writes ``summary.json`` and plots ``metrics.jsonl``.
Metric rows go through ``jaxflow.metric_writers`` (``metrics.jsonl``, TensorBoard event files
under ``tensorboard/``, optionally W&B).

Only process 0 (``run.is_primary``) writes to the run directory; ``RunContext`` methods are
no-ops elsewhere, so entry functions call them unconditionally.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
import urllib.parse
from typing import Any, Callable, Mapping

import numpy as np
from etils import epath

from jaxflow.errors import MissingExtraError  # noqa: F401 (re-exported)


def run_path(location: "str | os.PathLike") -> epath.Path:
    """A run directory as an ``etils.epath.Path``: a local path, a ``file://`` URI (made local),
    or a remote URI epath knows (``gs://bucket/dir``, ``s3://...``; those need their fsspec
    package, e.g. gcsfs). Local paths behave exactly as ``pathlib.Path`` ones."""
    if isinstance(location, epath.Path):
        return location
    text = os.fspath(location)
    if text.startswith("file://"):
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{text!r}: a file:// URI names a local path (file:///abs/dir); "
                             f"host {parsed.netloc!r} is not supported")
        text = urllib.parse.unquote(parsed.path)
    return epath.Path(text)


def is_local(path: epath.Path) -> bool:
    """True when ``path`` is on the local filesystem (no URI scheme)."""
    return "://" not in str(path)


def to_jsonable(value: Any) -> Any:
    """Converts numpy/jax scalars and arrays, dataclasses, tuples and paths to JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (pathlib.PurePath, epath.Path)):
        return str(value)
    if isinstance(value, (bool, str, type(None))):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else str(v)
    if hasattr(value, "shape") and hasattr(value, "tolist"):  # numpy / jax arrays
        return to_jsonable(np.asarray(value).tolist())
    return str(value)


class _Progress:
    """A tqdm bar on a TTY, periodic plain log lines otherwise."""

    def __init__(self, enabled: bool, log_every_s: float = 10.0):
        self._enabled = enabled
        self._tty = enabled and sys.stdout.isatty()
        self._bar = None
        self._total: int | None = None
        self._last_line = 0.0
        self._log_every_s = log_every_s
        self._start = time.time()

    def set_total(self, total: int, desc: str = "") -> None:
        self.close()
        self._total = int(total)
        self._start = time.time()
        self._last_line = 0.0
        if self._tty:
            from tqdm import tqdm

            self._bar = tqdm(total=self._total, desc=desc, dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self._enabled:
            return
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        text = " ".join(f"{k}={v:.4g}" for k, v in list(shown.items())[:6])
        if self._bar is not None:
            self._bar.n = min(step, self._total or step)
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh()
            return
        now = time.time()
        done = self._total is not None and step >= self._total
        if now - self._last_line >= self._log_every_s or done or self._last_line == 0.0:
            self._last_line = now
            if self._total:
                elapsed = now - self._start
                eta = elapsed / max(step, 1) * (self._total - step)
                head = f"step {step}/{self._total} eta {eta:.0f}s"
            else:
                head = f"step {step}"
            print(f"[jaxflow] {head} {text}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclasses.dataclass
class RunContext:
    """What an experiment's entry function gets besides its config.

    Attributes:
      name, variant: the experiment and variant being run.
      out_dir: the run directory, an ``etils.epath.Path`` (a local path or a URI such as
        ``gs://bucket/run``); exists on every process; only process 0 writes to it.
      is_primary: True on process 0.
      resume: True when the user asked to continue the run in ``out_dir``.
      seed: the run's base seed (the config's ``seed`` field if present, else 0).
      fault: a deliberate failure for resume tests (``jaxflow.train.loop.Fault``, from the
        CLI's ``--kill-after-checkpoint``), read by ``jaxflow.train.loop.run_steps``; None.
      tensorboard: rows also go to TensorBoard event files under ``out_dir/tensorboard``
        (the CLI's ``--tensorboard`` / ``--no-tensorboard``; on by default).
      wandb_project: rows also go to this Weights & Biases project (``--wandb=PROJECT``).
      config: the run's config (W&B records it, as JSON); None.
    """

    name: str
    variant: str
    out_dir: epath.Path
    is_primary: bool = True
    resume: bool = False
    seed: int = 0
    fault: Any = None
    tensorboard: bool = True
    wandb_project: str | None = None
    config: Any = None
    _progress: _Progress | None = None
    _writer: Any = None
    _pending: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.out_dir = run_path(self.out_dir)
        if self._progress is None:
            self._progress = _Progress(enabled=self.is_primary)

    @property
    def checkpoint_dir(self) -> epath.Path:
        """Where checkpoints go (``out_dir/checkpoints``); shared by all processes."""
        return self.out_dir / "checkpoints"

    def set_total_steps(self, total: int, desc: str = "") -> None:
        """Starts the progress display for ``total`` steps."""
        self._progress.set_total(total, desc or self.name)

    @property
    def metric_writer(self):
        """The run's ``jaxflow.metric_writers.MultiWriter`` (process 0; built at first use)."""
        if self._writer is None:
            from jaxflow.metric_writers import run_writers

            self._writer = run_writers(self.out_dir, name=f"{self.name}-{self.variant}",
                                       tensorboard=self.tensorboard,
                                       wandb_project=self.wandb_project,
                                       config=None if self.config is None else to_jsonable(self.config))
        return self._writer

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes the row ``{"step": step, **metrics}`` (JSON types) to the metric writers
        (metrics.jsonl, TensorBoard, W&B) and updates the progress."""
        row = {"step": int(step), **{k: to_jsonable(v) for k, v in metrics.items()}}
        self._progress.update(int(step), row)
        if not self.is_primary:
            return
        self.flush_pending()
        self.metric_writer.write(int(step), row)

    def truncate_metrics_after(self, step: int) -> None:
        """On resume: forgets metrics rows logged after ``step`` (they will be logged again):
        dropped from metrics.jsonl, marked as restarted in the TensorBoard events."""
        if not self.is_primary:
            return
        self.metric_writer.rewind(int(step))

    def write_json(self, filename: str, obj: Any) -> None:
        """Writes ``obj`` as JSON to ``out_dir/filename`` (process 0 only)."""
        if not self.is_primary:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / filename).write_text(json.dumps(to_jsonable(obj), indent=2), encoding="utf-8")

    def save_figure(self, fig, filename: str) -> None:
        """Saves a matplotlib figure as ``out_dir/plots/filename`` (process 0 only) and
        closes it."""
        import matplotlib.pyplot as plt

        if self.is_primary:
            out = self.out_dir / "plots"
            out.mkdir(parents=True, exist_ok=True)
            fig.savefig(out / filename)
        plt.close(fig)

    def write_json_later(self, filename: str, obj: Any) -> None:
        """Writes ``obj`` at the first metrics row (or :meth:`flush_pending`): a resumed run
        touches nothing before it has really restarted."""
        self._pending[filename] = obj

    def flush_pending(self) -> None:
        while self._pending:
            filename, obj = self._pending.popitem()
            self.write_json(filename, obj)

    def info(self, message: str) -> None:
        """Prints a log line on process 0."""
        if self.is_primary:
            print(f"[jaxflow] {message}", flush=True)

    def close(self) -> None:
        self._progress.close()
        if self._writer is not None:
            self._writer.close()


EntryFn = Callable[[Any, RunContext], Mapping[str, Any]]


def standalone_context(name: str, variant: str = "quick", out_dir: str | None = None) -> RunContext:
    """A RunContext for notebooks and tests (a temporary directory unless ``out_dir`` is given)."""
    import tempfile

    path = run_path(out_dir) if out_dir else run_path(tempfile.mkdtemp(prefix=f"{name}-"))
    return RunContext(name=name, variant=variant, out_dir=path)
