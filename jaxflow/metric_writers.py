"""Where a run's metric rows go: one interface, a writer per sink.

``RunContext.log`` builds one row per logged step (``{"step": step, **metrics}``, values already
JSON types: numbers, strings, lists; a non-finite float is the string ``"nan"`` / ``"inf"`` /
``"-inf"``) and hands it to a :class:`MultiWriter` of

- :class:`JsonlWriter`: ``<run_dir>/metrics.jsonl``, one JSON line per row (always on; plots,
  summaries and resumes read it);
- :class:`TensorBoardWriter`: TensorBoard event files under ``<run_dir>/tensorboard/``, one
  scalar per numeric field (on by default; the runner's ``--no-tensorboard`` turns it off);
- :class:`WandbWriter`: a Weights & Biases run, its files under ``<run_dir>/wandb/``
  (``--wandb=PROJECT``; needs ``pip install wandb``).

Only process 0 writes (``RunContext.is_primary``); the other processes build no writer.

A resumed run rewinds every writer to the step it restarts from (:meth:`MetricWriter.rewind`):
the JSONL drops the later rows, the event file gets a TensorBoard restart marker (its readers
drop the later events of the earlier attempt), W&B keeps its history (it cannot rewrite it).
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Mapping, Protocol, Sequence

from etils import epath

from jaxflow.errors import FileFormatError, MissingExtraError

Row = Mapping[str, Any]

#: How ``jaxflow.experiment.to_jsonable`` writes non-finite floats; read back as floats here.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricWriter(Protocol):
    """A sink for metric rows."""

    def write(self, step: int, row: Row) -> None:
        """Records ``row`` (JSON types; it includes ``"step": step``) at ``step``."""

    def rewind(self, step: int) -> None:
        """Rows after ``step`` will be written again (a resume): forget the earlier ones."""

    def flush(self) -> None:
        """Makes what was written visible to readers."""

    def close(self) -> None:
        """Flushes and releases the sink; a later :meth:`write` opens it again."""


def scalars(row: Row) -> dict[str, float]:
    """The numeric fields of ``row`` as floats (``bool`` and ``step`` excluded; ``"nan"`` /
    ``"inf"`` / ``"-inf"`` strings, as ``to_jsonable`` writes them, back to floats); strings,
    lists and mappings are left out."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, str) and value in _NON_FINITE:
            out[key] = _NON_FINITE[value]
    return out


class JsonlWriter:
    """``path`` (``metrics.jsonl``): ``json.dumps(row)`` and a newline per row, flushed at once;
    opened for appending at the first row."""

    def __init__(self, path: epath.Path):
        self.path = path
        self._file: Any = None

    def write(self, step: int, row: Row) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> None:
        """Drops the rows after ``step``. A torn last line (a write cut short by a crash or a
        full disk) is cut back to the last whole row with a warning on stderr; a damaged line
        before the last is a ``FileFormatError`` naming it (nothing is rewritten then)."""
        if not self.path.exists():
            return
        lines = [(n, line) for n, line in enumerate(
            self.path.read_bytes().decode("utf-8", "replace").split("\n"), 1) if line.strip()]
        keep = []
        for i, (number, line) in enumerate(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row, reason = None, f"{e.msg}, column {e.colno}"
            else:
                reason = "not a JSON object"
            if not isinstance(row, dict):
                if i < len(lines) - 1:
                    raise FileFormatError(f"{self.path} line {number} is not a metrics row ({reason}); "
                                          "valid: one JSON object per line (fix or remove that line)")
                print(f"[jaxflow] warning: {self.path} line {number} is torn ({reason}; a write cut "
                      f"short); cut back to the last whole row", file=sys.stderr, flush=True)
                continue
            if row.get("step", -1) <= step:
                keep.append(line)
        self.path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


#: Fields that count or identify rather than measure, whatever their values (versions, seeds,
#: indices): TensorBoard gets them as text, not as a scalar series; plots leave them out.
COUNTER_NAMES = ("step", "seed", "epoch")
COUNTER_SUFFIXES = ("_index", "_seed", "_version")
COUNTER_PREFIXES = ("version/",)


def is_counter_name(key: str) -> bool:
    """True for a field named as a counter or identifier: :data:`COUNTER_NAMES`, a name ending
    in one of :data:`COUNTER_SUFFIXES` or starting with one of :data:`COUNTER_PREFIXES`."""
    return key in COUNTER_NAMES or key.endswith(COUNTER_SUFFIXES) or key.startswith(COUNTER_PREFIXES)


class TensorBoardWriter:
    """TensorBoard event files in ``logdir`` (tensorboard's own event-file writer: no
    TensorFlow, no torch); each numeric field of a row (:func:`scalars`) is a scalar tagged with
    its name (TensorBoard groups the tags at their first "/": ``actor/pg_loss``), except the
    counters (:func:`is_counter_name`: versions, seeds, indices), which are text summaries
    under the same name. A new event file per opening (a resumed run adds one)."""

    def __init__(self, logdir: epath.Path, *, flush_secs: float = 10.0):
        self.logdir = logdir
        self._flush_secs = flush_secs
        self._writer: Any = None
        self._restart_at: int | None = None

    def _open(self):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:
            raise MissingExtraError(f"TensorBoard logging needs the tensorboard package ({e}): "
                                    "pip install tensorboard, or run with --no-tensorboard") from None
        self._event, self._summary = event_pb2, summary_pb2
        self._after_existing_files()
        self._writer = EventFileWriter(str(self.logdir), flush_secs=self._flush_secs)
        if self._restart_at is not None:
            self._writer.add_event(self._event.Event(
                wall_time=time.time(), step=self._restart_at,
                session_log=self._event.SessionLog(status=self._event.SessionLog.START)))
            self._restart_at = None

    def _after_existing_files(self) -> None:
        """Waits (under a second) until the clock is past the newest event file's second.
        TensorBoard reads a directory's event files in name order, and a name is
        ``events.out.tfevents.<second>.<host>.<pid>.<n>``: within one second, files of one
        process order by ``n`` as text (``10`` before ``9``), so a file opened in the same second
        as an earlier one (a resume straight after a stop) could be read before it, and the
        restart marker would then drop the wrong rows."""
        try:
            names = [p.name for p in self.logdir.iterdir()] if self.logdir.exists() else []
        except OSError:
            return
        seconds = [int(n.split(".")[3]) for n in names
                   if n.startswith("events.out.tfevents.") and n.split(".")[3].isdigit()]
        if seconds:
            while int(time.time()) <= max(seconds):
                time.sleep(0.05)

    def write(self, step: int, row: Row) -> None:
        values = scalars(row)
        if not values:
            return
        if self._writer is None:
            self._open()
        summary = self._summary.Summary(value=[
            self._text(k, row[k]) if is_counter_name(k) else
            self._summary.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.add_event(self._event.Event(wall_time=time.time(), step=int(step), summary=summary))

    def _text(self, tag: str, value: Any) -> Any:
        """A text-plugin summary value: ``str(value)`` as a scalar string tensor."""
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

        meta = self._summary.SummaryMetadata(
            plugin_data=self._summary.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[str(value).encode()],
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto())
        return self._summary.Summary.Value(tag=tag, metadata=meta, tensor=tensor)

    def rewind(self, step: int) -> None:
        # A SessionLog START at step s makes TensorBoard drop the events at steps >= s logged
        # before it (its restart handling); written when the file is next opened.
        self._restart_at = int(step) + 1
        if self._writer is not None:
            self.close()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbWriter:
    """A Weights & Biases run in ``project`` (``wandb.init`` at the first row; W&B keeps its
    files in ``dir/wandb``); each row's :func:`scalars` go to ``wandb.log(..., step=step)``.
    Rewinding is not possible (W&B drops rows whose step is below its last); a resumed jaxflow
    run is a new W&B run."""

    def __init__(self, project: str, *, name: str, dir: epath.Path, config: Any = None):
        self.project, self.name, self.dir, self.config = project, name, dir, config
        self._run: Any = None

    def write(self, step: int, row: Row) -> None:
        if self._run is None:
            wandb = import_wandb()
            self._run = wandb.init(project=self.project, name=self.name, dir=str(self.dir),
                                   config=self.config)
        self._run.log(scalars(row), step=int(step))

    def rewind(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def import_wandb():
    """The ``wandb`` module; :class:`MissingExtraError` (one line, the install command) when it
    is not installed."""
    try:
        import wandb
    except ImportError:
        raise MissingExtraError("--wandb needs the wandb package: pip install wandb") from None
    return wandb


class MultiWriter:
    """Every row to each of ``writers``, in order."""

    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write(self, step: int, row: Row) -> None:
        for w in self.writers:
            w.write(step, row)

    def rewind(self, step: int) -> None:
        for w in self.writers:
            w.rewind(step)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def run_writers(out_dir: epath.Path, *, name: str, tensorboard: bool = True,
                wandb_project: str | None = None, config: Any = None) -> MultiWriter:
    """The writers of a run in ``out_dir``: ``metrics.jsonl``, then TensorBoard under
    ``out_dir/tensorboard`` (``tensorboard``), then W&B (``wandb_project``)."""
    writers: list[MetricWriter] = [JsonlWriter(out_dir / "metrics.jsonl")]
    if tensorboard:
        writers.append(TensorBoardWriter(out_dir / "tensorboard"))
    if wandb_project:
        writers.append(WandbWriter(wandb_project, name=name, dir=out_dir, config=config))
    return MultiWriter(writers)
