"""Simulator calibrations are data with provenance: written from a run's summary, read back,
reported in the simulators' summaries, warned about when the measured code changed since the
recorded commit; per-input sensitivities; bench_embedding's sparse baseline is row-wise Adagrad."""

import json
import pathlib
import subprocess
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow import provenance
from jaxflow import run as runner
from jaxflow.marl import simulate as marl_sim
from jaxflow.nestpipe import simulate as np_sim

PROV = {"git_commit": "0123456789abcdef0123456789abcdef01234567", "devices": 8,
        "command": "python -m jaxflow.run --exp=nestpipe --variant=quick --set calibration_out=x",
        "date": "2026-12-01 12:00 UTC", "measured_paths": ["jaxflow/nestpipe"]}

NESTPIPE_SUMMARY = {
    "stage_seconds": {"sync": {"data": 0.0055, "h2d": 0.0011, "route": 0.0129, "retrieve": 0.0035,
                               "compute": 0.0145, "write_back": 0.0014, "exchange": 0.0031},
                      "dbp": {"patch": 0.0016}},
    "step_seconds": {"sync": 0.0437, "dbp": 0.0445}, "speedup_vs_sync": {"sync": 1.0, "dbp": 0.97},
    "owner_rows_per_step": {"sync": [1300.0, 1250.0]}, "patched_rows_per_step": {"dbp": 3487.0},
    "config": {"batch_size": 2048, "multi_hot": 4, "embed_dim": 32, "vocab_sizes": [10, 20]},
    "micro_batches": 4}

FLEXMARL_SUMMARY = {
    "config": {"steps": 4, "n_inputs": 4}, "baseline_samples_per_s": 900.0,
    "baseline_utilisation": {"rollout": 0.75, "train/solver": 0.14, "train/verifier": 0.09},
    "samples_per_s": 950.0, "speedup_vs_sync": 1.05, "ideal_speedup_bound": 1.28, "reps": 10,
    "calibration_counts": {"agents": 2, "group_size": 4, "decode_steps": 124.0,
                           "solver_sample_tokens": 11, "solver_params": 85184.0,
                           "params": {"solver": 85184.0, "verifier": 11808.0}}}

_SCALE = ["--set", "workers=128,1536", "--set", "repeats=1", "--set", "batches=8",
          "--set", "warmup=2", "--set", "jitter_cv=0", "--set", "sensitivity_cv=0",
          "--set", "sensitivity_micro_batches=", "--set", "sensitivity_peer_latency_us=",
          "--set", "sensitivity_oversubscription=", "--set", "sensitivity_device_copy_speedup="]


@pytest.fixture(scope="module")
def nestpipe_scale_summary(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("np")
    path = np_sim.write_calibration(tmp / "cal.json", NESTPIPE_SUMMARY, PROV)
    out = tmp / "run"
    with pytest.warns(np_sim.CalibrationWarning, match="cannot check"):  # commit unknown here
        assert runner.main(["--exp=nestpipe_scale", "--variant=quick", f"--out={out}",
                            "--set", f"calibration={path}", *_SCALE]) == 0
    return path, json.loads((out / "summary.json").read_text())


def test_nestpipe_calibration_round_trip(nestpipe_scale_summary):
    path, summary = nestpipe_scale_summary
    cal = np_sim.load_calibration(path)
    sync = NESTPIPE_SUMMARY["stage_seconds"]["sync"]
    assert cal.stage_ms == pytest.approx({**{k: 1e3 * sync[k] for k in np_sim.HOST_STAGES},
                                          "patch": 1.6})
    assert cal.context["sync_samples_per_s"] == pytest.approx(2048 / 0.0437)
    got = summary["calibration"]
    assert {k: got[k] for k in ("git_commit", "command", "devices")} == {
        k: PROV[k] for k in ("git_commit", "command", "devices")}
    assert got["path"] == path and got["stale"] is None and "cannot check" in got["warning"]
    assert summary["calibration_ms"] == pytest.approx(cal.stage_ms)
    # in-sample check renamed; out-of-sample checks carry the paper's figure and the prediction
    assert "validation_passed" not in summary and "baseline_consistency_passed" in summary
    assert "paper_checks_passed" not in summary  # each check reports its error and tolerance
    for c in summary["paper_checks"].values():
        assert c["relative_error"] == pytest.approx(c["predicted"] / c["paper"] - 1)
        assert c["rel_tol"] == summary["paper_checks_rel_tol"] and "passed" not in c
        assert c["within_tolerance"] == (abs(c["relative_error"]) <= c["rel_tol"])
    for by_group in summary["exposed_ms_at_max_workers"].values():  # never negative
        assert min(by_group.values()) >= 0.0
    (head,) = summary["headlines"]  # one simulated figure; the calibration's commit is unknown here
    assert head["name"] == "simulated_speedup_at_max_workers" and head["baseline"] == "sync"
    assert head["stale"] is None and "calibration not checked" in head["note"]


def test_nestpipe_sensitivity_keys_and_invariants(nestpipe_scale_summary):
    _, summary = nestpipe_scale_summary
    sens = summary["sensitivity"]["calibration"]
    assert set(sens) == set(np_sim.STAGE_KEYS)
    for by_factor in sens.values():
        assert set(by_factor) == {"x0.5", "x2"}
        for row in by_factor.values():
            assert set(row) == set(np_sim.PIPELINES)
            # no variance: a serial step is the sum of the means, which the shares fix, so the
            # baseline's efficiency cannot move with how the groups are split
            assert row["sync"]["efficiency"] == pytest.approx(summary["identity_efficiency"])
            assert row["sync"]["speedup_vs_sync"] == 1.0
    # the patch is work only the dual buffer does: more of it never speeds dbp up
    for p in ("dbp", "dbp+fwp"):
        assert (sens["patch"]["x0.5"][p]["speedup_vs_sync"]
                >= sens["patch"]["x2"][p]["speedup_vs_sync"] - 1e-12)


def test_flexmarl_calibration_round_trip_and_sensitivity(tmp_path):
    prov = dict(PROV, command="python -m jaxflow.run --exp=flexmarl --variant=quick", devices=1,
                measured_paths=["jaxflow/marl"])
    path = marl_sim.write_calibration(tmp_path / "cal.json", FLEXMARL_SUMMARY, prov)
    m = marl_sim.load_measurement(path).measured
    assert m.decode_steps_per_input == pytest.approx(124.0 / 16)
    assert m.busy_train_verifier == 0.09 and m.solver_params == 85184.0
    out = tmp_path / "run"
    with pytest.warns(marl_sim.CalibrationWarning):
        assert runner.main(["--exp=flexmarl_scale", "--variant=quick", f"--out={out}",
                            "--set", f"calibration={path}", "--set", "nodes=1,2",
                            "--set", "inputs_per_node=2", "--set", "versions=2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    got = summary["calibration"]
    assert (got["git_commit"], got["command"], got["devices"], got["path"]) == (
        prov["git_commit"], prov["command"], 1, path)
    assert set(summary["paper_checks"]) == {"speedup_up_to", "utilisation_ratio_up_to"}
    sens = summary["sensitivity"]["calibration"]
    assert set(sens) == set(marl_sim.COST_KEYS)
    base = lambda key, f: sens[key][f]["baseline_samples_per_s_at_2"]  # noqa: E731
    for key in ("weight", "seq", "publish"):  # a costlier lockstep step is never faster
        assert base(key, "x0.5") >= base(key, "x2")
    # train_token fixes the absolute scale: x2 makes every other cost relatively half
    assert base("train_token", "x0.5") <= base("train_token", "x2")


def test_sync_counts_from_a_run():
    spec = types.SimpleNamespace(group_size=4, max_new_tokens=6)
    rt = lambda n: types.SimpleNamespace(  # noqa: E731
        spec=spec, sampler=types.SimpleNamespace(prompt_width=5),
        fns=types.SimpleNamespace(abstract_params=lambda: {"w": np.zeros((n, 3)), "b": np.zeros(n)}))
    run = types.SimpleNamespace(engine={"calls": 32, "row_steps": 370, "useful_row_steps": 367,
                                        "padded_row_steps": 384},
                                samples=128)
    c = marl_sim.sync_counts([run], {"solver": rt(10), "verifier": rt(2)}, ["solver", "verifier"])
    assert c["decode_steps"] == 32 + 370 / 4 and c["solver_sample_tokens"] == 11
    assert c["params"] == {"solver": 40.0, "verifier": 8.0} and c["solver_params"] == 40.0


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                   check=True, capture_output=True)


def test_stale_calibration_warning(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "other.py").write_text("y = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "init")
    commit = provenance.git_commit(tmp_path)
    assert commit and len(commit) == 40
    assert provenance.stale_calibration(commit, ["pkg"], tmp_path) == (False, None)
    (tmp_path / "other.py").write_text("y = 2\n")  # outside the measured paths
    assert provenance.stale_calibration(commit, ["pkg"], tmp_path) == (False, None)
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    stale, why = provenance.stale_calibration(commit, ["pkg"], tmp_path)
    assert stale is True and "changed since" in why and commit[:12] in why
    assert provenance.git_dirty_paths(["pkg"], tmp_path) == ["pkg/a.py"]
    cal = np_sim.Calibration({}, {"git_commit": commit, "measured_paths": ["pkg"]}, "c.json")
    with pytest.warns(np_sim.CalibrationWarning, match="changed since"):
        assert np_sim.calibration_summary(cal, tmp_path)["stale"] is True
    stale, why = provenance.stale_calibration("f" * 40, ["pkg"], tmp_path)
    assert stale is None and "cannot check" in why

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance, "_git", no_git)
    stale, why = provenance.stale_calibration(commit, ["pkg"], tmp_path)
    assert stale is None and "git unavailable" in why
    assert provenance.git_commit(tmp_path) is None


def test_sparse_baseline_is_rowwise_adagrad_on_touched_rows():
    from jaxflow.embeddings import TableSpec
    from jaxflow.embeddings.bench import dense_baseline_step, sparse_baseline_step

    v, d, lr, eps = 7, 3, 0.1, 1e-8
    specs = [TableSpec("t0", v, d, "row_wise", "sum"), TableSpec("t1", v, d, "row_wise", "sum")]
    rng = np.random.default_rng(0)
    tables = {s.name: rng.standard_normal((v, d)).astype(np.float32) for s in specs}
    accum = {s.name: rng.uniform(0.0, 0.5, v).astype(np.float32) for s in specs}
    ids = {"t0": np.array([[1, 1], [3, -1], [1, 5]], np.int32),  # duplicates and padding
           "t1": np.array([[0, 6], [6, 6], [-1, -1]], np.int32)}
    w = {s.name: rng.standard_normal((3, d)).astype(np.float32) for s in specs}
    want_t, want_a = {}, {}
    for s in specs:  # by hand: loss = sum ||pooled - w||^2 / B
        t, a, i = tables[s.name].astype(np.float64), accum[s.name].astype(np.float64), ids[s.name]
        pooled = np.stack([sum(t[j] for j in row if j >= 0) if (row >= 0).any() else np.zeros(d)
                           for row in i])
        g_pooled = 2 * (pooled - w[s.name]) / 3
        g = np.zeros((v, d))
        for b, row in enumerate(i):
            for j in row[row >= 0]:
                g[j] += g_pooled[b]
        touched = np.unique(i[i >= 0])
        a, t = a.copy(), t.copy()
        a[touched] += np.mean(g[touched] ** 2, -1)
        t[touched] -= lr * g[touched] / (np.sqrt(a[touched])[:, None] + eps)
        want_t[s.name], want_a[s.name] = t, a
    copy = lambda x: {k: jnp.asarray(np.array(val)) for k, val in x.items()}  # noqa: E731
    got_t, got_a = sparse_baseline_step(specs, lr, eps)(copy(tables), copy(accum), ids, w)
    dense_t, dense_a = dense_baseline_step(specs, None, lr, eps)(copy(tables), copy(accum), ids, w)
    for s in specs:
        np.testing.assert_allclose(np.asarray(got_t[s.name]), want_t[s.name], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_a[s.name]), want_a[s.name], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(got_t[s.name]), np.asarray(dense_t[s.name]),
                                   rtol=1e-6, atol=1e-6)
        untouched = np.setdiff1d(np.arange(v), ids[s.name][ids[s.name] >= 0])
        assert np.array_equal(np.asarray(got_t[s.name])[untouched], tables[s.name][untouched])
        assert np.array_equal(np.asarray(got_a[s.name])[untouched], accum[s.name][untouched])


def test_a_run_records_its_own_provenance(tmp_path):
    # what `nestpipe --set calibration_out=...` calls at the end of its main
    path = np_sim.write_calibration_from_run(str(tmp_path / "c.json"), NESTPIPE_SUMMARY,
                                             experiment="nestpipe", variant="quick", devices=8)
    p = json.loads(pathlib.Path(path).read_text())["provenance"]
    assert p["git_commit"] == provenance.git_commit() and p["devices"] == 8
    assert p["measured_paths"] == list(np_sim.MEASURED_PATHS) and p["date"].endswith("UTC")
    assert p["machine"]["cpu_count"] >= 1 and p["command"].startswith("python")
    assert provenance.current_command(["/x/jaxflow/run.py", "--exp=nestpipe", "--set", "a=b c"]) \
        == "python -m jaxflow.run --exp=nestpipe --set 'a=b c'"
    # one writer for both simulators, each with its own measured paths and record
    path = marl_sim.write_calibration_from_run(str(tmp_path / "m.json"), FLEXMARL_SUMMARY,
                                               experiment="flexmarl", variant="quick", devices=8)
    record = json.loads(pathlib.Path(path).read_text())
    assert record["provenance"]["measured_paths"] == list(marl_sim.MEASURED_PATHS)
    assert record["provenance"]["experiment"] == "flexmarl" and "samples_per_s" in record["values"]
    assert marl_sim.write_calibration_from_run.func is np_sim.write_calibration_from_run.func \
        is provenance.write_calibration_from_run


def test_a_calibration_with_a_content_hash_is_stale_exactly_when_its_files_change(tmp_path):
    from jaxflow.study import headlines_systems

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    prov = provenance.run_provenance(experiment="nestpipe", variant="quick", devices=1, measured_paths=["pkg"],
                                     command="cmd", root=tmp_path)
    assert prov["measured_hash"] == provenance.measured_hash(["pkg"], tmp_path)
    report = provenance.calibration_report(prov, "cal.json", ["pkg"], tmp_path)  # no git here: the hash decides
    assert report["stale"] is False and report["warning"] is None
    (pkg / "a.py").write_text("x = 2\n")
    with pytest.warns(provenance.CalibrationWarning, match="content hash differs"):
        report = provenance.calibration_report(prov, "cal.json", ["pkg"], tmp_path)
    assert report["stale"] is True
    summary = {"step_ms_by_workers": {"sync": {"128": 2.0, "1536": 6.0}, "dbp+fwp": {"128": 1.0, "1536": 2.0}},
               "calibration": report}
    (head,) = headlines_systems.nestpipe_scale(summary)
    assert head.stale is True and "(stale calibration: measured code changed since" in head.line()
