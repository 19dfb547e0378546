"""Bad input and faults at the runner: every user error is exit 2 with one line and leaves the
run directory as it was; SIGINT / SIGTERM checkpoint and stop with the resume command; --out
takes paths and file:// URIs.

Every CLI case runs in-process (``runner.main(argv)``); the lm_pretrain runs use the tiny model
of tests/_cli.py on the session's 8 fake CPU devices.
"""

import hashlib
import json
import os
import shutil
import signal

import numpy as np
import pytest

from jaxflow import run as runner
from jaxflow import signals
from jaxflow.checkpoint import Checkpointer
from jaxflow.plots import read_metrics
from tests._cli import TINY_LM, one_line_error

LM = ["--exp=lm_pretrain", "--variant=quick", *TINY_LM, "--set", "train.log_every=1"]
STEPS = ["--set", "train.steps=4", "--set", "train.checkpoint_every=3", "--set", "train.eval_every=4"]


def snapshot(path) -> dict:
    """{relative path: sha256} of every file under ``path`` (``{}`` if it does not exist)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A 4-step lm_pretrain run (--out given as a file:// URI) stopped by SIGINT after step 2:
    (run dir, exit code, stderr lines). Tests that damage it work on copies."""
    out = tmp_path_factory.mktemp("cli") / "stopped"
    original = Checkpointer.stop_if_requested

    def interrupt_at_2(self, step, state):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # handled here: step 2 is done, not yet saved
        return original(self, step, state)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Checkpointer, "stop_if_requested", interrupt_at_2)
        import contextlib
        import io

        err = io.StringIO()
        before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in the background
        with contextlib.redirect_stderr(err):
            code = runner.main([*LM, *STEPS, f"--out=file://{out}"])
        after = signal.getsignal(signal.SIGINT)
    return out, code, err.getvalue().strip().splitlines(), (before, after)


@pytest.fixture
def stopped_run_dir(stopped_run):
    return stopped_run[0]


# ---- flag and config values: nothing runs, nothing is written -------------------------------

@pytest.mark.parametrize("extra, expected", [
    (["--set", "train.log_every=0"], "log_every=0; valid: an integer >= 1"),
    (["--set", "train.eval_every=0"], "eval_every=0; valid: an integer >= 1"),
    (["--set", "train.batch_size=0"], "batch_size=0; valid: an integer >= 1"),
    (["--set", "train.steps=-5"], "steps=-5; valid: an integer >= 1"),
    (["--set", "train.seq_len=4096"], "exceeds model.max_seq_len=128"),
    (["--set", "optim.lr=nan"], "NaN is not a valid value"),
    (["--set", "optim.lr=inf"], "lr=inf; valid: a finite number > 0"),
    (["--set", "optim.lr=-1e-3"], "valid: a finite number > 0"),
    (["--set", "optim.b2=1.0"], "b2=1.0; valid: [0.0, 1.0)"),
    (["--devices=0"], "--devices 0; valid: an integer >= 1"),
    (["--coordinator=notanaddress", "--num-processes=2", "--process-id=0"], "expected HOST:PORT"),
    (["--coordinator=127.0.0.1:abc", "--num-processes=2", "--process-id=0"], "port 'abc' is not a number"),
    (["--coordinator=127.0.0.1:99999", "--num-processes=2", "--process-id=0"], "port 99999; valid: 1-65535"),
    (["--coordinator=127.0.0.1:0", "--num-processes=2", "--process-id=0"], "port 0; valid: 1-65535"),
    (["--coordinator=no-such-host.invalid:1234", "--num-processes=2", "--process-id=0"], "no-such-host.invalid"),
    (["--coordinator=127.0.0.1:1234", "--num-processes=2", "--process-id=2"], "--process-id 2; valid: 0..1"),
    (["--coordinator=127.0.0.1:1234", "--num-processes=0", "--process-id=0"], "--num-processes 0"),
    (["--coordinator=127.0.0.1:1234"], "needs --num-processes and --process-id"),
    (["--num-processes=2"], "need --coordinator"),
    (["--coordinator=127.0.0.1:1234", "--num-processes=2", "--process-id=0", "--peer-timeout=0"],
     "--peer-timeout 0.0; valid: seconds > 0"),
])
def test_bad_values_exit_2_before_anything_is_written(capsys, tmp_path, extra, expected):
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LM, *extra, f"--out={out}"])
    assert expected in err, err
    assert not out.exists()


@pytest.mark.parametrize("argv, expected", [
    (["--exp=dlrm_train", "--set", "train.log_every=0"], "log_every=0; valid: an integer >= 1"),
    (["--exp=dlrm_train", "--set", "train.sparse_lr=inf"], "sparse_lr=inf; valid: a finite number > 0"),
    (["--exp=sis_offpolicy", "--set", "train.checkpoint_every=0"], "checkpoint_every=0"),
    (["--exp=calibration_tradeoffs", "--set", "train.steps=-1"], "steps=-1; valid: an integer >= 1"),
])
def test_other_trainers_validate_their_counts_and_rates(capsys, tmp_path, argv, expected):
    out = tmp_path / "run"
    assert expected in one_line_error(capsys, [*argv, "--variant=quick", f"--out={out}"])
    assert not out.exists()


# ---- --out ----------------------------------------------------------------------------------

def test_out_naming_a_file(capsys, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    assert "is a file; valid: a directory" in one_line_error(capsys, [*LM, f"--out={target}"])
    assert target.read_text() == "keep me"


def test_out_under_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is a file, so the directory cannot be created" in one_line_error(
        capsys, [*LM, f"--out={tmp_path / 'f' / 'run'}"])


def test_out_unwritable(capsys):
    # /proc/self refuses writes even to root (a chmod'ed directory would not)
    assert "cannot write under '/proc/" in one_line_error(capsys, [*LM, "--out=/proc/self/run"])


def test_out_file_uri_with_a_host_is_refused(capsys, tmp_path):
    assert "names a local path" in one_line_error(capsys, [*LM, f"--out=file://server{tmp_path}"])


def test_out_remote_uri_without_its_filesystem_package(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as when gcsfs is not installed
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    assert "pip install gcsfs" in one_line_error(capsys, [*LM, "--out=gs://bucket/run"])


def test_existing_run_dir_is_not_overwritten(capsys, stopped_run_dir):
    before = snapshot(stopped_run_dir)
    assert "already holds a run" in one_line_error(capsys, [*LM, f"--out={stopped_run_dir}"])
    assert snapshot(stopped_run_dir) == before


# ---- --resume -------------------------------------------------------------------------------

@pytest.mark.parametrize("content, expected", [
    ("{not json", "is not readable JSON"),
    ("\udcff", "is not readable JSON"),
    ('{"experiment": "lm_pretrain"}', "lacks variant, overrides"),
    ("[1, 2]", "lacks experiment, variant, overrides"),
])
def test_resume_with_a_damaged_config(capsys, tmp_path, stopped_run_dir, content, expected):
    run = tmp_path / "run"
    shutil.copytree(stopped_run_dir, run)
    (run / "config.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    before = snapshot(run)
    err = one_line_error(capsys, ["--resume", f"--out={run}"])
    assert expected in err and "start fresh" in err, err
    assert snapshot(run) == before


@pytest.mark.parametrize("flag, expected", [
    ("--variant=full", "--variant 'full' does not match the run"),
    ("--exp=sis_offpolicy", "--exp 'sis_offpolicy' does not match the run"),
])
def test_resume_with_other_experiment_or_variant(capsys, stopped_run_dir, flag, expected):
    before = snapshot(stopped_run_dir)
    assert expected in one_line_error(capsys, ["--resume", flag, f"--out={stopped_run_dir}"])
    assert snapshot(stopped_run_dir) == before


def test_resume_after_checkpoints_were_deleted_is_refused(capsys, tmp_path, stopped_run_dir):
    run = tmp_path / "run"
    shutil.copytree(stopped_run_dir, run)
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    err = one_line_error(capsys, ["--resume", f"--out={run}"])
    assert "holds no complete checkpoint" in err and "restart at step 0" in err
    assert snapshot(run) == before  # no metrics row appended twice


def test_resume_from_a_truncated_checkpoint(capsys, tmp_path, stopped_run_dir):
    run = tmp_path / "run"
    shutil.copytree(stopped_run_dir, run)
    for root, _, files in os.walk(run / "checkpoints" / "2" / "state"):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(os.path.getsize(os.path.join(root, f)) // 2)
    before = snapshot(run)
    err = one_line_error(capsys, ["--resume", f"--out={run}"])
    assert "checkpoints/2 is unreadable" in err and "older checkpoint" in err, err
    assert snapshot(run) == before


# ---- errors inside the experiment: a fresh run leaves no directory -------------------------

def test_missing_optional_extra(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llmcompressor" else real(name, *a))
    out = tmp_path / "run"
    err = one_line_error(capsys, ["--exp=bench_sparsegpt", "--variant=quick", f"--out={out}"])
    assert "pip install -e '.[bench]'" in err
    assert not out.exists()  # the corrected rerun is not refused as "already holds a run"


def test_user_error_inside_the_entry_rolls_back_the_fresh_run(capsys, tmp_path, monkeypatch):
    from jaxflow.config import ExperimentSpec
    from jaxflow.mesh import MeshError

    def entry(config, run):
        run.log(1, {"loss": 1.0})
        raise MeshError("mesh needs 16 devices but 8 are available; valid: --devices 16")

    monkeypatch.setattr(ExperimentSpec, "entry_fn", lambda self: entry)
    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("user file")
    assert "needs 16 devices" in one_line_error(capsys, [*LM, f"--out={out}"])
    assert sorted(os.listdir(out)) == ["mine.txt"]  # config.json and metrics.jsonl gone
    fresh = tmp_path / "fresh"
    assert "needs 16 devices" in one_line_error(capsys, [*LM, f"--out={fresh}"])
    assert not fresh.exists()


# ---- signals --------------------------------------------------------------------------------

def test_sigint_checkpoints_the_step_and_prints_the_resume_command(stopped_run):
    out, code, err, (before, after) = stopped_run
    assert code == 130, err
    assert err == [f"[jaxflow] stopped by SIGINT at step 2: checkpoint at step 2 saved; resume: "
                   f"python -m jaxflow.run --resume --out {out}"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert max(int(d) for d in os.listdir(out / "checkpoints")) == 2  # step 2 is not a due save
    assert after is before  # the SIGINT handler the process had is restored
    assert signals.requested() is None


def test_resume_after_sigint_continues_without_doubled_rows(capsys, tmp_path, stopped_run):
    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    assert runner.main(["--resume", f"--out={run}"]) == 0  # a plain path for the URI's run
    assert "resumed from checkpoint at step 2" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] == read_metrics(run / "metrics.jsonl")[-1]["last_loss"]


def _counting_entry(stop_at: int, signum: int, poll: bool = True):
    """An experiment of 5 tiny steps that checkpoints every 10 and polls for a stop."""

    def entry(config, run):
        import jax.numpy as jnp

        ckpt = Checkpointer(run.checkpoint_dir, save_every=10, async_save=False)
        state = {"x": jnp.zeros(3)}
        for step in range(1, 6):
            state = {"x": state["x"] + 1}
            run.log(step, {"x": float(state["x"][0])})
            if step == stop_at:
                os.kill(os.getpid(), signum)
            if poll:
                ckpt.stop_if_requested(step, state)
        ckpt.close()
        return {"x": float(state["x"][0])}

    return entry


def test_sigterm_checkpoints_and_exits_143(capsys, tmp_path, monkeypatch):
    from jaxflow.config import ExperimentSpec

    monkeypatch.setattr(ExperimentSpec, "entry_fn", lambda self: _counting_entry(3, signal.SIGTERM))
    out = tmp_path / "run"
    capsys.readouterr()
    assert runner.main([*LM, f"--out={out}"]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped by SIGTERM at step 3" in err[0] and "--resume --out" in err[0]
    restored = Checkpointer(out / "checkpoints").restore(3, {"x": np.zeros(3, np.float32)})
    assert np.asarray(restored["x"]).tolist() == [3.0, 3.0, 3.0]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_signal_where_nothing_polls_abandons_with_one_line(capsys, tmp_path, monkeypatch):
    from jaxflow.config import ExperimentSpec

    monkeypatch.setattr(ExperimentSpec, "entry_fn",
                        lambda self: _counting_entry(2, signal.SIGINT, poll=False))
    capsys.readouterr()
    assert runner.main([*LM, f"--out={tmp_path / 'run'}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "abandoned, no checkpoint to resume from" in err[0]
    assert signals.requested() is None


def test_out_as_file_uri_and_local_path_give_the_same_run_path(tmp_path):
    from jaxflow.experiment import run_path

    assert run_path(f"file://{tmp_path}/a b") == run_path(f"{tmp_path}/a b")
    assert str(run_path("file:///tmp/x%20y")) == "/tmp/x y"
    assert str(run_path("gs://bucket/run")) == "gs://bucket/run"  # not the local dir gs:/bucket
    assert str(run_path("gs://bucket/run") / "config.json") == "gs://bucket/run/config.json"
    assert str(run_path("runs/x")) == "runs/x"  # relative paths stay relative


def test_sync_cost_model_without_a_measurement_is_one_line(capsys, tmp_path):
    out = tmp_path / "run"
    err = one_line_error(capsys, ["--exp=sync_cost_model", "--variant=quick", f"--out={out}",
                                  "--set", f"runs_root={tmp_path / 'empty'}"])
    assert "no sparse_sync run under" in err and "--exp=sparse_sync --variant=quick" in err
    err = one_line_error(capsys, ["--exp=sync_cost_model", "--variant=quick", f"--out={out}",
                                  "--set", f"source={tmp_path / 'missing'}"])
    assert "no sparse_sync summary.json there" in err
    assert not out.exists()  # nothing left behind: the corrected rerun is not refused
