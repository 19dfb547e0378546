"""LoRA ``save_pretrained``: the merged Hugging Face checkpoint and the PEFT adapter, loaded by
transformers and peft (the ``parity`` extra: torch CPU, transformers, peft), give jaxflow's
LoRA logits."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch
import transformers
from flax import nnx

from jaxflow.mesh import make_mesh
from jaxflow.models import from_pretrained, lora, save_pretrained
from jaxflow.train.lm_state import lm_functions

torch.set_num_threads(1)  # see tests/test_models_hf_parity.py
LOGIT_ATOL = 1e-4  # as tests/test_models_hf_parity.py (f32 logits)
VOCAB = 89


def test_merged_checkpoint_and_peft_adapter_give_jaxflow_lora_logits(tmp_path):
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=False)).eval()
    ref.save_pretrained(tmp_path / "base")
    base = from_pretrained(str(tmp_path / "base"))
    cfg = dataclasses.replace(base.config, lora=lora.LoraConfig(rank=4, alpha=8.0))
    fns = lm_functions(cfg, make_mesh({"data": 1}, jax.devices()[:1]))
    params = lora.add_adapters(nnx.to_pure_dict(nnx.state(base, nnx.Param)), cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    params = jax.tree.unflatten(treedef, [  # trained adapters: B != 0
        0.1 * jax.random.normal(jax.random.key(i), x.shape) if str(p[-1].key).endswith("_lora_b") else x
        for i, (p, x) in enumerate(leaves)])
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16))
    ours = np.asarray(jax.jit(lambda p: fns.model(p)(jnp.asarray(tokens, jnp.int32)))(params))
    base_logits = np.asarray(jax.jit(lambda m: m(jnp.asarray(tokens, jnp.int32)))(base))
    assert np.max(np.abs(ours - base_logits)) > 1e-2  # the adapters change the logits

    save_pretrained(fns.model(params), str(tmp_path / "lora"))
    adapter = tmp_path / "lora" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def torch_logits(model):
        with torch.no_grad():
            return model(torch.from_numpy(tokens)).logits.numpy()

    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "lora").eval()
    np.testing.assert_allclose(torch_logits(merged), ours, rtol=0, atol=LOGIT_ATOL)
    fresh_base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    with_adapter = peft.PeftModel.from_pretrained(fresh_base, adapter).eval()
    n_lora = sum(1 for n, _ in with_adapter.named_parameters() if "lora_" in n)
    assert n_lora == 2 * 7 * 2  # every adapter loaded (none left at PEFT's init)
    np.testing.assert_allclose(torch_logits(with_adapter), ours, rtol=0, atol=LOGIT_ATOL)
    # and our merged checkpoint reloads into jaxflow as the same function
    reloaded = from_pretrained(str(tmp_path / "lora"))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m: m(jnp.asarray(tokens, jnp.int32)))(reloaded)),
                               ours, rtol=0, atol=1e-6)
