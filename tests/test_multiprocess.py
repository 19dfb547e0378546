"""Two real processes (jax.distributed on 127.0.0.1, gloo) == one process on the same 8 devices."""

import json
import subprocess
import sys

from jaxflow.plots import read_metrics
from tests._cli import ROOT, TINY_LM, cli_env, free_port, run_cli

ARGS = ["--exp=lm_pretrain", "--variant=quick", "--set", "train.steps=4", "--set", "train.log_every=1",
        "--set", "train.eval_every=4", "--set", "mesh.shape=4,2", *TINY_LM]


def test_two_processes_match_single_process_loss_curve(tmp_path):
    single = run_cli([*ARGS, "--devices=8", f"--out={tmp_path / 'single'}"])
    assert single.returncode == 0, single.stderr[-3000:]

    port = free_port()
    out = tmp_path / "multi"
    env = cli_env(JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxflow.run", *ARGS, "--devices=4", f"--coordinator=127.0.0.1:{port}",
             "--num-processes=2", f"--process-id={i}", f"--out={out}"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    results = [p.communicate(timeout=400) for p in procs]
    for p, (_, se) in zip(procs, results):
        assert p.returncode == 0, se[-3000:]
    assert "wrote" in results[0][0] and "wrote" not in results[1][0]  # only process 0 reports/writes

    summary = json.loads((out / "summary.json").read_text())
    assert summary["process_count"] == 2 and summary["device_count"] == 8
    rows_multi = read_metrics(out / "metrics.jsonl")
    rows_single = read_metrics(tmp_path / "single" / "metrics.jsonl")
    # one writer: exactly one row per step
    assert [r["step"] for r in rows_multi] == [1, 2, 3, 4] == [r["step"] for r in rows_single]
    for a, b in zip(rows_single, rows_multi):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
    single_summary = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert summary["heldout_accuracy"] == single_summary["heldout_accuracy"]
