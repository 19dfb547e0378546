"""Bad Hugging Face checkpoints and tokenizers: every case is one CheckpointError line (a
FileFormatError, hence a UserError) naming the file and the field or tensor, raised before any
weight is read; dtypes are accepted as strings, jnp / numpy dtypes and np.dtype objects."""
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxflow.config import ConfigError
from jaxflow.errors import FileFormatError, UserError
from jaxflow.mesh import make_mesh
from jaxflow.models import CheckpointError, config_from_hf, from_pretrained, hf_checkpoint
from jaxflow.models.architectures import shipped_config
from jaxflow.models.hf_checkpoint import INDEX_FILE, write_random_checkpoint
from jaxflow.models.pretrained import load_policy
from jaxflow.models.tokenizer_hf import HFTokenizer
from tests._cli import run_cli
from tests._hf_fixtures import tiny_qwen3, write_tiny_qwen3

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """{"single": a tiny Qwen3 with its tokenizer in one safetensors file, "sharded": the same
    architecture in several files with an index}; tests damage copies."""
    root = tmp_path_factory.mktemp("hf_bad")
    write_tiny_qwen3(str(root / "single"))
    write_random_checkpoint(tiny_qwen3(), str(root / "sharded"), max_shard_bytes=20_000)
    return {"single": str(root / "single"), "sharded": str(root / "sharded")}


def _copy(originals, tmp_path, name="single") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(originals[name], dst)
    return dst


def _write(file, content) -> None:
    """``content``: bytes as they are, anything else as JSON."""
    with open(file, "wb") as f:
        f.write(content if isinstance(content, bytes) else json.dumps(content).encode())


def _edit_json(file, edit) -> None:
    with open(file) as f:
        data = json.load(f)
    _write(file, edit(data))


def _assert_clean(error, *words) -> str:
    """A user error whose message is one line containing every one of ``words``."""
    assert isinstance(error, UserError) and isinstance(error, ValueError), type(error)
    assert isinstance(error, (FileFormatError, ConfigError)), type(error)
    message = str(error)
    assert "\n" not in message and "Traceback" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def _with(**changes):
    def edit(cfg):
        for key, value in changes.items():
            if value is _DROP:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        return cfg
    return edit


_DROP = object()
_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")

CONFIG_CASES = {
    "json_list": (lambda c: [c], ["array", "JSON object"]),
    "not_utf8": (lambda c: b"\xff" + json.dumps(c).encode(), ["UTF-8", "offset 0"]),
    "not_json": (lambda c: b'{"hidden_size": 32,\n', ["not valid JSON", "line 2 column 1"]),
    "no_hidden_size": (_with(hidden_size=_DROP), ["lacks hidden_size", "integer >= 1"]),
    "null_vocab": (_with(vocab_size=None), ["vocab_size=null"]),
    "zero_heads": (_with(num_attention_heads=0), ["num_attention_heads=0", "integer >= 1"]),
    "negative_layers": (_with(num_hidden_layers=-1), ["num_hidden_layers=-1"]),
    "string_size": (_with(vocab_size="320"), ['vocab_size="320"', "integer"]),
    "bool_size": (_with(intermediate_size=True), ["intermediate_size=true"]),
    "float_size": (_with(hidden_size=32.5), ["hidden_size=32.5"]),
    "not_divisible": (_with(head_dim=_DROP, hidden_size=33),
                      ["hidden_size=33", "num_attention_heads=2", "head_dim"]),
    "kv_not_a_divisor": (_with(num_key_value_heads=3), ["num_key_value_heads=3", "divisor"]),
    "odd_head_dim": (_with(head_dim=15), ["head_dim", "15", "even"]),
    "zero_max_positions": (_with(max_position_embeddings=0), ["max_position_embeddings=0"]),
    "negative_eps": (_with(rms_norm_eps=-1e-6), ["rms_norm_eps=-1e-06", "> 0"]),
    "nan_theta": (_with(rope_theta=float("nan")), ["rope_theta=NaN", "finite"]),
    "string_bool": (_with(tie_word_embeddings="true"), ['tie_word_embeddings="true"', "false"]),
    "rope_scaling_list": (_with(rope_scaling=[8]), ["rope_scaling=[8]", "object"]),
    "rope_kind": (_with(rope_scaling={"rope_type": "yarn", "factor": 2.0}), ["yarn", "llama3"]),
    "rope_without_factor": (_with(rope_scaling={
        "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), ["rope_scaling.factor"]),
    "rope_low_above_high": (_with(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 32}), ["rope_scaling", "low_freq_factor"]),
    "moe_without_experts": (_with(**_MOE, num_experts_per_tok=2, moe_intermediate_size=16),
                            ["num_experts"]),
    "moe_top_k_above_experts": (_with(**_MOE, num_experts=4, num_experts_per_tok=8,
                                      moe_intermediate_size=16), ["num_experts_per_tok=8"]),
    "moe_dense_layer_out_of_range": (_with(**_MOE, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, mlp_only_layers=[5]),
                                     ["mlp_only_layers=[5]", "0..0"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_json(originals, tmp_path, case):
    path = _copy(originals, tmp_path)
    edit, words = CONFIG_CASES[case]
    _edit_json(os.path.join(path, "config.json"), edit)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    message = _assert_clean(info.value, os.path.join(path, "config.json"), *words)
    assert message.count("config.json") == 1, message


ARCH_CASES = {
    "unknown_class": (_with(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
                      ["GPT2LMHeadModel", "'gpt2'", "not supported"]),
    "no_architectures": (_with(architectures=_DROP, model_type="mistral"),
                         ["architectures=[]", "'mistral'", "not supported"]),
    "empty_list": (_with(architectures=[]), ["architectures=[]", "not supported"]),
    "a_string": (_with(architectures="Qwen3ForCausalLM"),
                 ['architectures="Qwen3ForCausalLM"', "a list of class names"]),
    "not_strings": (_with(architectures=[5]), ["architectures=[5]", "a list of class names"]),
}


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_unknown_architecture_names_the_value_and_the_supported_ones(originals, tmp_path, case):
    path = _copy(originals, tmp_path)
    edit, words = ARCH_CASES[case]
    _edit_json(os.path.join(path, "config.json"), edit)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    _assert_clean(info.value, "config.json", *words, "LlamaForCausalLM", "Qwen3ForCausalLM",
                  "Qwen3MoeForCausalLM")


def _safetensors_header(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _truncated(raw: bytes) -> bytes:
    return raw[:-7]


SAFETENSORS_CASES = {
    "truncated": _truncated,
    "garbage": lambda raw: b"this is not a safetensors file" * 3,
    "empty": lambda raw: b"",
    "header_size_too_large": lambda raw: struct.pack("<Q", 2**40) + b"{}",
    "header_not_json": lambda raw: struct.pack("<Q", 9) + b"{not json",
    "data_shorter_than_header": lambda raw: _safetensors_header(
        {"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}}, b"\0" * 8),
    "unknown_dtype_code": lambda raw: _safetensors_header(
        {"model.norm.weight": {"dtype": "Q99", "shape": [32], "data_offsets": [0, 128]}},
        b"\0" * 128),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_corrupt_safetensors_file_is_named(originals, tmp_path, case):
    path = _copy(originals, tmp_path)
    file = os.path.join(path, WEIGHTS)
    with open(file, "rb") as f:
        raw = f.read()
    _write(file, SAFETENSORS_CASES[case](raw))
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    _assert_clean(info.value, file, "safetensors", "cannot be read")


def _first_shard(path) -> str:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]


def _index_edit(edit):
    def apply(path):
        _edit_json(os.path.join(path, INDEX_FILE), edit)
    return apply


def _index_raw(content):
    def apply(path):
        _write(os.path.join(path, INDEX_FILE), content)
    return apply


def _garbage_shard(path):
    _write(os.path.join(path, _first_shard(path)), b"\x00garbage")


def _remap(target):
    def edit(index):
        index["weight_map"]["model.norm.weight"] = target
        return index
    return edit


INDEX_CASES = {
    "not_json": (_index_raw(b'{"weight_map": {'), [INDEX_FILE, "not valid JSON", "line 1"]),
    "not_utf8": (_index_raw(b'{"weight_map": "\xe9"}'), [INDEX_FILE, "UTF-8", "offset 16"]),
    "a_list": (_index_raw(b"[]"), [INDEX_FILE, "array"]),
    "no_weight_map": (_index_edit(lambda i: {"metadata": i["metadata"]}),
                      [INDEX_FILE, "'weight_map'"]),
    "weight_map_a_list": (_index_edit(lambda i: {"weight_map": list(i["weight_map"])}),
                          [INDEX_FILE, "'weight_map'"]),
    "file_outside_the_dir": (_index_edit(_remap("../elsewhere.safetensors")),
                             [INDEX_FILE, "weight_map", "'model.norm.weight'", "inside"]),
    "file_not_a_string": (_index_edit(_remap(7)), [INDEX_FILE, "'model.norm.weight'", "to 7"]),
    "file_missing": (_index_edit(_remap("model-00099-of-00099.safetensors")),
                     [INDEX_FILE, "'model.norm.weight'", "does not exist"]),
    "garbage_shard": (_garbage_shard, ["model-00001-of-", "cannot be read"]),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index_or_shard_is_named(originals, tmp_path, case):
    path = _copy(originals, tmp_path, "sharded")
    damage, words = INDEX_CASES[case]
    damage(path)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    _assert_clean(info.value, path, *words)


def _rewrite(file, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _as(dtype, name="model.norm.weight"):
    return lambda t: t.update({name: t[name].astype(dtype)})


@pytest.mark.parametrize("dtype, code", [(np.int8, "I8"), (np.bool_, "BOOL"), (np.int32, "I32"),
                                         (np.uint8, "U8"), (np.int64, "I64")])
def test_non_floating_weights_are_refused(originals, tmp_path, monkeypatch, dtype, code):
    path = _copy(originals, tmp_path)
    file = os.path.join(path, WEIGHTS)
    _rewrite(file, _as(dtype))

    def no_reads(*args, **kwargs):
        raise AssertionError("tensor data read before the checkpoint was validated")

    monkeypatch.setattr(hf_checkpoint._Reader, "param", no_reads)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    _assert_clean(info.value, file, "'model.norm.weight'", f"dtype {code}", "F32", "BF16",
                  "F16")


def test_float16_and_float64_weights_load_as_stored(originals, tmp_path):
    path = _copy(originals, tmp_path)
    file = os.path.join(path, WEIGHTS)
    _rewrite(file, lambda t: (_as(np.float16)(t), _as(np.float64, "model.embed_tokens.weight")(t)))
    stored = load_file(file)
    model = from_pretrained(path)
    np.testing.assert_array_equal(model.final_norm.scale[...],
                                  stored["model.norm.weight"].astype(np.float32))
    np.testing.assert_array_equal(model.embedding[...],
                                  stored["model.embed_tokens.weight"].astype(np.float32))


def _drop_from_shard(name):
    def apply(path):
        index = json.load(open(os.path.join(path, INDEX_FILE)))
        _rewrite(os.path.join(path, index["weight_map"][name]), lambda t: t.pop(name))
        return index["weight_map"][name]
    return apply


def _drop_from_index(name):
    def apply(path):
        _index_edit(lambda i: (i["weight_map"].pop(name), i)[1])(path)
        return INDEX_FILE
    return apply


def _drop_from_single(name):
    def apply(path):
        _rewrite(os.path.join(path, WEIGHTS), lambda t: t.pop(name))
        return WEIGHTS
    return apply


MISSING = "model.layers.0.self_attn.q_norm.weight"


@pytest.mark.parametrize("layout, damage, words", [
    ("single", _drop_from_single(MISSING), ["lacks tensor", "searched"]),
    ("sharded", _drop_from_index(MISSING), ["lacks tensor", "searched"]),
    ("sharded", _drop_from_shard(MISSING), ["does not contain it"]),
], ids=["single_file", "not_in_the_index", "not_in_the_mapped_shard"])
def test_missing_tensor_names_the_tensor_and_the_files_searched(originals, tmp_path, layout,
                                                                damage, words):
    path = _copy(originals, tmp_path, layout)
    searched = damage(path)
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    _assert_clean(info.value, f"'{MISSING}'", searched, *words)


TOKENIZER_CASES = {
    "not_json": ("tokenizer.json", b'{"model": {', ["not valid JSON", "line 1 column"]),
    "not_utf8": ("tokenizer.json", b'{"model": "\xff"}', ["UTF-8", "offset 11"]),
    "a_list": ("tokenizer.json", [], ["array"]),
    "no_model": ("tokenizer.json", {"version": "1.0"}, ["'model'"]),
    "unknown_model_type": ("tokenizer.json", _with(model={"type": "Nope", "vocab": {}}),
                           ["model.type='Nope'", "BPE"]),
    "model_type_a_list": ("tokenizer.json", _with(model={"type": ["BPE"], "vocab": {}}),
                          ["model.type=['BPE']"]),
    "vocab_a_list_for_bpe": ("tokenizer.json", lambda t: {**t, "model": {**t["model"], "vocab": [1]}},
                             ["model.vocab", "array", "object"]),
    "added_tokens_not_a_list": ("tokenizer.json", _with(added_tokens=5), ["added_tokens", "number"]),
    "merges_not_a_list": ("tokenizer.json",
                          lambda t: {**t, "model": {**t["model"], "merges": 5}},
                          ["not a valid tokenizers tokenizer.json", "line 1 column"]),
    "config_not_json": ("tokenizer_config.json", b"{'eos_token': 1}", ["not valid JSON", "line 1"]),
    "config_a_string": ("tokenizer_config.json", "<|endoftext|>", ["string", "JSON object"]),
    "eos_token_a_number": ("tokenizer_config.json", _with(eos_token=5), ["eos_token=5"]),
    "eos_token_not_in_vocab": ("tokenizer_config.json", _with(eos_token="<|nope|>"),
                               ["eos_token '<|nope|>'", "tokenizer.json"]),
    "eos_token_id_a_string": ("config.json", _with(eos_token_id="7"), ["eos_token_id='7'"]),
    "generation_config_negative_id": ("generation_config.json", {"eos_token_id": -1},
                                      ["eos_token_id=-1", ">= 0"]),
    "generation_config_not_json": ("generation_config.json", b"{", ["not valid JSON"]),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_bad_tokenizer_files_are_named(originals, tmp_path, case):
    path = _copy(originals, tmp_path)
    name, content, words = TOKENIZER_CASES[case]
    file = os.path.join(path, name)
    if callable(content):
        _edit_json(file, content)
    else:
        _write(file, content)
    with pytest.raises(CheckpointError) as info:
        HFTokenizer.from_pretrained(path)
    _assert_clean(info.value, file, *words)


def test_no_eos_token_anywhere_is_named(originals, tmp_path):
    path = _copy(originals, tmp_path)
    os.remove(os.path.join(path, "tokenizer_config.json"))
    with pytest.raises(CheckpointError) as info:
        HFTokenizer.from_pretrained(path)
    _assert_clean(info.value, "tokenizer_config.json", "eos_token", "eos_token_id")


def test_model_vocab_smaller_than_the_tokenizer_is_named(originals, tmp_path):
    path = _copy(originals, tmp_path)
    _edit_json(os.path.join(path, "config.json"), _with(vocab_size=100))
    n_tokens = HFTokenizer.from_pretrained(path).vocab_size
    assert n_tokens > 100
    with pytest.raises(CheckpointError) as info:
        load_policy(path, make_mesh({"data": 8}))
    _assert_clean(info.value, "config.json", "vocab_size=100", "tokenizer.json", f"{n_tokens} tokens")


def test_byte_order_marks_are_dropped(originals, tmp_path):
    path = _copy(originals, tmp_path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            raw = f.read()
        _write(file, b"\xef\xbb\xbf" + raw)
    reference = from_pretrained(originals["single"])
    assert from_pretrained(path).config == reference.config
    tokenizer = HFTokenizer.from_pretrained(path)
    assert tokenizer.encode("12+34=46") == HFTokenizer.from_pretrained(originals["single"]).encode(
        "12+34=46")


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("dtype, name", [
    (jnp.float32, "float32"), (np.float32, "float32"), (np.dtype("float32"), "float32"),
    (jnp.bfloat16, "bfloat16"), (jnp.dtype("bfloat16"), "bfloat16"),
], ids=["jnp.float32", "np.float32", "np.dtype(float32)", "jnp.bfloat16", "jnp.dtype(bfloat16)"])
def test_dtype_objects_give_the_string_forms_result(originals, dtype, name):
    path = originals["single"]
    want = from_pretrained(path, dtype=name)
    got = from_pretrained(path, dtype=dtype)
    assert got.config == want.config and got.config.param_dtype == name
    jax.tree.map(np.testing.assert_array_equal, _params(got), _params(want))
    assert got.embedding[...].dtype == jnp.dtype(name)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert config_from_hf(cfg, dtype=dtype) == config_from_hf(cfg, dtype=name)


def test_dtype_objects_in_overrides_and_shipped_configs(originals):
    model = from_pretrained(originals["single"], param_dtype=jnp.bfloat16)
    assert model.config.param_dtype == "bfloat16" and model.config.dtype == "float32"
    assert shipped_config("qwen3-8b", dtype=np.float32) == shipped_config("qwen3-8b",
                                                                          dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "fp32", jnp.float16, np.int8, float, object()],
                         ids=["float16", "fp32", "jnp.float16", "np.int8", "float", "object"])
def test_unknown_dtypes_list_the_valid_names(originals, dtype):
    with pytest.raises(ConfigError) as info:
        from_pretrained(originals["single"], dtype=dtype)
    _assert_clean(info.value, "dtype=", "float32, bfloat16")


def test_cli_with_a_broken_config_json_exits_2_with_one_line(originals, tmp_path):
    """sis_offpolicy reads model.hf_path's config.json first thing in its entry, before any
    training; the fresh run directory is removed again."""
    path = _copy(originals, tmp_path)
    _write(os.path.join(path, "config.json"), b'{"architectures": ["Qwen3ForCausalLM"],')
    out = tmp_path / "run"
    result = run_cli(["--exp=sis_offpolicy", "--variant=quick", "--set", f"model.hf_path={path}",
                      f"--out={out}"], timeout=120)
    err = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert os.path.join(path, "config.json") in err and "not valid JSON" in err, err
    assert not out.exists()
