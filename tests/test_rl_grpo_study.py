"""sis_offpolicy end to end (tiny): warm start cache, results rows, exact resume after SIGKILL."""

import json

from jaxflow.plots import read_metrics
from jaxflow.rl.offpolicy_cells import grid_cells
from jaxflow.rl.step_metrics import deterministic_fields
from tests._cli import compile_cache_env, run_cli

TINY = [
    "--set", "pretrain.model.d_model=32", "--set", "pretrain.model.n_layers=1",
    "--set", "pretrain.model.n_heads=2", "--set", "pretrain.model.n_kv_heads=2",
    "--set", "pretrain.model.d_ff=64", "--set", "pretrain.train.steps=10",
    "--set", "pretrain.train.batch_size=8", "--set", "pretrain.train.eval_examples=16",
    "--set", "pretrain.train.eval_every=10", "--set", "pretrain.train.checkpoint_every=10",
    "--set", "grid.algos=grpo", "--set", "grid.corrections=sis", "--set", "grid.lags=2",
    "--set", "grid.mismatches=", "--set", "grid.seeds=1",
    "--set", "train.rollouts=4", "--set", "train.checkpoint_every=2",
    "--set", "train.eval_every=2", "--set", "train.eval_examples=16",
    "--set", "train.eval_samples=1",
    "--set", "rl.prompts_per_rollout=2", "--set", "rl.group_size=4",
]
ROW_KEYS = {"algo", "correction", "mismatch", "lag", "seeds", "acc_mean", "acc_std",
            "accept_rate"}


def test_grid_cells_cover_the_blocks():
    from configs.sis_offpolicy import get_config

    grid = get_config("default").grid
    cells = grid_cells(grid)
    assert len(cells) == (4 * 2 * 4 + 4) * 3
    assert len({c.label for c in cells}) == len(cells)
    assert {c.mismatch for c in cells} == {"none", "noise0.3"}


def test_study_runs_and_resumes_bit_identically(tmp_path):
    common = ["--exp=sis_offpolicy", "--variant=quick", "--devices=2", *TINY,
              "--set", f"cache_root={tmp_path / 'cache'}"]
    xla_cache = compile_cache_env(tmp_path / "xla_cache")  # the three runs share their programs
    full = run_cli([*common, f"--out={tmp_path / 'full'}"], env_extra=xla_cache, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "roles: disjoint: trainer 1 device(s), rollout 1 device(s)" in full.stdout
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the cached warm start
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    (row,) = summary["results"]
    assert ROW_KEYS <= row.keys() and row["seeds"] == 1 and 0 <= row["acc_mean"] <= 1

    killed_dir = tmp_path / "killed"
    # the fault step is the global logged step: cell 0, rollout 2
    killed = run_cli([*common, f"--out={killed_dir}", "--kill-after-checkpoint=2"],
                     env_extra=xla_cache, timeout=600)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    assert "training lm_pretrain" not in killed.stdout  # reused the cache
    resumed = run_cli(["--resume", f"--out={killed_dir}"], env_extra=xla_cache, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 2" in resumed.stdout

    again = json.loads((killed_dir / "summary.json").read_text())
    assert again["params_checksums"] == summary["params_checksums"]
    assert again["results"] == summary["results"]
    assert [deterministic_fields(r) for r in read_metrics(killed_dir / "metrics.jsonl")] == \
        [deterministic_fields(r) for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
