"""The calibration study's statistics (bootstrap Spearman intervals, sign stability), its
user-given task and calibration files, and the study end to end on a tiny checkpoint."""
import json

import numpy as np
import pytest

from jaxflow import run as runner
from jaxflow.config import ConfigError, apply_overrides, get_experiment
from jaxflow.prune.calibration import CalibrationConfig, calibration_set
from jaxflow.prune.correlation import bootstrap_spearman, sign_stability, spearman
from jaxflow.prune.task_files import TaskFileError, load_calibration_files, load_task_files
from tests._hf_fixtures import write_tiny_qwen3


def test_bootstrap_interval_of_a_perfect_ranking_is_a_point():
    out = bootstrap_spearman([1, 2, 3, 4, 5], [2, 4, 6, 8, 10], n_boot=300)
    # every replicate repeats whole (x, y) pairs, so its ranks stay in order: rho = 1 or nan
    assert out["rho"] == pytest.approx(1.0)
    assert out["lo"] == pytest.approx(1.0) and out["hi"] == pytest.approx(1.0)
    assert out["p_positive"] == 1.0 and out["n_undefined"] < 300


def test_bootstrap_interval_covers_rho_and_is_reproducible():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=10), rng.normal(size=10)
    a = bootstrap_spearman(x, y, n_boot=500, seed=3)
    assert a == bootstrap_spearman(x, y, n_boot=500, seed=3)
    assert a["lo"] < a["rho"] < a["hi"] and a["hi"] - a["lo"] > 0.3  # 10 noise points: wide
    assert a["rho"] == pytest.approx(spearman(x, y))
    with pytest.raises(ValueError, match=r"one length; got \(3,\) and \(2,\)"):
        bootstrap_spearman([1, 2, 3], [1, 2])


def test_sign_stability():
    pos = {"rho": 0.5, "lo": 0.1, "hi": 0.9}
    weak_neg = {"rho": -0.2, "lo": -0.7, "hi": 0.4}
    nan = {"rho": float("nan"), "lo": float("nan"), "hi": float("nan")}
    out = sign_stability({"xs@0.5": pos, "s@0.5": pos, "xs@0.6": nan})
    assert out["stable"] and out["signs"] == {"xs@0.5": 1, "s@0.5": 1, "xs@0.6": 0}
    assert out["n_resolved"] == 2 and out["resolved_stable"]
    out = sign_stability({"a": pos, "b": weak_neg})
    assert not out["stable"] and out["resolved"] == {"a": 1} and out["resolved_stable"]
    out = sign_stability({"a": pos, "b": {"rho": -0.6, "lo": -0.9, "hi": -0.1}})
    assert not out["resolved_stable"]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_task_files_load_both_kinds_and_name_the_bad_line(tmp_path):
    math = _write(tmp_path / "math.jsonl", ['{"prompt": "1+2=", "answer": "3"}', "",
                                            '{"prompt": "2+2=", "answer": "4"}'])
    qa = _write(tmp_path / "qa.jsonl", ['{"prompt": "hot? ", "choices": ["fire", "ice"], "label": 0,'
                                        ' "capability": "commonsense"}'])
    sets = load_task_files([math, qa])
    assert list(sets) == ["math", "commonsense"]
    assert [e.answer for e in sets["math"]] == ["3", "4"]
    assert sets["commonsense"][0].choices == ("fire", "ice") and sets["commonsense"][0].answer == "fire"
    cases = [
        (['{"prompt": "a", "choices": ["x", "y"], "label": 2}'], r"bad.jsonl:1: label=2; valid: an int in \[0, 1\]"),
        (['{"prompt": "a", "answer": "b"}', '{"prompt": "c", "choices": ["x", "y"], "label": 0}'],
         "bad.jsonl:2: capability 'bad' mixes exact-match and multiple-choice"),
        (['{"prompt": "a"}'], "bad.jsonl:1: answer=None; valid: a non-empty string"),
        (['not json'], "bad.jsonl:1: not JSON"),
        (['{"prompt": "", "answer": "b"}'], "bad.jsonl:1: prompt=''"),
    ]
    for lines, message in cases:
        with pytest.raises(TaskFileError, match=message):
            load_task_files([_write(tmp_path / "bad.jsonl", lines)])
    with pytest.raises(TaskFileError, match="nope.jsonl: no such file"):
        load_task_files([str(tmp_path / "nope.jsonl")])


def test_calibration_files_become_sources(tmp_path):
    from jaxflow.prune.capabilities import make_tokenizer

    web = _write(tmp_path / "web.txt", ["the cat sees a tree.", "", "a dog likes the river."])
    code = _write(tmp_path / "code.jsonl", ['{"text": "a=1;b=a;b?1"}', '{"text": "close ([|])"}'])
    docs = load_calibration_files([web, code])
    assert docs == {"web": ["the cat sees a tree.", "a dog likes the river."],
                    "code": ["a=1;b=a;b?1", "close ([|])"]}
    tok, cfg = make_tokenizer(), CalibrationConfig(rows=4, seq_len=32)
    batch = calibration_set("web", world=None, tokenizer=tok, cfg=cfg, draw=0, documents=docs)
    assert np.all(batch["segment_ids"] > 0)
    assert "the cat" in tok.decode(batch["tokens"].ravel(), stop_at_eos=False)
    mix = tok.decode(calibration_set("mix", world=None, tokenizer=tok, cfg=cfg, draw=1,
                                     documents=docs)["tokens"].ravel(), stop_at_eos=False)
    assert "?" in mix and ("cat" in mix or "dog" in mix)
    with pytest.raises(ValueError, match="calibration source 'igsp'; valid: web, code, random"):
        calibration_set("igsp", world=None, tokenizer=tok, cfg=cfg, draw=0, documents=docs)
    with pytest.raises(TaskFileError, match="a second calibration file named 'web'"):
        load_calibration_files([web, _write(tmp_path / "web.jsonl", ['{"text": "x"}'])])


def test_config_checks_sizes_sources_and_files(tmp_path):
    config = get_experiment("calibration_tradeoffs").get_config("default")
    assert config.sizes == ("xs", "s", "default")
    assert [m.d_model for _, m in config.size_models()] == [64, 96, 128]
    with pytest.raises(ConfigError, match="sizes: 'huge'; valid: xs, s, default, l"):
        apply_overrides(config, ["sizes=xs,huge"])
    web = _write(tmp_path / "web.txt", ["hello"])
    with pytest.raises(ConfigError, match="sources: 'math' is not a calibration source; valid: web, random"):
        apply_overrides(config, [f"calibration_files={web}", "sources=math"])
    with pytest.raises(ConfigError, match="no such file"):
        apply_overrides(config, [f"eval_files={tmp_path / 'missing.jsonl'}"])


def test_study_runs_end_to_end_on_a_tiny_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    write_tiny_qwen3(ckpt, seed=1)
    rng = np.random.default_rng(0)
    pairs = rng.integers(0, 50, size=(40, 2))
    add = _write(tmp_path / "add.jsonl", [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)})
                                          for a, b in pairs[:8]])
    pick = _write(tmp_path / "pick.jsonl", [json.dumps({"prompt": f"{a}+{b}=", "label": 1,
                                                        "choices": [str(a + b + 1), str(a + b)]})
                                            for a, b in pairs[8:16]])
    sums = _write(tmp_path / "sums.txt", [f"{a}+{b}={a + b}" for a, b in pairs[16:]])
    prods = _write(tmp_path / "prods.txt", [f"{a},{b},1:{a * b - 1}=" for a, b in pairs[16:]])
    out = tmp_path / "run"
    code = runner.main([
        "--exp=calibration_tradeoffs", "--variant=quick", f"--out={out}",
        "--set", f"model.hf_path={ckpt}", "--set", f"eval_files={add},{pick}",
        "--set", f"calibration_files={sums},{prods}", "--set", "sources=sums,prods,mix,random",
        "--set", "sparsities=0.5,2:4", "--set", "calibration.rows=4", "--set", "calibration.seq_len=24",
        "--set", "calib_batch_rows=4", "--set", "bootstrap=200"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["capabilities"] == ["add", "pick"]
    assert set(summary["perplexity"]) == {"sums", "prods", "mix", "random"}
    assert list(summary["sizes"]) == ["hf"]
    # a random model: exact match 0, choices near chance; pruning changes its log-likelihoods
    dense = summary["dense_scores"]
    assert dense["add"] == 0.0 and 0.0 <= dense["pick"] <= 1.0
    cells = summary["sign_stability"]["pick"]["signs"]
    assert set(cells) == {"hf@0.5", "hf@2:4"}
    per_draw = json.loads((out / "per_draw.json").read_text())
    assert len(per_draw) == 4 * 2 and {r["sparsity"] for r in per_draw} == {0.5, "2:4"}
