"""SIGINT / SIGTERM everywhere in a run: during the runner's imports (one line, exit 130 / 143,
nothing written), a second signal during the checkpoint save (the save completes, the resume
line follows), a signal after the loop's last poll (never dropped), the metric window across a
resume (the same rows as a run that never stopped), and the flagship stopped in its warm start
(checkpointed, resumed to completion)."""

import gc
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxflow import run as runner
from jaxflow import signals
from jaxflow.checkpoint import Checkpointer, finalized_steps
from jaxflow.experiment import RunContext
from jaxflow.plots import read_metrics
from jaxflow.sync import tree_digest
from jaxflow.train.loop import decode_window, encode_window, mean_rows, run_steps
from jaxflow.train.state import TrainState
from tests._cli import ROOT, TINY_LM, cli_env, compile_cache_env

LM = ["--exp=lm_pretrain", "--variant=quick", *TINY_LM, "--set", "train.log_every=1",
      "--set", "train.steps=4", "--set", "train.checkpoint_every=3", "--set", "train.eval_every=4"]

X = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
Y = X @ np.arange(1, 5, dtype=np.float32)


def _state():
    params = {"w": jnp.zeros((4,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return TrainState.create(optax.adam(0.1), params)


@jax.jit
def _step(state, x, y):
    def loss_fn(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss, "w0": state.params["w"][0]}


def _step_fn(state, step):
    i = (step * 4) % 16
    return _step(state, X[i:i + 4], Y[i:i + 4])


def _env():
    return cli_env()


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: /proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


# ---- before the run starts ------------------------------------------------------------------

@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, id="SIGINT"),
                                    pytest.param(signal.SIGTERM, id="SIGTERM")])
def test_a_signal_during_the_imports_exits_with_one_line_and_writes_nothing(tmp_path, signum):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "jaxflow.run", *LM, f"--out={out}"], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    # SIGTERM is caught once the runner's first lines ran (Python itself handles only SIGINT)
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert stderr.splitlines() == [f"python -m jaxflow.run: stopped by {name} before the run "
                                   "started; nothing was written"]
    assert stdout == "" and not out.exists()


# ---- during the checkpoint save -------------------------------------------------------------

def test_a_second_sigint_during_the_save_waits_for_it(tmp_path, monkeypatch, capsys):
    """SIGINT after step 2, then one more while its checkpoint is saved and one while it is
    committed: the save completes (no temporary directory), then the resume line."""
    out = tmp_path / "run"
    stop_if_requested = Checkpointer.stop_if_requested
    save, wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
    sent = []

    def interrupt_at_2(self, step, state):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return stop_if_requested(self, step, state)

    def interrupted(original):
        def call(self, *args, **kwargs):
            if signals.requested() is not None and len(sent) < 2:  # the stop's save and wait
                sent.append(original.__name__)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler runs in here
            return original(self, *args, **kwargs)
        return call

    monkeypatch.setattr(Checkpointer, "stop_if_requested", interrupt_at_2)
    monkeypatch.setattr(ocp.CheckpointManager, "save", interrupted(save))
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", interrupted(wait))
    capsys.readouterr()
    assert runner.main([*LM, f"--out={out}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert sent == ["save", "wait_until_finished"]
    assert err == [f"[jaxflow] stopped by SIGINT at step 2: checkpoint at step 2 saved; resume: "
                   f"python -m jaxflow.run --resume --out {out}"]
    complete = sorted(p.name for p in finalized_steps(out / "checkpoints"))
    assert "2" in complete and sorted(os.listdir(out / "checkpoints")) == complete  # no temporary
    assert Checkpointer(out / "checkpoints").latest_step() == 2
    assert signals.requested() is None


def test_a_signal_after_the_last_poll_is_not_dropped(tmp_path, monkeypatch, capsys):
    """The loop finished (and checkpointed); a SIGINT in what the experiment does after it
    stops the run at once with the resume line, never an exit 0 that ignored it."""
    from jaxflow.config import ExperimentSpec

    def entry(config, run):
        ckpt = Checkpointer(run.checkpoint_dir, save_every=10, async_save=False)
        run_steps(_step_fn, _state(), steps=3, run=run, checkpointer=ckpt)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)  # work after the loop: the handler raises in here
        return {"not": "reached"}

    monkeypatch.setattr(ExperimentSpec, "entry_fn", lambda self: entry)
    out = tmp_path / "run"
    capsys.readouterr()
    assert runner.main([*LM, f"--out={out}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[jaxflow] stopped by SIGINT: the step in flight was abandoned; resume from "
                   f"the last checkpoint: python -m jaxflow.run --resume --out {out}"]
    assert not (out / "summary.json").exists()


def test_a_stop_raised_inside_a_gc_callback_is_raised_again():
    """Where nothing polls, the handler raises; in a GC callback (JAX has one) Python would
    print and drop that exception, so the stop comes again where it propagates."""
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(phase)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs in here
                pass

    restore = signals.install()
    gc.callbacks.append(callback)
    try:
        with pytest.raises(signals.RunStopped) as stop:
            gc.collect()
            deadline = time.time() + 10
            while time.time() < deadline:
                time.sleep(0.01)
    finally:
        gc.callbacks.remove(callback)
        restore()
    assert fired and stop.value.signum == signal.SIGTERM and stop.value.step is None


ABANDONED_COMPILE = """
import os, signal, sys, threading
import jax, jax.numpy as jnp
from jaxflow import signals

def big(x):
    for i in range(1500):
        x = jnp.sin(x * 1.0001 + i) @ x
    return x

restore = signals.install()
lowered = jax.jit(big).lower(jnp.ones((64, 64)))
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    lowered.compile()  # seconds on XLA's threads; the stop does not wait for them
except signals.RunStopped as stop:
    print(stop, flush=True)
restore()
signals.exit_now(143)  # what python -m jaxflow.run does after a stop
"""


def test_exit_after_a_stop_leaves_an_abandoned_compilation_alone():
    """A stop raised while XLA compiles leaves the compilation running on XLA's threads; the
    interpreter's teardown would destroy the PjRt client under it (SIGSEGV), so the runner
    ends a stopped process with ``signals.exit_now``."""
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", ABANDONED_COMPILE], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
        assert (res.returncode, res.stdout) == (143, "stopped by SIGTERM\n"), res.stderr[-2000:]


# ---- the metric window across a resume ------------------------------------------------------

def test_resume_logs_the_rows_of_a_run_that_never_stopped(tmp_path):
    """log_every=3 and a SIGINT stop at step 4: the row of step 6 still averages steps 4-6."""
    plain = RunContext(name="t", variant="quick", out_dir=tmp_path / "plain")
    full = run_steps(_step_fn, _state(), steps=8, run=plain, log_every=3, summarize=mean_rows)
    plain.close()

    def stop_at_4(state, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during step 4: it finishes first
        return _step_fn(state, step)

    out = tmp_path / "stopped"
    restore = signals.install()
    try:
        run = RunContext(name="t", variant="quick", out_dir=out)
        with pytest.raises(signals.RunStopped) as stop:
            run_steps(stop_at_4, _state(), steps=8, run=run, log_every=3, summarize=mean_rows,
                      checkpointer=Checkpointer(run.checkpoint_dir, save_every=100))
        run.close()
    finally:
        restore()
    assert stop.value.step == 4
    resumed = RunContext(name="t", variant="quick", out_dir=out, resume=True)
    result = run_steps(_step_fn, _state(), steps=8, run=resumed, log_every=3, summarize=mean_rows,
                       checkpointer=Checkpointer(resumed.checkpoint_dir, save_every=100))
    resumed.close()
    assert result.start == 4
    assert read_metrics(out / "metrics.jsonl") == read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [3, 6, 8]
    assert tree_digest(result.state.params) == tree_digest(full.state.params)


def test_the_saved_window_keeps_dtypes_and_shapes():
    window = [{"loss": jnp.float32(0.1), "h": jnp.arange(3, dtype=jnp.bfloat16), "n": 7,
               "x": 0.25, "name": "a", "nested": {"k": [np.int32(2), None]}}]
    back = decode_window(json.loads(json.dumps(encode_window(window))))
    assert back[0]["loss"].dtype == np.float32 and back[0]["loss"] == np.float32(0.1)
    assert back[0]["h"].dtype == jnp.bfloat16 and back[0]["h"].tolist() == [0, 1, 2]
    assert (back[0]["n"], back[0]["x"], back[0]["name"]) == (7, 0.25, "a")
    assert back[0]["nested"]["k"][0].dtype == np.int32 and back[0]["nested"]["k"][1] is None
    assert encode_window([{"obj": object()}]) is None  # not saved: a resume starts a new one


# ---- the flagship, stopped in its warm start ------------------------------------------------

FLAGSHIP = ["--exp=flagship", "--variant=quick"] + [a for kv in (
    "pretrain.data.digits=1", "pretrain.model.d_model=32", "pretrain.model.n_layers=1",
    "pretrain.model.n_heads=2", "pretrain.model.n_kv_heads=2", "pretrain.model.d_ff=64",
    "pretrain.model.max_seq_len=32", "pretrain.train.steps=40", "pretrain.train.batch_size=8",
    "pretrain.train.seq_len=32", "pretrain.train.log_every=1", "pretrain.train.eval_every=40",
    "pretrain.train.eval_examples=8", "pretrain.train.checkpoint_every=40",
    "rl.prompts_per_rollout=2", "rl.group_size=2", "rl.max_new_tokens=10", "rl.sis_topk=4",
    "rollouts=2", "eval.prompts=2", "eval.samples=1", "eval.every=1") for a in ("--set", kv)]


@pytest.mark.slow
def test_flagship_stopped_in_its_warm_start_resumes_to_completion(tmp_path):
    """A fresh cache: the warm start trains in the run directory; SIGINT after its first row
    checkpoints its step and exits 130; --resume finishes it (each warm-start step logged
    once), caches it and runs RL to the summary."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    env = cli_env(**compile_cache_env(tmp_path / "xla_cache"))  # the resume loads the programs
    proc = subprocess.Popen([sys.executable, "-m", "jaxflow.run", *FLAGSHIP, "--set",
                             f"cache_root={cache}", f"--out={out}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "step 1/40" in line:  # the warm start's first row
            proc.send_signal(signal.SIGINT)
            break
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 130, stderr[-3000:]
    (line,) = stderr.strip().splitlines()
    assert line.startswith("[jaxflow] stopped by SIGINT at step ") and line.endswith(
        f"saved; resume: python -m jaxflow.run --resume --out {out}"), line
    assert not (cache.exists() and any(cache.iterdir()))  # cached only once complete
    resumed = subprocess.run([sys.executable, "-m", "jaxflow.run", "--resume", f"--out={out}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step" in resumed.stdout
    warm = read_metrics(out / "warm_start" / "seed0" / "metrics.jsonl")
    assert [r["step"] for r in warm] == list(range(1, 41))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == 1 and len(summary["per_seed"]) == 1
    assert [r["rollout"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    (entry,) = cache.iterdir()
    assert (entry / "summary.json").exists() and finalized_steps(entry / "checkpoints")
