"""A trained LoRA policy out as a Hugging Face checkpoint: ``export_hf`` (transformers loads the
merged weights and peft the adapter onto the base, both with jaxflow's logits), the run-directory
contract and ``python -m jaxflow.export`` (restores a step's policy params alone; bad input is
one line, exit 2, nothing written), and the tokenizer pieces: every EOS id
(generation_config.json lists) and a transformers tokenizer through ``TransformersTokenizer``."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from _hf_fixtures import tiny_qwen3
from flax import nnx

from jaxflow import export
from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer, Tokenizer, TokenizerError, check_tokenizer
from jaxflow.errors import UserError
from jaxflow.models import Transformer, from_pretrained, lora
from jaxflow.models.hf_checkpoint import write_random_checkpoint
from jaxflow.models.hf_export import export_hf, read_export_manifest, write_export_manifest
from jaxflow.models.tokenizer_hf import HFTokenizer, TransformersTokenizer
from jaxflow.train.state import TrainState

torch.set_num_threads(1)  # see tests/test_models_hf_parity.py
LOGIT_ATOL = 1e-5  # f32 logits, transformers / peft vs jaxflow
EOS, IM_END = "<|endoftext|>", "<|im_end|>"
LORA = lora.LoraConfig(rank=4, alpha=8.0)
TOKENS = np.random.default_rng(0).integers(0, 300, size=(2, 10))
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _write_tokenizer(path: str) -> tuple[int, int]:
    """A byte-level BPE tokenizer.json with two stop tokens (Qwen3-instruct's pair), its
    tokenizer_config.json (eos <|im_end|>), generation_config.json (both EOS ids) and a chat
    template; returns (im_end id, endoftext id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{a}+{b}={a + b}" for a, b in np.random.default_rng(0).integers(0, 100, (500, 2))]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS, IM_END], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    ids = tok.token_to_id(IM_END), tok.token_to_id(EOS)
    files = {"tokenizer_config.json": {"eos_token": IM_END, "pad_token": EOS, "bos_token": None},
             "generation_config.json": {"eos_token_id": list(ids), "do_sample": True}}
    for name, data in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return ids


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(base checkpoint dir with its tokenizer files, (im_end, endoftext) ids)."""
    path = str(tmp_path_factory.mktemp("hf_export") / "base")
    write_random_checkpoint(tiny_qwen3(), path, seed=0, std=0.2)
    return path, _write_tokenizer(path)


def _trained_lora(path: str, seed: int) -> tuple[dict, np.ndarray]:
    """(the base + LoRA params with trained (non-zero) B, their jaxflow logits on TOKENS)."""
    model = from_pretrained(path, lora=LORA)
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if str(p[-1].key).endswith("_lora_b") else x, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model.config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    logits = jax.jit(lambda m: m(jnp.asarray(TOKENS, jnp.int32)))(nnx.merge(graphdef, state))
    return params, np.asarray(logits)


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(TOKENS)).logits.numpy()


def test_export_hf_loads_in_transformers_and_peft_with_jaxflow_logits(source, tmp_path):
    path, stop_ids = source
    params, ours = _trained_lora(path, seed=0)
    out = str(tmp_path / "hf")
    files = export_hf(params, dataclasses.replace(tiny_qwen3(), lora=LORA), out, source_dir=path)
    assert files == sorted(["adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                            "chat_template.jinja", "config.json", "generation_config.json",
                            "jaxflow_export.json", "model.safetensors", "tokenizer.json",
                            "tokenizer_config.json"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_allclose(_torch_logits(merged), ours, rtol=0, atol=LOGIT_ATOL)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert np.max(np.abs(_torch_logits(base) - ours)) > 1e-2  # the adapters matter
    with_adapter = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
    np.testing.assert_allclose(_torch_logits(with_adapter), ours, rtol=0, atol=LOGIT_ATOL)
    # the tokenizer files travel: both stop ids and the chat template
    assert HFTokenizer.from_pretrained(out).eos_ids == stop_ids
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == list(stop_ids)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE

    # an earlier export is replaced whole: full-weight params leave no stale adapter/
    export_hf(lora.strip(params), tiny_qwen3(), out)
    assert sorted(os.listdir(out)) == ["config.json", "jaxflow_export.json", "model.safetensors"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files \\(notes.txt\\); valid: a new or empty"):
        export_hf(params, tiny_qwen3(), str(tmp_path / "other"), lora_cfg=LORA)
    assert os.listdir(tmp_path / "other") == ["notes.txt"]


def _run_dir(tmp_path, path: str, steps: dict[int, dict]) -> str:
    """A run directory as the rl experiment leaves it: export.json and checkpoints of
    ``{"policy": TrainState, "rollout", "rng"}`` at ``steps``."""
    run = tmp_path / "run"
    write_export_manifest(run, hf_path=path, model_cfg=dataclasses.replace(tiny_qwen3(), lora=LORA))
    ckpt = Checkpointer(run / "checkpoints", async_save=False, max_to_keep=5)
    tx = lora.trainable_only(optax.adam(1e-3))
    for step, params in steps.items():
        ckpt.save(step, {"policy": TrainState.create(tx, params), "rollout": jnp.asarray(step, jnp.int32),
                         "rng": jnp.zeros(2, jnp.uint32)}, force=True)
    ckpt.close()
    return str(run)


def test_export_cli_restores_a_steps_policy_params_and_refuses_bad_input(source, tmp_path, capsys):
    path, stop_ids = source
    params1, _ = _trained_lora(path, seed=1)
    params2, logits2 = _trained_lora(path, seed=2)
    run = _run_dir(tmp_path, path, {1: params1, 2: params2})
    manifest = read_export_manifest(run)
    assert manifest.lora == LORA and manifest.params_path == ("policy", "params")
    assert sorted(os.listdir(os.path.join(run, "hf_source"))) == [
        "chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]

    out = str(tmp_path / "export")
    assert export.main([run, "--out", out]) == 0  # the latest step
    assert f"wrote {out} (step 2 of {run}" in capsys.readouterr().out
    reloaded = from_pretrained(out)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m: m(jnp.asarray(TOKENS, jnp.int32)))(reloaded)),
                               logits2, rtol=0, atol=1e-6)
    assert HFTokenizer.from_pretrained(out).eos_ids == stop_ids
    assert os.path.isfile(os.path.join(out, "adapter", "adapter_model.safetensors"))

    bad = str(tmp_path / "bad")
    cases = [([run, "--step", "7", "--out", bad], f"--step 7: no checkpoint of that step in "
              f"{run}/checkpoints; available steps: 1, 2"),
             ([str(tmp_path), "--out", bad], f"{tmp_path}/export.json does not exist"),
             ([run, "--out", path], f"--out {path!r} holds other files"),
             ([run], "the following arguments are required: --out")]
    for argv, line in cases:
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and line in err, err
        assert not os.path.exists(bad)


def test_eos_ids_and_transformers_tokenizer_adapter(source, tmp_path):
    path, (im_end, endoftext) = source
    ours = HFTokenizer.from_pretrained(path)
    assert ours.eos_ids == (im_end, endoftext) and ours.eos_id == im_end and ours.pad_id == endoftext
    # save_pretrained keeps every stop id (generation_config.json, its other keys kept)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "top_p": 0.9}))
    ours.save_pretrained(str(tmp_path))
    assert HFTokenizer.from_pretrained(str(tmp_path)).eos_ids == (im_end, endoftext)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "eos_token_id": [im_end, endoftext], "top_p": 0.9}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                                eos_token=IM_END, pad_token=EOS)
    theirs = TransformersTokenizer(fast, generation_config=path)
    assert (theirs.eos_ids, theirs.eos_id, theirs.pad_id, theirs.bos_id) == (
        ours.eos_ids, ours.eos_id, ours.pad_id, None)
    assert theirs.vocab_size == ours.vocab_size == 300
    for tok in (ours, theirs):  # the trainer's boundary accepts both
        assert isinstance(tok, Tokenizer) and check_tokenizer(tok) is tok
    for text in ("12+34=46", " 7+ 8 = 15 ", "99+1=100\n"):
        ids = ours.encode(text, eos=True)
        assert theirs.encode(text, eos=True) == ids and ids[-1] == im_end
        assert theirs.decode(ids) == ours.decode(ids) == text
        # decoding stops at either stop id
        cut = ours.encode(text) + [endoftext] + ours.encode("1+1=2")
        assert theirs.decode(cut) == ours.decode(cut) == text
    np.testing.assert_array_equal(theirs.pad_batch([[1, 2], [3]])[0], [[1, 2], [3, endoftext]])
    # without a generation config only the tokenizer's own EOS stops
    assert TransformersTokenizer(fast).eos_ids == (im_end,)
    with pytest.raises(TokenizerError, match="CharTokenizer lacks eos_token_id, __len__; valid: a transformers"):
        TransformersTokenizer(CharTokenizer())
    no_eos = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    with pytest.raises(TokenizerError, match="has no EOS token .*; valid: a tokenizer with an eos_token"):
        TransformersTokenizer(no_eos)
