"""One writer per run directory (``jaxflow.run_lock``): a second holder is refused naming the
first (host, pid, since); a lock left by a dead process on this host is taken over with one
line; one left by another host needs ``--break-lock``; the runner refuses a second run or
``--resume`` of a directory in use with exit 2 and one line, before anything is written; the
lock goes when the run ends (normally, on an error, on a signal).

The multiprocess case runs the issue's two writers for real: a run SIGKILLed after a checkpoint,
then a ``--resume`` while another ``--resume`` trains.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxflow.plots import read_metrics
from jaxflow.run_lock import LOCK_NAME, RunLock, RunLocked, check_free, holder_alive
from tests._cli import ROOT, TINY_LM, cli_env, one_line_error
from tests.test_cli_errors import snapshot

HOST = socket.gethostname()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def _write_holder(run_dir, **holder):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"since": "2026-01-01T00:00:00Z", **holder}))


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    lines = []
    lock = RunLock.acquire(tmp_path / "run", info=lines.append)
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert (holder["host"], holder["pid"]) == (HOST, os.getpid()) and holder["since"].endswith("Z")
    with pytest.raises(RunLocked, match=f"in use by another run \\(host {HOST}, pid {os.getpid()}, "
                                        f"since {holder['since']}; run.lock\\)"):
        RunLock.acquire(tmp_path / "run")
    with pytest.raises(RunLocked, match="in use by another run"):
        check_free(tmp_path / "run")
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / "run" / LOCK_NAME).exists() and lines == []
    check_free(tmp_path / "run")
    RunLock.acquire(tmp_path / "run", info=lines.append).release()
    assert lines == []


def test_a_dead_holder_on_this_host_is_taken_over_with_one_line(tmp_path):
    pid = _dead_pid()
    _write_holder(tmp_path, host=HOST, pid=pid)
    assert not holder_alive({"host": HOST, "pid": pid})
    check_free(tmp_path)  # nothing to refuse
    lines = []
    lock = RunLock.acquire(tmp_path, info=lines.append)
    assert lines == [f"took over the lock of host {HOST}, pid {pid}, since 2026-01-01T00:00:00Z (not running)"]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_holder_on_another_host_needs_break_lock(tmp_path):
    _write_holder(tmp_path, host="elsewhere.example", pid=4242)
    before = (tmp_path / LOCK_NAME).read_text()
    for attempt in (lambda: check_free(tmp_path), lambda: RunLock.acquire(tmp_path)):
        with pytest.raises(RunLocked, match="locked by a run on another host \\(host elsewhere.example, "
                                            "pid 4242, .*add --break-lock"):
            attempt()
        assert (tmp_path / LOCK_NAME).read_text() == before  # the record stays
    check_free(tmp_path, break_lock=True)
    lines = []
    lock = RunLock.acquire(tmp_path, break_lock=True, info=lines.append)
    assert lines == ["broke the lock of host elsewhere.example, pid 4242, since 2026-01-01T00:00:00Z "
                     "(--break-lock)"]
    lock.release()


def test_a_lock_path_that_is_not_a_file_is_one_line(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    check_free(tmp_path)  # acquire reports it
    with pytest.raises(RunLocked, match="cannot open its lock file .*run.lock \\(Is a directory\\)"):
        RunLock.acquire(tmp_path)


def test_a_remote_run_directory_is_not_locked(tmp_path):
    from jaxflow.run_lock import lock_run_dir

    lines = []
    lock = lock_run_dir("gs://bucket/run", info=lines.append)
    assert not lock.held and lines == ["gs://bucket/run is not a local directory, so it is not locked "
                                       "against a second run"]
    check_free("gs://bucket/run")  # nothing to read, nothing refused


# ---- the runner -----------------------------------------------------------------------------

LM = ["--exp=lm_pretrain", "--variant=quick", *TINY_LM]


def test_runner_refuses_a_directory_in_use_before_writing(capsys, tmp_path):
    out = tmp_path / "run"
    lock = RunLock.acquire(out)
    try:
        err = one_line_error(capsys, [*LM, f"--out={out}"])
        assert f"--out '{out}' is in use by another run (host {HOST}, pid {os.getpid()}, since " in err, err
        assert os.listdir(out) == [LOCK_NAME]
        (out / "config.json").write_text("{}")  # a run in flight: --resume names the holder too
        err = one_line_error(capsys, ["--resume", f"--out={out}"])
        assert f"pid {os.getpid()}" in err and "in use by another run" in err, err
    finally:
        lock.release()


def test_runner_refuses_another_hosts_lock_without_break_lock(capsys, tmp_path):
    out = tmp_path / "run"
    _write_holder(out, host="elsewhere.example", pid=4242)
    err = one_line_error(capsys, [*LM, f"--out={out}"])
    assert "another host (host elsewhere.example, pid 4242" in err and "--break-lock" in err, err


def test_the_lock_goes_when_a_run_ends_on_an_error(capsys, tmp_path, monkeypatch):
    from jaxflow import run as runner
    from jaxflow.config import ExperimentSpec
    from jaxflow.errors import DataError

    seen = []

    def entry(config, run):
        seen.append(json.loads((run.out_dir / LOCK_NAME).read_text())["pid"])
        raise DataError("token id 99 outside [0, 32)")

    monkeypatch.setattr(ExperimentSpec, "entry_fn", lambda self: entry)
    out = tmp_path / "run"
    out.mkdir()
    assert runner.main([*LM, f"--out={out}"]) == 2
    assert seen == [os.getpid()] and os.listdir(out) == []  # rolled back, lock released


# ---- two writers for real -------------------------------------------------------------------

def _cli(*args):
    return [sys.executable, "-m", "jaxflow.run", *args]


@pytest.mark.multiprocess
def test_two_resumes_of_one_run_directory(capsys, tmp_path):
    """A run SIGKILLed after checkpoint 4 leaves its lock; a ``--resume`` takes it over and
    trains on while a second ``--resume`` (and a fresh run into the same --out) is refused naming
    it; metrics.jsonl then holds every step once and the lock is gone. Then a ``--resume`` with
    fewer steps than the checkpoint's is one line and changes nothing."""
    out = tmp_path / "run"
    steps = ["--set", "train.log_every=1", "--set", "train.checkpoint_every=2", "--set", "train.eval_every=1000"]
    env = cli_env()
    killed = subprocess.run(_cli(*LM, *steps, "--set", "train.steps=8", "--devices=1", f"--out={out}",
                                 "--kill-after-checkpoint=4"), cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    dead = json.loads((out / LOCK_NAME).read_text())["pid"]
    resumed = subprocess.Popen(_cli("--resume", f"--out={out}", "--set", "train.steps=120"), cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            holder = json.loads((out / LOCK_NAME).read_text() or "{}") if (out / LOCK_NAME).exists() else {}
            if holder.get("pid") == resumed.pid or resumed.poll() is not None:
                break
            time.sleep(0.2)
        assert resumed.poll() is None, resumed.communicate()
        err = one_line_error(capsys, ["--resume", f"--out={out}", "--set", "train.steps=120"])
        assert f"is in use by another run (host {HOST}, pid {resumed.pid}, since " in err, err
        err = one_line_error(capsys, [*LM, f"--out={out}"])
        assert f"pid {resumed.pid}" in err, err
        stdout, stderr = resumed.communicate(timeout=300)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"took over the lock of host {HOST}, pid {dead}" in stdout and "(not running)" in stdout
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 121))
    assert not (out / LOCK_NAME).exists()
    before = snapshot(out)  # and a step total below the checkpoint's: one line, nothing changed
    err = one_line_error(capsys, ["--resume", f"--out={out}", "--set", "train.steps=100", "--devices=8"])
    assert "a total of 100 steps, but the checkpoint" in err and "is at step 120" in err, err
    assert snapshot(out) == before
