"""lm_pretrain end to end: the four outputs, and exact resume after a real SIGKILL."""

import json

from jaxflow.plots import read_metrics
from tests._cli import TINY_LM, run_cli

COMMON = ["--exp=lm_pretrain", "--variant=quick", "--devices=2", "--set", "train.log_every=1", *TINY_LM]
CONVENTION_KEYS = {"experiment", "variant", "argv", "seed", "config", "jax_version", "backend",
                   "device_count", "process_count", "wall_seconds", "git_commit"}


def test_quick_run_writes_config_metrics_summary_and_plots(tmp_path):
    out = tmp_path / "run"
    res = run_cli([*COMMON, "--set", "train.steps=6", "--set", "train.eval_every=3", f"--out={out}"])
    assert res.returncode == 0, res.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["experiment"] == "lm_pretrain" and config["config"]["train"]["steps"] == 6
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert "heldout_accuracy" in rows[2] and "heldout_accuracy" not in rows[1]
    summary = json.loads((out / "summary.json").read_text())
    assert CONVENTION_KEYS <= summary.keys()
    assert 0.0 <= summary["heldout_accuracy"] <= 1.0
    assert summary["final_loss"] == rows[-1]["last_loss"]
    assert (out / "plots" / "loss.png").stat().st_size > 1000


def test_resume_after_kill_is_bit_identical(tmp_path):
    steps = ["--set", "train.steps=10", "--set", "train.checkpoint_every=5", "--set", "train.eval_every=5"]
    full = run_cli([*COMMON, *steps, f"--out={tmp_path / 'full'}"])
    assert full.returncode == 0, full.stderr[-3000:]

    killed_dir = tmp_path / "killed"
    killed = run_cli([*COMMON, *steps, f"--out={killed_dir}", "--kill-after-checkpoint=5"])
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])  # SIGKILL
    assert not (killed_dir / "summary.json").exists()
    assert [r["step"] for r in read_metrics(killed_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    resumed = run_cli(["--resume", f"--out={killed_dir}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 5" in resumed.stdout

    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((killed_dir / "summary.json").read_text())
    assert a["params_checksum"] == b["params_checksum"]
    assert a["final_loss"] == b["final_loss"]
    rows_a = read_metrics(tmp_path / "full" / "metrics.jsonl")
    rows_b = read_metrics(killed_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"], r.get("heldout_accuracy")) for r in rows_a] == \
           [(r["step"], r["loss"], r.get("heldout_accuracy")) for r in rows_b]


def test_resume_of_missing_run_is_a_user_error(tmp_path):
    res = run_cli(["--resume", f"--out={tmp_path / 'nothing'}"])
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
