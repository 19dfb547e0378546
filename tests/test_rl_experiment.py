"""The ``rl`` experiment end to end: a checkpoint written by transformers, a jsonl file and a
reward in the user's own file -> one run with LoRA -> an ``hf/`` directory that transformers
and peft load with jaxflow's logits; and its one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import rl as rl_config
from jaxflow.config import apply_overrides
from jaxflow.run import main as run_main

REWARD = '''
import json, os

def score(prompts, completions, **columns):
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"n": len(completions), "answers": len(columns["answer"])}) + "\\n")
    # exact answers score 0.9 more; the share of digits gives a random policy a signal
    return [0.9 * (c.strip() == str(a)) + 0.1 * sum(ch.isdigit() for ch in c) / max(len(c), 1)
            for c, a in zip(completions, columns["answer"])]
'''


def _transformers_checkpoint(path) -> None:
    """A tiny Qwen3 written by transformers (random init), with the character tokenizer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxflow.models.tiny_hf import char_tokenizer
    from jaxflow.models.tokenizer_hf import HFTokenizer

    HFTokenizer(char_tokenizer(), eos_id=0, pad_id=0).save_pretrained(str(path))
    cfg = transformers.Qwen3Config(
        vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(str(path))


def test_quick_variant_config_is_valid_and_refuses_rl_lora():
    cfg = rl_config.get_config("quick")
    assert cfg.model.tiny is not None and cfg.reward.fn == "reasoning_gym"
    assert cfg.rl.sampler == "engine" and cfg.rl.loss.correction == "sis"
    with pytest.raises(ValueError, match="model.lora"):
        apply_overrides(cfg, ["rl.lora.rank=8"])
    with pytest.raises(ValueError, match="reward.truncated='maybe'; valid: score, zero"):
        apply_overrides(cfg, ["reward.truncated=maybe"])


def test_default_without_hf_path_is_one_line(capsys, tmp_path):
    assert run_main(["--devices=8", "--exp=rl", "--variant=default", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.hf_path is not set" in err[-1], err


@pytest.mark.slow
def test_own_checkpoint_data_and_reward_to_hf_with_lora(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    base = tmp_path / "base"
    _transformers_checkpoint(base)
    rng = np.random.default_rng(0)
    with open(tmp_path / "train.jsonl", "w") as f:
        for a, b in rng.integers(0, 10, (40, 2)).tolist():
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "id": a * 10 + b}) + "\n")
    (tmp_path / "my_reward.py").write_text(REWARD)
    out = tmp_path / "run"
    rollouts, rows = 2, 4 * 4
    assert run_main([
        "--devices=8", "--exp=rl", "--variant=default", "--out", str(out),
        "--set", f"model.hf_path={base}", "--set", f"data.train={tmp_path / 'train.jsonl'}",
        "--set", f"reward.fn={tmp_path / 'my_reward.py'}:score", "--set", "model.lora.rank=8",
        "--set", "export.hf=true", "--set", f"rollouts={rollouts}", "--set", "rl.sampler=static",
        "--set", "rl.prompts_per_rollout=4", "--set", "rl.group_size=4", "--set", "rl.lag=1",
        "--set", "rl.max_new_tokens=4", "--set", "optim.lr=1e-2", "--set", "data.eval_size=8",
        "--set", "eval.prompts=8", "--set", "eval.samples=1", "--set", "eval.every=2",
        "--set", "checkpoint_every=2"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "rollout" in m]
    assert len(metrics) == rollouts
    # reward.truncated=score: truncated completions (a random model rarely stops) were scored,
    # every training row reached the user's reward, with its answer column
    assert any(m["response_length/clip_ratio"] > 0 for m in metrics)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["n"] for c in calls].count(rows) >= rollouts and all(c["n"] == c["answers"] for c in calls)
    hf = out / "hf"
    assert (hf / "adapter" / "adapter_config.json").exists() and (hf / "tokenizer.json").exists()
    ids = torch.tensor([[5, 11, 6, 83, 7]])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32)
        base_model = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
        base_logits = base_model(ids).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base_model, str(hf / "adapter"))
        merged_logits, peft_logits = merged(ids).logits.numpy(), adapted(ids).logits.numpy()
    from jaxflow.models.hf_checkpoint import from_pretrained

    ours = np.asarray(from_pretrained(str(hf))(ids.numpy()))
    np.testing.assert_allclose(ours, merged_logits, atol=1e-5)
    np.testing.assert_allclose(peft_logits, merged_logits, atol=1e-5)
    assert np.abs(merged_logits - base_logits).max() > 1e-4  # the adapters trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["per_seed"][0]["export"] == str(hf)


def test_quick_without_the_rl_extra_is_one_line(capsys, tmp_path, monkeypatch):
    import sys

    from jaxflow.data import sources

    sources.reasoning_gym_dataset.cache_clear()
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym -> ImportError
    assert run_main(["--devices=8", "--exp=rl", "--variant=quick", "--out", str(tmp_path / "run"),
                     "--set", f"cache_root={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install -e ".[rl]"' in err[-1], err


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout" in r]


@pytest.mark.multiprocess
def test_killed_run_resumes_mid_epoch_with_the_rows_of_one_that_never_stopped(tmp_path):
    import subprocess
    import sys

    base = tmp_path / "base"
    _transformers_checkpoint(base)
    with open(tmp_path / "train.jsonl", "w") as f:  # 6 rows, 2 prompts a rollout: 3 per epoch
        for a in range(6):
            f.write(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n")
    args = ["--exp=rl", "--variant=default", "--set", f"model.hf_path={base}",
            "--set", f"data.train={tmp_path / 'train.jsonl'}", "--set", "data.eval_size=2",
            "--set", "reward.fn=exact_match", "--set", "rollouts=4", "--set", "checkpoint_every=2",
            "--set", "rl.sampler=static", "--set", "rl.prompts_per_rollout=2",
            "--set", "rl.group_size=2", "--set", "rl.lag=1", "--set", "rl.max_new_tokens=3",
            "--set", "optim.lr=1e-2", "--set", "eval.prompts=2", "--set", "eval.samples=1",
            "--set", "eval.every=4", "--set", "export.hf=false"]

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "jaxflow.run", *args, *extra],
                              capture_output=True, text=True, timeout=600)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run("--out", str(whole)).returncode == 0
    killed = run("--out", str(cut), "--kill-after-checkpoint", "2")
    assert killed.returncode != 0 and len(_rows(cut)) == 2, killed.stderr[-2000:]
    resumed = run("--out", str(cut), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    keys = ("rollout", "critic/score/mean", "actor/pg_loss", "response_length/mean")
    assert [[r[k] for k in keys] for r in _rows(cut)] == [[r[k] for k in keys] for r in _rows(whole)]
