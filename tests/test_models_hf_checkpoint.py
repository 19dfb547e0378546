"""Hugging Face checkpoint I/O without torch: save -> load round trips (single file and
indexed shards), loading straight into FSDP x TP x expert shardings, bf16 params, remat, and
one clear error per malformed-checkpoint case."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxflow.mesh import assert_params_sufficiently_sharded, make_mesh
from jaxflow.models import (
    CheckpointError,
    TransformerConfig,
    from_pretrained,
    load_hf_params,
    save_pretrained,
)
from jaxflow.models.hf_checkpoint import write_random_checkpoint

QWEN3 = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=64, max_seq_len=32, head_dim_override=16, qk_norm=True,
                          rope_theta=1e6, tie_embeddings=True, architecture="qwen3")
MOE = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32, head_dim_override=16, qk_norm=True,
                        n_experts=8, n_experts_per_token=2, d_ff_expert=16,
                        architecture="qwen3_moe")


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (loaded model, its directory)}: random checkpoints written with numpy, loaded;
    "moe_sharded" is the loaded MoE model saved again in several files with an index."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, cfg in (("qwen3", QWEN3), ("moe", MOE)):
        write_random_checkpoint(cfg, str(root / name), seed=1, std=0.2)
        out[name] = (from_pretrained(str(root / name)), str(root / name))
    save_pretrained(out["moe"][0], str(root / "moe_sharded"), max_shard_bytes=20_000)
    out["moe_sharded"] = (out["moe"][0], str(root / "moe_sharded"))
    return out


@pytest.mark.parametrize("name", ["qwen3", "moe"])
def test_save_writes_back_the_same_tensors(saved, name, tmp_path):
    model, path = saved[name]
    save_pretrained(model, str(tmp_path / name))
    want = load_file(os.path.join(path, "model.safetensors"))
    got = load_file(str(tmp_path / name / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert (json.load(open(tmp_path / name / "config.json"))
            == json.load(open(os.path.join(path, "config.json"))))


@jax.jit
def _jit_logits(graphdef_state, tokens):
    return nnx.merge(*graphdef_state)(tokens)


def _logits(model, tokens):
    return np.asarray(_jit_logits(nnx.split(model), tokens))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(8, 8)), jnp.int32)


@pytest.mark.parametrize("name", ["qwen3", "moe", "moe_sharded"])
def test_round_trip_is_bit_exact(saved, name):
    model, path = saved[name]
    loaded = from_pretrained(path)
    assert loaded.config == model.config
    jax.tree.map(np.testing.assert_array_equal, _pure(loaded), _pure(model))
    if name == "moe_sharded":
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))


def test_loads_straight_into_fsdp_tp_expert_shardings(saved):
    model, path = saved["moe"]
    mesh = make_mesh({"fsdp": 2, "model": 2, "expert": 2})
    params, stats = load_hf_params(path, model.config, mesh=mesh)
    w = params["layers"][0]["mlp"]["w_gate"]  # [E, d, f]: expert x fsdp x model
    assert w.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", "model")
    assert params["layers"][0]["attn"]["wq"].sharding.spec[:2] == ("fsdp", "model")
    assert_params_sufficiently_sharded(params, mesh, min_size=1024, axes=("fsdp", "model"))
    # one process holds all 8 devices: every byte is read exactly once, replicas are not
    # re-read
    total = sum(a.nbytes for a in load_file(os.path.join(path, "model.safetensors")).values())
    assert stats.bytes_read == total
    jax.tree.map(np.testing.assert_array_equal, params, _pure(model))
    sharded = from_pretrained(path, mesh=mesh)
    np.testing.assert_allclose(_logits(sharded, TOKENS), _logits(model, TOKENS), atol=1e-5)


def test_bf16_params_and_remat(saved):
    model, path = saved["qwen3"]
    bf16 = from_pretrained(path, dtype="bfloat16", remat=True)
    assert bf16.config.remat and bf16.embedding[...].dtype == jnp.bfloat16
    # bf16 keeps 8 mantissa bits (~4e-3 per rounding); through 2 layers the logits moved by
    # 1.8% of their largest magnitude (4.7) when measured.
    want = _logits(model, TOKENS)
    ratio = np.abs(_logits(bf16, TOKENS) - want).max() / np.abs(want).max()
    assert ratio <= 4e-2, ratio

    def loss(params, graphdef, tokens):
        return jnp.mean(nnx.merge(graphdef, params)(tokens) ** 2)

    f32 = from_pretrained(path, remat=True)
    graphdef, params = nnx.split(f32)
    g_remat = jax.jit(jax.grad(loss), static_argnums=1)(params, graphdef, TOKENS)
    graphdef, params = nnx.split(model)
    g_plain = jax.jit(jax.grad(loss), static_argnums=1)(params, graphdef, TOKENS)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_remat, g_plain)


def _copy(saved, tmp_path, name="qwen3"):
    dst = tmp_path / name
    shutil.copytree(saved[name][1], dst)
    return str(dst)


def _rewrite(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*supported: \['LlamaForCausalLM'"):
        from_pretrained(path)


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model.layers.1.self_attn.k_norm.weight'"):
        from_pretrained(path)


def test_extra_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.bias": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.mlp.bias'"):
        from_pretrained(path)


def test_shape_mismatch_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path, "moe")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite(path, lambda t: t.update({name: np.zeros((32, 15), np.float32)}))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(32, 15\).*implies \(32, 16\)"):
        from_pretrained(path)


def test_missing_config_and_bad_index_are_named(saved, tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        from_pretrained(str(tmp_path))
    path = _copy(saved, tmp_path, "moe_sharded")
    index = os.path.join(path, "model.safetensors.index.json")
    data = json.load(open(index))
    data["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    json.dump(data, open(index, "w"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' to 'model-99999"):
        from_pretrained(path)


def test_chunked_reads_of_big_tensors_are_exact(saved, monkeypatch):
    """Tensors over the reader's chunk size are read in row chunks (transposed on the fly):
    same parameters, same bytes read, on one device and on a sharded mesh."""
    from jaxflow.models import hf_checkpoint

    model, path = saved["moe"]
    whole = [load_hf_params(path, model.config, mesh=m)[1].reads
             for m in (None, make_mesh({"fsdp": 2, "model": 4}))]
    monkeypatch.setattr(hf_checkpoint._Reader, "chunk_bytes", 1000)
    for mesh, reads in zip((None, make_mesh({"fsdp": 2, "model": 4})), whole):
        params, stats = load_hf_params(path, model.config, mesh=mesh)
        assert stats.reads > reads  # really chunked
        jax.tree.map(np.testing.assert_array_equal, params, _pure(model))


def test_loaded_qwen3_moe_lowers_for_tpu_and_gpu(saved):
    model, _ = saved["moe"]
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    exported = jax.export.export(forward, platforms=["tpu", "cuda"])(
        abstract, jax.ShapeDtypeStruct((2, 8), jnp.int32))
    assert exported.platforms == ("tpu", "cuda")
    assert exported.out_avals[0].shape == (2, 8, 64)
