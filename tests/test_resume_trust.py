"""Resume trusts only what it wrote: the step a checkpoint recorded (not its directory's name),
the resolved config saved in the run directory (a changed shape or setting is one line naming
the keys, before anything is restored), a step total that does not go back (the loop here; the
CLI in tests/test_run_lock.py's multiprocess case), a metrics file whose
torn last line is cut back; a full disk ends with one line naming the last committed checkpoint,
and ``--resume`` works once there is space.

The end-to-end cases run the CLI in-process on the tiny lm_pretrain model of tests/_cli.py: one
run that fills the disk at step 5 (after checkpoint 4), and copies of it.
"""

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxflow import run as runner
from jaxflow.checkpoint import Checkpointer, CheckpointError, check_step_name, recorded_step
from jaxflow.errors import FileFormatError
from jaxflow.experiment import RunContext, to_jsonable
from jaxflow.metric_writers import JsonlWriter
from jaxflow.plots import read_metrics
from jaxflow.run_dirs import HeldSaveErrors, config_changes, disk_full_line, field_defaults
from jaxflow.train.loop import StepsBelowCheckpoint, run_steps
from tests._cli import TINY_LM, one_line_error
from tests.test_cli_errors import snapshot

LM = ["--exp=lm_pretrain", "--variant=quick", *TINY_LM, "--set", "train.log_every=1",
      "--set", "train.steps=6", "--set", "train.checkpoint_every=2", "--set", "train.eval_every=6"]


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory):
    """A 6-step run whose metrics write at step 5 fails half-way with ENOSPC (after checkpoint
    4 was saved): (run dir, exit code, stderr lines)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("resume") / "full"
    original = JsonlWriter.write

    def write(self, step, row):
        if step == 5:
            self._file.write('{"step": 5, "loss": 3.')  # the part that fit
            self._file.flush()
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return original(self, step, row)

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(JsonlWriter, "write", write)
        code = runner.main([*LM, f"--out={out}"])
    return out, code, err.getvalue().strip().splitlines()


def _copy(run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def test_full_disk_ends_with_one_line_naming_the_last_checkpoint(full_disk_run):
    out, code, err = full_disk_run
    assert code == 2 and len(err) == 1, err
    assert "no space left on device" in err[0] and f"{out}/metrics.jsonl" in err[0], err
    assert f"last committed checkpoint is {out}/checkpoints/4 (intact)" in err[0], err
    assert err[0].endswith(f"python -m jaxflow.run --resume --out {out}"), err
    assert not (out / "run.lock").exists()  # released on the error


def test_resume_once_there_is_space_cuts_the_torn_row_and_takes_over_a_dead_lock(
        capsys, tmp_path, full_disk_run):
    run = _copy(full_disk_run[0], tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)  # a holder that died without releasing its lock (as a SIGKILL leaves it)
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead,
                                              "since": "2026-01-01T00:00:00Z"}))
    capsys.readouterr()
    assert runner.main(["--resume", f"--out={run}"]) == 0
    captured = capsys.readouterr()
    assert f"took over the lock of host {socket.gethostname()}, pid {dead}" in captured.out
    assert "resumed from checkpoint at step 4" in captured.out
    warning = [line for line in captured.err.splitlines() if "torn" in line]
    assert len(warning) == 1 and "metrics.jsonl line 5 is torn" in warning[0], captured.err
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_loss"] == rows[-1]["last_loss"]
    assert not (run / "run.lock").exists()


def test_renamed_checkpoint_directory_is_refused(capsys, tmp_path, full_disk_run):
    run = _copy(full_disk_run[0], tmp_path)
    os.rename(run / "checkpoints" / "4", run / "checkpoints" / "40")
    before = snapshot(run)
    err = one_line_error(capsys, ["--resume", f"--out={run}", "--set", "train.steps=60"])
    assert f"{run}/checkpoints/40 holds step 4 (its own metadata), not 40" in err, err
    assert "rename it back to 4" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("overrides, expected", [
    (["model.d_model=64"], "model.d_model: 32 -> 64"),
    (["model.d_model=64", "optim.lr=0.5"], "model.d_model: 32 -> 64; optim.lr: "),
])
def test_config_change_on_resume_is_one_line_naming_the_keys(capsys, tmp_path, full_disk_run,
                                                             overrides, expected):
    run = _copy(full_disk_run[0], tmp_path)
    before = snapshot(run)
    argv = ["--resume", f"--out={run}"]
    for o in overrides:
        argv += ["--set", o]
    err = one_line_error(capsys, argv)
    assert "--resume: the config differs from the run's in " + expected in err, err
    assert "delete" not in err and "remove" not in err
    assert snapshot(run) == before


# ---- the pieces, without a run --------------------------------------------------------------

def test_config_changes_leave_out_what_a_resume_may_change():
    saved = {"train": {"steps": 4, "log_every": 1, "batch_size": 8}, "mesh": {"shape": [1, 8]},
             "model": {"d_model": 32}}
    new = {"train": {"steps": 40, "log_every": 5, "batch_size": 16}, "mesh": {"shape": [8, 1]},
           "model": {"d_model": 32, "lora": {"rank": 4}}}
    assert config_changes(saved, new) == ["model.lora.rank: (absent) -> 4", "train.batch_size: 8 -> 16"]
    assert config_changes(saved, saved) == []


def test_a_field_added_after_the_run_resumes_only_at_its_default():
    # A run saved before rl.microbatches existed resumes when the field is at its default (the
    # old behaviour), and is refused when it is set to anything else.
    @dataclasses.dataclass(frozen=True)
    class Loss:
        agg: str = "token-mean"

    @dataclasses.dataclass(frozen=True)
    class RL:
        lag: int = 2
        loss: Loss = dataclasses.field(default_factory=Loss)
        microbatches: int = 1

    saved = {"rl": {"lag": 2, "loss": {}}}
    for new, expected in [(RL(), []), (RL(microbatches=4), ["rl.microbatches: (absent) -> 4"]),
                          (RL(loss=Loss("seq-mean-token-sum")), ["rl.loss.agg: (absent) -> seq-mean-token-sum"]),
                          (RL(lag=3), ["rl.lag: 2 -> 3"])]:
        config = {"rl": new}
        defaults = field_defaults(config)
        assert defaults["rl.microbatches"] == 1 and defaults["rl.loss.agg"] == "token-mean"
        assert config_changes(saved, to_jsonable(config), defaults) == expected
    assert config_changes(saved, to_jsonable({"rl": RL()})) == ["rl.loss.agg: (absent) -> token-mean",
                                                                 "rl.microbatches: (absent) -> 1"]


def test_checkpoint_records_its_step_and_a_renamed_one_is_caught(tmp_path):
    ckpt = Checkpointer(tmp_path / "c", async_save=False)
    ckpt.save(4, {"x": np.ones(3, np.float32)})
    ckpt.close()
    assert recorded_step(tmp_path / "c" / "4") == 4
    check_step_name(tmp_path / "c" / "4")
    os.rename(tmp_path / "c" / "4", tmp_path / "c" / "40")
    with pytest.raises(CheckpointError, match="holds step 4 .* not 40: it was renamed"):
        Checkpointer(tmp_path / "c").latest_step()
    # a checkpoint written before steps were recorded is taken by its name
    meta = tmp_path / "c" / "40" / "_CHECKPOINT_METADATA"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "custom_metadata": {}}))
    assert recorded_step(tmp_path / "c" / "40") is None
    assert Checkpointer(tmp_path / "c").latest_step() == 40


def test_a_checkpoint_of_other_shapes_is_named_without_advice_to_delete(tmp_path):
    import jax

    ckpt = Checkpointer(tmp_path / "c", async_save=False)
    ckpt.save(2, {"x": np.ones(3, np.float32)})
    ckpt.close()
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tmp_path / "c").restore(2, {"x": jax.ShapeDtypeStruct(
            (4,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))})
    assert "holds arrays of other shapes than this run's (Requested shape: (4,) is not compatible " \
           "with the stored shape: (3,))" in str(e.value), e.value
    assert "delete" not in str(e.value)


def test_the_loop_refuses_a_total_below_the_checkpoint_before_restoring(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    ckpt.save(5, {"x": np.ones(2, np.float32)})
    ckpt.close()
    run = RunContext(name="t", variant="quick", out_dir=tmp_path, resume=True, tensorboard=False)
    restored = []
    with pytest.raises(StepsBelowCheckpoint, match="a total of 3 steps, but .* at step 5"):
        run_steps(lambda s, step: (s, {}), {"x": np.zeros(2, np.float32)}, steps=3, run=run,
                  checkpointer=Checkpointer(tmp_path / "checkpoints"),
                  restore=lambda c, step, s: restored.append(step) or s)
    assert restored == []


def test_metrics_rewind_cuts_a_torn_tail_and_names_a_damaged_middle_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    JsonlWriter(path).rewind(2)
    assert path.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl line 3 is torn" in err[0], err
    path.write_text('{"step": 1}\n{"step": 2}\n')  # a whole last row is kept
    JsonlWriter(path).rewind(2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and not capsys.readouterr().err
    damaged = '{"step": 1}\n[garbage\n{"step": 3}\n'
    path.write_text(damaged)
    with pytest.raises(FileFormatError, match=r"line 2 is not a metrics row \(Expecting value, column 2\)"):
        JsonlWriter(path).rewind(3)
    assert path.read_text() == damaged


def test_disk_full_line_follows_the_cause_chain(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/x/f")
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as wrapped:
        line = disk_full_line(wrapped, tmp_path, "RESUME")
    assert line is not None and "writing /x/f" in line and "no checkpoint of this run was committed" in line
    assert disk_full_line(ValueError("RESOURCE_EXHAUSTED: ... No space left on device [28]"),
                          tmp_path, "RESUME") is not None
    assert disk_full_line(OSError(errno.EACCES, "Permission denied"), tmp_path, "RESUME") is None


def test_held_save_errors_are_dropped_or_shown(caplog):
    """orbax's save-thread records (and a thread's or a finalizer's exception) wait for the end
    of the run: dropped when its one line explains them, shown otherwise."""
    import threading

    class Finalized:
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    logger = logging.getLogger("absl")
    hooks = threading.excepthook, sys.unraisablehook
    shown = []
    sys.unraisablehook = shown.append
    try:
        held = HeldSaveErrors()
        threading.Thread(target=lambda: 1 / 0).start()  # ends its thread: held, then dropped
        time.sleep(0.2)
        held.drop()
        held.release()
        assert threading.excepthook is hooks[0]
        Finalized()  # not orbax's: shown at once by the hook left in place
        assert [str(s.exc_value) for s in shown] == ["Event loop is closed"]
        held = HeldSaveErrors()
        Finalized()
        assert len(shown) == 1  # held
        held.release()
    finally:
        sys.unraisablehook = hooks[1]
    assert [str(s.exc_value) for s in shown] == ["Event loop is closed"] * 2

    def orbax_error(msg):
        logger.handle(logger.makeRecord("absl", logging.ERROR, "/site-packages/orbax/checkpoint/x.py",
                                        1, msg, None, None))

    with caplog.at_level(logging.ERROR, logger="absl"):
        held = HeldSaveErrors()
        orbax_error("dropped")
        held.drop()
        held.release()
        held = HeldSaveErrors()
        orbax_error("shown")
        assert [r.getMessage() for r in caplog.records] == []
        held.release()
    assert [r.getMessage() for r in caplog.records] == ["shown"]
