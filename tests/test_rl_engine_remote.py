"""The two-job flagship with ``rl.sampler=engine``: the rollout job samples through the engine
following its SparseRL-Sync replica in place, and the run equals the one-job engine run bit for
bit (tokens, rewards, accept rates, payload bytes, held-out pass@1), every token stamped with
the version the trainer published (the per-token versions cross the wire with the batch).

The runs of ``tests/test_flagship_remote.py`` (its helpers, with ``--set rl.sampler=engine``
added to every command)."""

import json

import pytest

import tests.test_flagship_remote as remote
from jaxflow.plots import read_metrics

ENGINE = ["--set", "rl.sampler=engine"]


@pytest.mark.multiprocess
def test_two_jobs_with_the_engine_equal_the_one_job_engine_run(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(remote, "SMALL", [*remote.SMALL, *ENGINE])
        code, _, err = remote._finish(remote._popen(
            ["--set", f"cache_root={tmp_path / 'cache'}", "--devices=1", "--set", "devices=1"],
            tmp_path / "single"))
        assert code == 0, err[-3000:]
        (tcode, _, terr), (rcode, _, rerr) = remote._two_jobs(tmp_path, "pair")
    assert tcode == 0, terr[-3000:]
    assert rcode == 0, rerr[-3000:]
    rows1 = read_metrics(tmp_path / "single" / "metrics.jsonl")
    rows2 = read_metrics(tmp_path / "pair_trainer" / "metrics.jsonl")
    assert remote._figures(rows1) == remote._figures(rows2) != []
    for r in rows2:  # every token of rollout r sampled by the version published before it
        assert r["version/sampler_min"] == r["version/sampler_max"] == r["version/sampler"]
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text())
              for d in ("single", "pair_trainer"))
    for key in ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "sync_ratio_vs_dense",
                "sync_bit_exact"):
        assert s1[key] == s2[key], key
    config = json.loads((tmp_path / "pair_rollout" / "config.json").read_text())
    assert config["config"]["rl"]["sampler"] == "engine"
