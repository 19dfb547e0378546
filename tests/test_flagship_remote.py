"""The flagship as two jobs -- a trainer job and a rollout job, each its own process (its own
``jax.distributed`` runtime), joined only by SparseRL-Sync over TCP -- equals the one-job run
whose roles have the same mesh shapes: the same sampled tokens (rewards, accept rates per
rollout), the same held-out pass@1 and the same sync payload bytes, bit for bit (same programs
on same-shaped meshes, same replica bits, same keys). The one-job run colocates its roles on
as many devices as the trainer job has, so its warm start (pretrained on every device of the
job) is the trainer job's too. And the faults: a
killed rollout job restarted within ``remote.timeout_s`` catches up from a full payload and the
run ends with the same figures; one that stays away ends the trainer with exit 75 naming it."""

import json
import subprocess
import sys
import time

import pytest

from jaxflow.plots import read_metrics
from tests._cli import ROOT, cli_env, free_port

SMALL = ["--exp=flagship", "--variant=quick", "--set", "rollouts=3", "--set", "eval.every=3",
         "--set", "eval.prompts=16", "--set", "eval.samples=2",
         "--set", "rl.prompts_per_rollout=4", "--set", "rl.group_size=4",
         "--set", "pretrain.train.steps=120", "--set", "pretrain.train.eval_examples=16"]
#: figures that are timings (differ run to run)
TIMING = ("seconds", "time", "per_s", "deliver", "throughput", "timing_s/", "perf/")


def _popen(args, out):
    return subprocess.Popen([sys.executable, "-m", "jaxflow.run", *SMALL, *args, f"--out={out}"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=420):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _figures(rows):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _two_jobs(tmp_path, name, *, kill_rollout_after=None, restart=True, timeout_s=60):
    cache = ["--set", f"cache_root={tmp_path / 'cache'}"]
    port = free_port()
    rollout_args = [*cache, "--devices=1", "--set", "remote.role=rollout",
                    "--set", f"remote.listen=127.0.0.1:{port}", "--set", f"remote.timeout_s={timeout_s}"]
    trainer = _popen([*cache, "--devices=1", "--set", "remote.role=trainer",
                      "--set", f"remote.rollout=127.0.0.1:{port}",
                      "--set", f"remote.timeout_s={timeout_s}"], tmp_path / f"{name}_trainer")
    rollout = _popen(rollout_args, tmp_path / f"{name}_rollout")
    if kill_rollout_after is not None:
        metrics = tmp_path / f"{name}_trainer" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
                metrics.exists() and len(read_metrics(metrics)) >= kill_rollout_after):
            time.sleep(0.2)
        rollout.kill()
        rollout.communicate()
        if restart:
            rollout = _popen(rollout_args, tmp_path / f"{name}_rollout2")
    deadline = time.monotonic() + 900
    while trainer.poll() is None and time.monotonic() < deadline:
        if rollout.poll() not in (None, 0) and restart:  # it failed by itself: stop the trainer
            trainer.kill()
        time.sleep(0.5)
    result = _finish(trainer, timeout=30)
    if result[0] != 0:  # the trainer failed: do not wait for the rollout job's own timeout
        rollout.kill()
    return result, _finish(rollout, timeout=120)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flagship_remote")
    code, out, err = _finish(_popen(["--set", f"cache_root={tmp / 'cache'}", "--devices=1",
                                     "--set", "devices=1"], tmp / "single"))
    assert code == 0, err[-3000:]
    return tmp, json.loads((tmp / "single" / "summary.json").read_text()), read_metrics(
        tmp / "single" / "metrics.jsonl")


@pytest.mark.multiprocess
def test_trainer_and_rollout_jobs_equal_the_one_job_run(single):
    tmp, s1, rows1 = single
    (tcode, _, terr), (rcode, _, rerr) = _two_jobs(tmp, "pair")
    assert tcode == 0, terr[-3000:]
    assert rcode == 0, rerr[-3000:]
    s2 = json.loads((tmp / "pair_trainer" / "summary.json").read_text())
    rows2 = read_metrics(tmp / "pair_trainer" / "metrics.jsonl")
    assert _figures(rows1) == _figures(rows2) != []  # rewards, accept rates, payload bytes
    for key in ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "sync_ratio_vs_dense",
                "sync_bit_exact"):
        assert s1[key] == s2[key], key
    (p1,), (p2,) = s1["per_seed"], s2["per_seed"]
    for key in ("sync_dense_bytes", "sync_sent_bytes", "sync_publishes", "reward_first5",
                "reward_last5", "heldout_greedy_accuracy_final", "heldout_pass_at_1_curve"):
        assert p1[key] == p2[key], key
    assert p2["sync_bit_exact"] is True and p2["sync_publishes"] == 3
    served = json.loads((tmp / "pair_rollout" / "summary.json").read_text())
    assert served["rollouts_served"] == 3 and served["replica_version"] == rows2[-1]["version/trainer"] + 2


@pytest.mark.multiprocess
def test_a_restarted_rollout_job_catches_up_and_the_run_is_unchanged(single):
    tmp, s1, rows1 = single
    (tcode, tout, terr), (rcode, _, rerr) = _two_jobs(tmp, "restart", kill_rollout_after=1)
    assert tcode == 0, terr[-3000:]
    assert rcode == 0, rerr[-3000:]
    rows2 = read_metrics(tmp / "restart_trainer" / "metrics.jsonl")
    assert _figures(rows1) == _figures(rows2)
    assert "waiting up to" in (tout + terr)  # the trainer reported the lost job and waited


@pytest.mark.multiprocess
def test_a_rollout_job_that_stays_lost_ends_the_trainer_with_75(single):
    tmp, _, _ = single
    (tcode, _, terr), _ = _two_jobs(tmp, "lost", kill_rollout_after=1, restart=False, timeout_s=3)
    assert tcode == 75, terr[-3000:]
    last = terr.strip().splitlines()[-1]
    assert "rollout endpoint 127.0.0.1:" in last and "lost" in last, last


def _job(args, out, *, coordinator, process_id, extra=()):
    return _popen([*args, "--devices=1", f"--coordinator=127.0.0.1:{coordinator}",
                   "--num-processes=2", f"--process-id={process_id}", *extra], out)


@pytest.mark.multiprocess
def test_two_trainer_and_two_rollout_processes_equal_one_job(tmp_path):
    """2 + 2 processes (each job its own coordinator) == one job of 2 devices with the roles
    colocated: the same roles' mesh shapes (2 devices each), so the same figures."""
    cache = ["--set", f"cache_root={tmp_path / 'cache'}"]
    code, _, err = _finish(_popen([*cache, "--devices=2", "--set", "devices=2",
                                   "--set", "roles.colocate=true"], tmp_path / "single"))
    assert code == 0, err[-3000:]
    port, c_train, c_roll = free_port(), free_port(), free_port()
    endpoints = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
    trainer = [_job([*cache, "--set", "remote.role=trainer", "--set", f"remote.rollout={endpoints}"],
                    tmp_path / "trainer", coordinator=c_train, process_id=i) for i in range(2)]
    rollout = [_job([*cache, "--set", "remote.role=rollout", "--set", f"remote.listen=127.0.0.1:{port}"],
                    tmp_path / "rollout", coordinator=c_roll, process_id=i) for i in range(2)]
    for proc in trainer + rollout:
        code, _, err = _finish(proc, timeout=900)
        assert code == 0, err[-3000:]
    s1 = json.loads((tmp_path / "single" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "trainer" / "summary.json").read_text())
    rows1 = read_metrics(tmp_path / "single" / "metrics.jsonl")
    rows2 = read_metrics(tmp_path / "trainer" / "metrics.jsonl")
    assert _figures(rows1) == _figures(rows2) != []
    for key in ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "sync_ratio_vs_dense",
                "sync_bit_exact"):
        assert s1[key] == s2[key], key
    assert s2["process_count"] == 2 and s2["per_seed"][0]["sync_bit_exact"] is True


@pytest.mark.multiprocess
def test_a_killed_trainer_job_resumes_and_the_rollout_job_follows(single):
    """The trainer job dies right after its rollout-1 checkpoint (``--kill-after-checkpoint``);
    the rollout job waits for it; the trainer restarted with ``--resume`` resets the replica to
    its checkpoint's version (it had moved past it) and the run ends with the one-job figures."""
    tmp, s1, rows1 = single
    cache = ["--set", f"cache_root={tmp / 'cache'}"]
    port = free_port()
    trainer_args = [*cache, "--devices=1", "--set", "remote.role=trainer", "--set", "checkpoint_every=1",
                    "--set", f"remote.rollout=127.0.0.1:{port}"]
    rollout = _popen([*cache, "--devices=1", "--set", "remote.role=rollout",
                      "--set", f"remote.listen=127.0.0.1:{port}"], tmp / "kill_rollout")
    code, _, err = _finish(_popen([*trainer_args, "--kill-after-checkpoint=1"], tmp / "kill_trainer"))
    assert code != 0, err[-2000:]
    code, _, err = _finish(_popen([*trainer_args, "--resume"], tmp / "kill_trainer"))
    assert code == 0, err[-3000:]
    rcode, _, rerr = _finish(rollout, timeout=120)
    assert rcode == 0, rerr[-3000:]
    rows2 = read_metrics(tmp / "kill_trainer" / "metrics.jsonl")
    assert _figures(rows1) == _figures(rows2)
    s2 = json.loads((tmp / "kill_trainer" / "summary.json").read_text())
    assert s1["heldout_pass_at_1_final"] == s2["heldout_pass_at_1_final"]
