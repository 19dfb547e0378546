"""``python -m jaxflow.run ... --record``: the code state at the run's start, the record at its
end, the pages rendered (a fake entry: the experiment itself is not under test)."""

from __future__ import annotations

import json

import pytest

from jaxflow import provenance, results
from jaxflow.results import check as checks
from tests.test_results import EXP, _headline


@pytest.fixture
def root(tmp_path):
    """A repository root holding one file of the experiment's measured paths."""
    repo = tmp_path / "repo"
    (repo / "jaxflow" / "rl").mkdir(parents=True)
    (repo / "jaxflow" / "rl" / "loss.py").write_text("x = 1\n")
    return repo


def test_record_flag_records_the_finished_run_and_renders(root, tmp_path, monkeypatch, capsys):
    from jaxflow import run as runner
    from jaxflow.config import ExperimentSpec

    def entry(config, run):  # the experiment itself is not under test: a fake with one headline
        (root / "jaxflow" / "rl" / "loss.py").write_text("x = 3\n")  # edited mid-run: the start's hash counts
        monkeypatch.setattr(provenance, "git_commit", lambda *a, **k: "b" * 40)  # and committed: the start's commit
        return {"headlines": [_headline()], "overhead": 1.07}

    started = provenance.measured_hash(results.measured_paths(EXP), root)
    monkeypatch.setattr(provenance, "REPO_ROOT", root)
    monkeypatch.setattr(provenance, "git_commit", lambda *a, **k: "a" * 40)
    monkeypatch.setattr(ExperimentSpec, "entry_fn", lambda self: entry)
    # the experiment's own headline builder would read a real summary: the fake's headlines stand
    monkeypatch.setattr("jaxflow.study.report.with_headlines", lambda summary, *a, **k: dict(summary),
                        raising=False)
    out = tmp_path / "run"
    assert runner.main([f"--exp={EXP}", "--variant=quick", "--record", f"--out={out}", "--no-tensorboard"]) == 0
    (path,) = (root / "experiments" / "results" / EXP).glob("*.json")
    assert f"recorded {path}" in capsys.readouterr().out
    rec = json.loads(path.read_text())
    assert rec["measured_hash"] == started and rec["measured_at"] == "run start" and rec["commit"] == "a" * 40
    assert rec["experiment"] == EXP and rec["variant"] == "quick" and rec["load"]["start_1min"] is not None
    assert results.digest_problem(rec) is None
    assert "| **stale** |" in (root / "experiments" / "README.md").read_text()  # the code moved since
    problems = checks.check(root)  # every experiment rendered; only the page texts the tmp root lacks
    assert problems and all(p.endswith("missing; valid: a page text for every experiment") for p in problems)
