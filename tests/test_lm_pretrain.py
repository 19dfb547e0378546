"""lm_pretrain end to end: the four outputs, and exact resume after a real SIGKILL."""

import json

import pytest

from jaxflow.plots import read_metrics
from tests._cli import TINY_LM, compile_cache_env, run_cli

COMMON = ["--exp=lm_pretrain", "--variant=quick", "--devices=2", "--set", "train.log_every=1", *TINY_LM]
CONVENTION_KEYS = {"experiment", "variant", "argv", "seed", "config", "jax_version", "backend",
                   "device_count", "process_count", "wall_seconds", "git_commit"}
STEPS = ["--set", "train.steps=10", "--set", "train.checkpoint_every=5", "--set", "train.eval_every=5"]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """One persistent compilation cache for the module's runs (they run the same programs)."""
    return compile_cache_env(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache_env):
    """One uninterrupted 10-step run: the quick run's outputs and the resume's reference."""
    out = tmp_path_factory.mktemp("full") / "run"
    res = run_cli([*COMMON, *STEPS, f"--out={out}"], env_extra=cache_env)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_quick_run_writes_config_metrics_summary_and_plots(full_run):
    out = full_run
    config = json.loads((out / "config.json").read_text())
    assert config["experiment"] == "lm_pretrain" and config["config"]["train"]["steps"] == 10
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert "heldout_accuracy" in rows[4] and "heldout_accuracy" not in rows[3]
    summary = json.loads((out / "summary.json").read_text())
    assert CONVENTION_KEYS <= summary.keys()
    assert 0.0 <= summary["heldout_accuracy"] <= 1.0
    assert summary["final_loss"] == rows[-1]["last_loss"]
    assert (out / "plots" / "loss.png").stat().st_size > 1000


def test_resume_after_kill_is_bit_identical(tmp_path, full_run, cache_env):
    killed_dir = tmp_path / "killed"
    killed = run_cli([*COMMON, *STEPS, f"--out={killed_dir}", "--kill-after-checkpoint=5"],
                     env_extra=cache_env)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])  # SIGKILL
    assert not (killed_dir / "summary.json").exists()
    assert [r["step"] for r in read_metrics(killed_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    resumed = run_cli(["--resume", f"--out={killed_dir}"], env_extra=cache_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 5" in resumed.stdout

    a = json.loads((full_run / "summary.json").read_text())
    b = json.loads((killed_dir / "summary.json").read_text())
    assert a["params_checksum"] == b["params_checksum"]
    assert a["final_loss"] == b["final_loss"]
    rows_a = read_metrics(full_run / "metrics.jsonl")
    rows_b = read_metrics(killed_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"], r.get("heldout_accuracy")) for r in rows_a] == \
           [(r["step"], r["loss"], r.get("heldout_accuracy")) for r in rows_b]


def test_resume_of_missing_run_is_a_user_error(tmp_path):
    res = run_cli(["--resume", f"--out={tmp_path / 'nothing'}"])
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
