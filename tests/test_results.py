"""jaxflow.results: records (round trip, digest), templates (literal figures), pages rendered
from records (edited page detected, stale marking), and ``--record`` from a fake run."""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxflow import provenance, results
from jaxflow.results import check as checks
from jaxflow.results import render

EXP = "bench_policy_loss"  # any registered experiment: its measured paths are looked up under tmp roots


def _headline(value=1.25, low=1.1, high=1.4):
    return {"name": "speed_vs_strongest", "metric": "steps/s ratio", "algorithm": "fused",
            "baseline": "packed", "baseline_rule": "best steps/s of the baselines measured: padded, packed",
            "baselines": {"padded": 10.0, "packed": 12.0}, "value": value, "unit": "x",
            "higher_is_better": True,
            "spread": {"kind": "pairs", "n": 10, "low": low, "high": high, "interval": "range of alternated pairs"},
            "target": 1.5, "target_text": ">= 1.5x the strongest baseline", "met": value >= 1.5}


def _run_dir(tmp_path: pathlib.Path, headlines=True, name="run") -> pathlib.Path:
    run = tmp_path / "runs" / name
    run.mkdir(parents=True)
    summary = {"experiment": EXP, "variant": "quick", "argv": ["python -m jaxflow.run", f"--exp={EXP}",
                                                                "--set", "steps=3"],
               "seed": 0, "jax_version": "0.0", "backend": "cpu", "device_count": 8, "process_count": 1,
               "wall_seconds": 12.5, "git_commit": None, "overhead": 1.07, "flag": True}
    if headlines:
        summary["headlines"] = [_headline()]
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "config.json").write_text(json.dumps({"overrides": ["steps=3"]}))
    return run


@pytest.fixture
def root(tmp_path):
    """A repository root with one measured file, a template and the README / mkdocs markers."""
    repo = tmp_path / "repo"
    (repo / "jaxflow" / "rl").mkdir(parents=True)
    (repo / "jaxflow" / "rl" / "loss.py").write_text("x = 1\n")
    (repo / "experiments" / "pages").mkdir(parents=True)
    (repo / "experiments" / "pages" / f"{EXP}.md").write_text(
        f"# {EXP}\n\nFused is {{{{{EXP}.speed_vs_strongest}}}} the packed step (`--variant=quick`, 3 seeds).\n")
    (repo / "README.md").write_text(f"# x\n\n{render.README_BEGIN}\nold\n{render.README_END}\n\nrest\n")
    (repo / "mkdocs.yml").write_text(f"nav:\n  - Home: index.md\n{render.NAV_BEGIN}\n{render.NAV_END}\n")
    return repo


def _record(root, tmp_path, **kw) -> pathlib.Path:
    return results.record_run(_run_dir(tmp_path, **kw), root=root, load_start=1.5, load_end=2.0)


def test_record_round_trip(root, tmp_path):
    path = _record(root, tmp_path)
    rec = json.loads(path.read_text())
    assert path.parent == root / "experiments" / "results" / EXP
    assert path.name == f"{rec['date'][:10]}-{rec['machine']['short']}-quick.json"
    assert rec["headlines"] == [_headline()] and rec["key_figures"] == {} and rec["headlines_note"] is None
    assert rec["overrides"] == ["steps=3"] and rec["load"] == {"start_1min": 1.5, "end_1min": 2.0}
    assert rec["measured_hash"] == provenance.measured_hash(rec["measured_paths"], root)
    assert rec["machine"]["cores"] >= 1 and rec["wall_seconds"] == 12.5
    assert results.digest_problem(rec) is None and rec["digest"] == results.record_digest(rec)
    again = _record(root, tmp_path / "second")
    assert again.name.endswith("-quick-2.json")  # the same day, machine and variant: not overwritten


def test_record_without_headlines_keeps_the_key_figures(root, tmp_path):
    rec = json.loads(_record(root, tmp_path, headlines=False).read_text())
    assert rec["headlines"] == [] and "no headlines" in rec["headlines_note"]
    assert rec["key_figures"] == {"overhead": 1.07}  # bookkeeping keys and booleans left out
    run = _run_dir(tmp_path, headlines=False, name="failed_builder")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary | {"headlines": [], "headlines_error": "KeyError: 'rows'"}))
    rec = results.build_record(run, root=root)
    assert rec["headlines_note"].startswith("the headline builder failed (KeyError: 'rows')")


def test_bad_run_dir_and_headlines_are_one_line_errors(root, tmp_path):
    with pytest.raises(results.ResultsError, match="no summary.json"):
        results.build_record(tmp_path / "nowhere", root=root)
    run = _run_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    del summary["headlines"][0]["unit"]
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(results.ResultsError, match=r"lacks \['unit'\]"):
        results.build_record(run, root=root)
    with pytest.raises(results.ResultsError, match="no measured paths; valid: .*flagship"):
        results.measured_paths("flagshp")


def test_digest_mismatch_is_detected(root, tmp_path):
    path = _record(root, tmp_path)
    results.render_all(root, [EXP])
    assert checks.check(root, [EXP]) == []
    rec = json.loads(path.read_text())
    rec["headlines"][0]["value"] = 9.99
    path.write_text(json.dumps(rec))
    problems = checks.check(root, [EXP])
    assert any(p.startswith(f"experiments/results/{EXP}/") and "does not match its content" in p
               for p in problems), problems


def test_edited_page_is_detected_and_render_restores_it(root, tmp_path):
    _record(root, tmp_path)
    written = results.render_all(root, [EXP])
    assert set(written) == {f"docs/experiments/{EXP}.md", "experiments/README.md", "README.md", "mkdocs.yml"}
    page = root / "docs" / "experiments" / f"{EXP}.md"
    text = page.read_text()
    assert "1.25x [1.1, 1.4] (" in text and "| packed (strongest of packed, padded) |" in text
    assert "{{" not in text and "current" in text
    assert "rest" in (root / "README.md").read_text() and "old" not in (root / "README.md").read_text()
    assert f"experiments/{EXP}.md" in (root / "mkdocs.yml").read_text()
    page.write_text(text.replace("1.25x", "1.5x"))
    assert checks.check(root, [EXP]) == [f"docs/experiments/{EXP}.md: differs from its render (edited by hand, "
                                          f"or a record or the measured code changed); run python -m "
                                          f"jaxflow.results render"]
    assert results.render_all(root, [EXP]) == [f"docs/experiments/{EXP}.md"]
    assert checks.check(root, [EXP]) == []


def test_changed_measured_code_marks_the_record_stale(root, tmp_path):
    _record(root, tmp_path)
    results.render_all(root, [EXP])
    index = root / "experiments" / "README.md"
    assert index.read_text().endswith("| current |\n")
    (root / "jaxflow" / "rl" / "loss.py").write_text("x = 2\n")  # the code the record measured moved
    assert any(p.startswith("experiments/README.md: differs") for p in checks.check(root, [EXP]))
    results.render_all(root, [EXP])
    assert index.read_text().endswith("| **stale** |\n")
    assert ", stale)" in (root / "docs" / "experiments" / f"{EXP}.md").read_text()
    assert checks.check(root, [EXP]) == []


def test_an_experiment_without_a_record_says_so(root):
    results.render_all(root, [EXP])
    assert f"| {render.NO_RECORD} |" in (root / "experiments" / "README.md").read_text()
    assert f"({render.NO_RECORD})" in (root / "docs" / "experiments" / f"{EXP}.md").read_text()


def test_template_literal_figures_are_rejected(root):
    text = ("Gain {{a.b}} is 0.89 here, 6x there and `1.5x` in code; 3 seeds on 2026-12-06, v0.10.2, "
            "12% waste\n```\nrun --lr 0.5\n```\n")
    assert results.literal_figures(text) == [(1, "0.89"), (1, "6x"), (1, "12%")]
    (root / "experiments" / "pages" / f"{EXP}.md").write_text("# x\n\nIt is 1.5x faster.\n")
    results.render_all(root, [EXP])
    assert checks.check(root, [EXP]) == [f"experiments/pages/{EXP}.md:3: literal figure '1.5x' outside a "
                                          f"placeholder; valid: {{{{experiment.figure}}}} filled from a record, "
                                          f"or inline code"]


def test_unknown_placeholder_is_reported(root, tmp_path):
    _record(root, tmp_path)
    (root / "experiments" / "pages" / f"{EXP}.md").write_text(f"# x\n\n{{{{{EXP}.no_such_figure}}}}\n")
    results.render_all(root, [EXP])
    assert any("placeholder {{bench_policy_loss.no_such_figure}} names no figure" in p
               for p in checks.check(root, [EXP]))


def test_prefix_placeholder_fills_every_matching_figure_named(root, tmp_path):
    _record(root, tmp_path)
    (root / "experiments" / "pages" / f"{EXP}.md").write_text(
        f"# x\n\nAll: {{{{{EXP}.speed*}}}}; every: {{{{{EXP}.*}}}}; none: {{{{{EXP}.nope*}}}}\n")
    results.render_all(root, [EXP])
    page = (root / "docs" / "experiments" / f"{EXP}.md").read_text()
    machine = results.machine_info()["short"]
    assert f"All: `speed_vs_strongest` 1.25x [1.1, 1.4] ({machine}, quick); every: `speed_vs_strongest`" in page
    assert [p for p in checks.check(root, [EXP]) if "placeholder" in p] == [
        f"experiments/pages/{EXP}.md: placeholder {{{{{EXP}.nope*}}}} names no figure of a record; "
        f"valid: a headline name or key figure of {EXP}'s records"]


def test_a_spread_of_one_round_is_shown_as_none(root, tmp_path):
    one = _headline(value=1.2, low=1.2, high=1.2)
    one["spread"] |= {"kind": "rounds", "n": 1}
    run = _run_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary | {"headlines": [one]}))
    results.record_run(run, root=root, load_start=1.5, load_end=2.0)
    results.render_all(root, [EXP])
    page = (root / "docs" / "experiments" / f"{EXP}.md").read_text()
    assert f"Fused is 1.2x ({results.machine_info()['short']}, quick) the packed step" in page
    assert "| 1.2x | one round only, no spread |" in page and "[1.2, 1.2]" not in page


def test_a_headline_note_is_shown_wherever_its_figure_is(root, tmp_path):
    noted = _headline() | {"stale": True, "note": "(stale calibration: measured code changed since abc)"}
    run = _run_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary | {"headlines": [noted]}))
    results.record_run(run, root=root, load_start=1.5, load_end=2.0)
    results.render_all(root, [EXP])
    page = (root / "docs" / "experiments" / f"{EXP}.md").read_text()
    assert "Fused is 1.25x [1.1, 1.4] (stale calibration: measured code changed since abc) (" in page
    assert "| 1.25x (stale calibration: measured code changed since abc) |" in page
    assert "(stale calibration: measured code changed since abc)" in (root / "experiments" / "README.md").read_text()


def test_measured_hash_reads_contents_and_honours_excludes(tmp_path):
    (tmp_path / "pkg" / "sim").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("a")
    (tmp_path / "pkg" / "sim" / "b.py").write_text("b")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    whole = provenance.measured_hash(["pkg"], tmp_path)
    without_sim = provenance.measured_hash(["pkg", ":(exclude)pkg/sim"], tmp_path)
    assert whole != without_sim
    (tmp_path / "pkg" / "sim" / "b.py").write_text("changed")
    assert provenance.measured_hash(["pkg", ":(exclude)pkg/sim"], tmp_path) == without_sim
    assert provenance.measured_hash(["pkg"], tmp_path) != whole
    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"\1")  # caches are not code
    assert provenance.measured_hash(["pkg", ":(exclude)pkg/sim"], tmp_path) == without_sim


def test_every_experiment_has_measured_paths_that_exist():
    from jaxflow.config import experiment_names

    names = experiment_names()
    assert sorted(results.MEASURED_PATHS) == names, (
        f"experiments without measured paths: {sorted(set(names) - set(results.MEASURED_PATHS))}, "
        f"registered but absent: {sorted(set(results.MEASURED_PATHS) - set(names))} (jaxflow/results/registry.py)")
    absent = [(n, p) for n, paths in results.MEASURED_PATHS.items() for p in paths
              if not p.startswith(":") and not (provenance.REPO_ROOT / p).exists()]
    assert not absent, absent


def test_machine_short_name():
    info = {"cpu_model": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "cores": 2, "flags": ["avx512f"]}
    assert results.short_name(info) == "intel-xeon-platinum-8481c-2c-avx512"
    assert results.short_name({"cpu_model": "AMD EPYC 7B13", "cores": 2, "flags": []}) == "amd-epyc-7b13-2c"

