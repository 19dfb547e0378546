# ruff: noqa: E402
# title: a Hugging Face checkpoint in, a forward, a save and a reload
# %% [markdown]
# # A Hugging Face checkpoint: in, forward, save, reload
#
# We write a tiny Qwen3-style checkpoint (config.json + safetensors + tokenizer.json) to a
# temporary directory, load it sharded over a 2 x 2 FSDP x tensor-parallel mesh, run a forward
# pass on tokenized text, save it again and reload it. No download: everything is local.

# %% [markdown]
# Four fake CPU devices, requested before any other JAX use.

# %%
import jax

jax.config.update("jax_num_cpu_devices", 4)

# %%
import importlib.util
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxflow.mesh import make_mesh
from jaxflow.models import HFTokenizer, Transformer, TransformerConfig, from_pretrained, save_pretrained

# %% [markdown]
# A word-level tokenizer (the `tokenizers` library) wrapped in `HFTokenizer`, which knows its
# special ids; any `tokenizer.json` works the same way (`HFTokenizer.from_pretrained(dir)`).

# %%
words = ["<|endoftext|>", "<pad>", "[UNK]", "one", "two", "three", "plus", "is", "four", "five"]
raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
raw.pre_tokenizer = pre_tokenizers.Whitespace()
tok = HFTokenizer(raw, eos_id=0, pad_id=1)
print(tok.encode("one plus two is three", eos=True))

# %% [markdown]
# A randomly initialised Qwen3-style model (GQA, q/k RMSNorm, tied embeddings) written as a
# Hugging Face checkpoint with its tokenizer. In practice `path` is a downloaded model
# directory, e.g. Qwen3-0.6B.

# %%
cfg = TransformerConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                        max_seq_len=32, head_dim_override=16, qk_norm=True, rope_theta=1e6,
                        tie_embeddings=True, architecture="qwen3")
original = Transformer(cfg, rngs=nnx.Rngs(0))
workdir = tempfile.mkdtemp(prefix="jaxflow-hf-")
path = os.path.join(workdir, "tiny-qwen3")
save_pretrained(original, path, tokenizer=tok)
print(sorted(os.listdir(path)))

# %% [markdown]
# Load it sharded: each parameter is read straight into its shard of the `fsdp` x `model` mesh.
# The forward takes `[B, T]` token ids (positions default to 0..T-1) and returns float32
# logits `[B, T, V]`.

# %%
mesh = make_mesh({"fsdp": 2, "model": 2})
model = from_pretrained(path, mesh=mesh, dtype="float32")
tok = HFTokenizer.from_pretrained(path)
ids, _ = tok.pad_batch([tok.encode("one plus two is three"), tok.encode("two plus two is four")])
tokens = jnp.asarray(ids)
logits = model(tokens)
print(tokens.shape, "->", logits.shape, logits.dtype)
print("embedding sharding:", model.embedding[...].sharding.spec)

# %% [markdown]
# The sharded forward matches the original single-device model up to float32 rounding (the
# sharded matmuls sum in another order).

# %%
want = original(tokens)
print("max |sharded - original|:", float(jnp.max(jnp.abs(logits - want))))
np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)

# %% [markdown]
# Save the loaded (sharded) model again, with the tokenizer, and reload it on one device.

# %%
path2 = os.path.join(workdir, "resaved")
save_pretrained(model, path2, tokenizer=tok)
reloaded = from_pretrained(path2)
print(sorted(os.listdir(path2)))

# %% [markdown]
# Optional: where `transformers` is installed, its Qwen3 reads the same directory and gives the
# same logits (float32 rounding apart).

# %%
if importlib.util.find_spec("transformers") is not None:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path2, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    print("max |transformers - jaxflow|:", float(np.max(np.abs(hf_logits - np.asarray(want)))))
    np.testing.assert_allclose(hf_logits, want, rtol=1e-4, atol=1e-4)
else:
    print("transformers not installed: parity check skipped")

# %% [markdown]
# Checks: every tensor survived the round trip bit for bit, so the reloaded model's logits equal
# the original's exactly; and the tokenizer came back with its special ids.

# %%
for a, b in zip(jax.tree.leaves(nnx.state(reloaded, nnx.Param)), jax.tree.leaves(nnx.state(original, nnx.Param))):
    np.testing.assert_array_equal(a, b)
np.testing.assert_array_equal(reloaded(tokens), original(tokens))
back = HFTokenizer.from_pretrained(path2)
assert (back.eos_id, back.pad_id) == (0, 1)
assert back.encode("two plus two is four") == [4, 6, 4, 7, 8]
print("reloaded logits == original logits (bit-exact)")
