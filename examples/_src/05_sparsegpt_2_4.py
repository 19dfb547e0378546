# ruff: noqa: E402
# title: SparseGPT 2:4 on a small LM
# %% [markdown]
# # SparseGPT 2:4 on a small LM
#
# SparseGPT prunes every linear layer of the LM, block by block, so that in each group of 4
# consecutive input weights at least 2 are zero (NVIDIA's 2:4 structured sparsity), updating
# the remaining weights to reconstruct the layer's output on calibration data. We compare it
# with plain magnitude pruning to the same pattern.

# %%
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.models import Transformer, TransformerConfig
from jaxflow.prune import prune

# %% [markdown]
# A small LM (its widths are multiples of 4, as 2:4 needs) and its parameters as a pure dict,
# the form `prune` takes and returns.

# %%
cfg = TransformerConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                        max_seq_len=32)
model = Transformer(cfg, rngs=nnx.Rngs(0))
graphdef, state = nnx.split(model)
params = nnx.to_pure_dict(state)
print(jax.tree.map(jnp.shape, params["layers"][0]))

# %% [markdown]
# Calibration data: a few batches of `[B, T]` token ids (real use: text from the domain the
# pruned model must keep working on). Held-out batches measure the damage afterwards.

# %%
keys = jax.random.split(jax.random.key(1), 4)
calibration = [jax.random.randint(k, (8, 32), 0, cfg.vocab_size) for k in keys[:3]]
heldout = jax.random.randint(keys[3], (8, 32), 0, cfg.vocab_size)

# %% [markdown]
# `prune(params, batches, "2:4")` runs SparseGPT layer by layer, feeding each block the
# already-pruned previous blocks' outputs; it returns the pruned params and one report row per
# weight matrix (realised sparsity, calibration reconstruction error).

# %%
pruned, report = prune(params, calibration, "2:4")
magnitude, magnitude_report = prune(params, calibration, "2:4", method="magnitude")
for row, mag in zip(report, magnitude_report):
    print(f"layer {row.layer} {row.name:12} {str(row.shape):10} sparsity {row.sparsity:.2f}  "
          f"error sparsegpt {row.calib_error:.4f}  magnitude {mag.calib_error:.4f}")

# %% [markdown]
# The 2:4 pattern, checked on every pruned matrix: its leading axes are the inputs, so
# `reshape(inputs, outputs).T` is the `[outputs, inputs]` matrix; every group of 4 consecutive
# inputs has at least 2 zeros.

# %%
def weight(tree, row):
    module, name = row.name.split(".")
    return np.asarray(tree["layers"][row.layer][module][name])


for row in report:
    outputs, inputs = row.shape
    w = weight(pruned, row).reshape(inputs, outputs).T  # [outputs, inputs]
    zeros = (w.reshape(outputs, inputs // 4, 4) == 0).sum(axis=-1)
    assert zeros.min() >= 2, (row.name, zeros.min())
print(f"2:4 holds on all {len(report)} matrices")

# %% [markdown]
# The pruned params drop back into the model (`nnx.replace_by_pure_dict`), which runs as
# before. How far do its held-out logits move from the dense model's (relative L2 error; large
# here because a random model's logits are small, so compare the two methods, not the level)?

# %%
def heldout_logits(tree):
    s = jax.tree.map(lambda x: x, state)  # a copy of the dense state's structure to fill
    nnx.replace_by_pure_dict(s, tree)
    return nnx.merge(graphdef, s)(heldout)


def relative_error(tree):
    return float(jnp.linalg.norm(heldout_logits(tree) - dense_logits) / jnp.linalg.norm(dense_logits))


dense_logits = heldout_logits(params)
sparse_err, magnitude_err = relative_error(pruned), relative_error(magnitude)
print(f"held-out logits, relative error vs dense: SparseGPT 2:4 {sparse_err:.4f}, magnitude 2:4 {magnitude_err:.4f}")

# %% [markdown]
# Checks: SparseGPT reconstructs every layer's output better than magnitude pruning to the same
# pattern, so the whole model's output moves less; the embedding (not a linear layer) is untouched.

# %%
for row, mag in zip(report, magnitude_report):
    assert row.calib_error < mag.calib_error, (row, mag)
np.testing.assert_array_equal(pruned["embedding"], params["embedding"])
assert 0 < sparse_err < magnitude_err
