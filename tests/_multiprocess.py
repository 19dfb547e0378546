"""Run ``python -m jaxflow.run`` as one process on 8 fake devices and as 2 real processes
(jax.distributed on 127.0.0.1, gloo) x 4 devices: the same global mesh."""

import json
import subprocess
import sys

from jaxflow.plots import read_metrics
from tests._cli import ROOT, cli_env, free_port


def _env() -> dict:
    return cli_env(JAX_PLATFORMS="cpu")


def single_and_two_processes(args: list[str], tmp_path, timeout: int = 600):
    """Runs ``args`` once with --devices=8 and once as 2 processes x 4 devices, all three
    processes at once; asserts every exit 0 and that only process 0 wrote the run's files.
    Returns (single, multi): each (summary dict, metrics rows)."""
    single, multi, port = tmp_path / "single", tmp_path / "multi", free_port()
    cmd = [sys.executable, "-m", "jaxflow.run", *args]
    procs = [subprocess.Popen([*cmd, "--devices=8", f"--out={single}"], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    procs += [subprocess.Popen([*cmd, "--devices=4", f"--coordinator=127.0.0.1:{port}",
                                "--num-processes=2", f"--process-id={i}", f"--out={multi}"],
                               cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "wrote" in outs[1][0] and "wrote" not in outs[2][0]  # process 0 alone writes
    results = []
    for out in (single, multi):
        results.append((json.loads((out / "summary.json").read_text()),
                        read_metrics(out / "metrics.jsonl")))
    assert results[0][0]["process_count"] == 1 and results[1][0]["process_count"] == 2
    assert results[0][0]["device_count"] == results[1][0]["device_count"] == 8
    return results
