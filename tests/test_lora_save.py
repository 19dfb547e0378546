"""LoRA that cannot be lost: ``save_pretrained`` with an adapter params tree merges the adapters
(the reload computes the trained policy's logits) or refuses with one line, never writes the
base alone; ``from_pretrained(P, lora=...)`` adds B = 0 adapters (the base's logits, on one
device or a mesh); the run log's trainable-parameter line."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_fixtures import tiny_qwen3
from flax import nnx

from jaxflow.errors import UserError
from jaxflow.mesh import make_mesh
from jaxflow.models import Transformer, from_pretrained, load_hf_params, lora, save_pretrained
from jaxflow.models.hf_checkpoint import hf_tensors, write_random_checkpoint

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 320, size=(2, 8)), jnp.int32)
RANK = 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lora_save") / "base")
    write_random_checkpoint(tiny_qwen3(), path, seed=0, std=0.2)
    return path


def _trained(params: dict) -> dict:
    """``params`` with every B made non-zero (a trained adapter)."""
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if str(p[-1].key).endswith("_lora_b") else x, params)


_forward = jax.jit(lambda model: model(TOKENS))  # one compile per config (eager: one per op)


def _logits(model) -> np.ndarray:
    return np.asarray(_forward(model))


def _model(config, params):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def test_from_pretrained_with_lora_then_save_merges_or_refuses(base_dir, tmp_path):
    base = from_pretrained(base_dir)
    cfg = lora.LoraConfig(rank=RANK, alpha=8.0)
    with_lora = from_pretrained(base_dir, lora=cfg)
    assert with_lora.config.lora == cfg
    params = nnx.to_pure_dict(nnx.state(with_lora, nnx.Param))
    assert lora.has_adapters(params)
    base_logits = _logits(base)
    np.testing.assert_array_equal(_logits(with_lora), base_logits)  # B = 0: exactly the base

    params = _trained(params)
    trained_logits = _logits(_model(with_lora.config, params))
    assert np.max(np.abs(trained_logits - base_logits)) > 1e-2

    # a base model + adapter params: no LoRA config to merge with -> one line, nothing written
    out = str(tmp_path / "refused")
    with pytest.raises(lora.AdapterError) as e:
        save_pretrained(base, out, params=params)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert "14 LoRA adapter leaves" in str(e.value) and "lora=LoraConfig(rank=4" in str(e.value)
    with pytest.raises(lora.AdapterError, match="rank 4, targets .* do not match LoraConfig\\(rank=8"):
        save_pretrained(base, out, params=params, lora=lora.LoraConfig(rank=8))
    with pytest.raises(lora.AdapterError, match="do not match LoraConfig\\(rank=4, targets=q,v\\)"):
        save_pretrained(base, out, params=params, lora=lora.LoraConfig(rank=RANK, targets=("q", "v")))
    with pytest.raises(lora.AdapterError, match="hf_tensors got params with LoRA adapters"):
        next(hf_tensors(params, base.config))  # the low-level reader never skips them either
    assert not os.path.exists(out)

    # ... with the config: merged weights (the trained policy's logits) + a PEFT adapter
    save_pretrained(base, out, params=params, lora=cfg)
    assert sorted(os.listdir(out)) == ["adapter", "config.json", "model.safetensors"]
    np.testing.assert_allclose(_logits(from_pretrained(out)), trained_logits, rtol=0, atol=1e-6)
    # the LoRA model's own config merges too (params=None: its own adapters)
    save_pretrained(_model(with_lora.config, params), str(tmp_path / "own"))
    np.testing.assert_allclose(_logits(from_pretrained(str(tmp_path / "own"))), trained_logits,
                               rtol=0, atol=1e-6)


def test_load_hf_params_places_fresh_adapters_on_the_mesh(base_dir):
    mesh = make_mesh({"fsdp": 2, "model": 2}, jax.devices()[:4])
    config = dataclasses.replace(tiny_qwen3(), lora=lora.LoraConfig(rank=RANK))
    params, _ = load_hf_params(base_dir, config, mesh=mesh)
    a, b = params["layers"][0]["attn"]["wq_lora_a"], params["layers"][0]["attn"]["wq_lora_b"]
    assert a.shape == (32, RANK) and b.shape == (RANK, 2, 16)
    assert a.sharding.mesh.shape == mesh.shape and b.sharding.mesh.shape == mesh.shape
    assert not np.any(np.asarray(b)) and np.any(np.asarray(a))
    # the same A as the one-device load (a pure function of the LoRA seed)
    single, _ = load_hf_params(base_dir, config)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(single["layers"][0]["attn"]["wq_lora_a"]))


def test_trainable_summary_and_log_line():
    rng = np.random.default_rng(0)
    base = {"embedding": rng.normal(size=(10, 4)), "layers": {0: {"attn": {"wq": rng.normal(size=(4, 6))}}}}
    assert lora.trainable_summary(base) == (64, 64)
    assert lora.describe_trainable(base) == "full fine-tuning: 64 of 64 parameters train (100%)"
    with_adapters = {"embedding": np.zeros((1000, 4)), "layers": {0: {"attn": {
        "wq": np.zeros((4, 6)), "wq_lora_a": np.zeros((4, 2)), "wq_lora_b": np.zeros((2, 6))}}}}
    assert lora.trainable_summary(with_adapters) == (20, 4044)
    assert lora.describe_trainable(with_adapters) == "LoRA rank 2: 20 of 4,044 parameters train (0.5%)"
