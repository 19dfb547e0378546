"""Sequential pruning of the foundation LM: the public ``prune`` API on a param tree, and proof
that each layer is calibrated on the already-pruned model's activations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models.attention import segment_causal_mask
from jaxflow.models.transformer import PRESETS, Transformer
from jaxflow.prune import prune
from jaxflow.prune.masks import prune_count
from jaxflow.prune.sparsegpt import hessian_from_inputs, sparsegpt_prune

CFG = PRESETS["tiny"]
LINEAR = (("attn", "wq"), ("attn", "wk"), ("attn", "wv"), ("attn", "wo"), ("mlp", "w_gate"),
          ("mlp", "w_up"), ("mlp", "w_down"))


@pytest.fixture(scope="module")
def setup():
    params = nnx.to_pure_dict(nnx.state(Transformer(CFG, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    batches = [rng.integers(3, CFG.vocab_size, size=(4, 16)).astype(np.int32) for _ in range(2)]
    pruned, report = prune(params, batches, 0.5, method="sparsegpt", model_config=CFG)
    dense_fed, _ = prune(params, batches, 0.5, method="sparsegpt", model_config=CFG, feed="dense")
    return params, batches, pruned, report, dense_fed


def test_prune_api_on_lm_param_tree(setup):
    params, _, pruned, report, _ = setup
    assert jax.tree.structure(pruned) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(pruned)):
        assert a.shape == b.shape and a.dtype == b.dtype
    for layer in params["layers"]:
        for mod, name in LINEAR:
            w = np.asarray(pruned["layers"][layer][mod][name])
            assert (w == 0).sum() == prune_count(w.size, 0.5), (layer, name)
        for norm in ("attn_norm", "mlp_norm"):
            np.testing.assert_array_equal(pruned["layers"][layer][norm]["scale"],
                                          params["layers"][layer][norm]["scale"])
    np.testing.assert_array_equal(pruned["embedding"], params["embedding"])
    np.testing.assert_array_equal(pruned["lm_head"], params["lm_head"])
    assert len(report) == CFG.n_layers * len(LINEAR)
    assert all(0 < r.calib_error < 1 for r in report)
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.State(pruned))  # loads back into the model
    assert np.all(np.isfinite(np.asarray(model(jnp.ones((1, 8), jnp.int32)))))


def test_layer_is_calibrated_on_pruned_predecessors(setup):
    params, batches, pruned, _, dense_fed = setup
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.State(pruned))
    pos = jnp.broadcast_to(jnp.arange(16), (4, 16))
    mask = segment_causal_mask(jnp.ones((4, 16), jnp.int32))
    # inputs of layer 1's wq/wk/wv: attn_norm(layer0_pruned(embed(tokens)))
    inputs = [model.layers[1].attn_norm(model.layers[0](model._embed(jnp.asarray(b)), pos, mask))
              for b in batches]
    h = hessian_from_inputs(jnp.concatenate([x.reshape(-1, CFG.d_model) for x in inputs]))
    wq = jnp.asarray(params["layers"][1]["attn"]["wq"]).reshape(CFG.d_model, -1).T
    expected = np.asarray(sparsegpt_prune(wq, h, 0.5)[0].T.reshape(params["layers"][1]["attn"]["wq"].shape))
    got = np.asarray(pruned["layers"][1]["attn"]["wq"])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # Feeding dense activations gives a measurably different layer 1 (so the check above can fail).
    other = np.asarray(dense_fed["layers"][1]["attn"]["wq"])
    assert np.abs(other - expected).max() > 100 * 1e-5
    # Layer 0 sees identical inputs either way.
    np.testing.assert_allclose(dense_fed["layers"][0]["attn"]["wq"], pruned["layers"][0]["attn"]["wq"],
                               rtol=1e-6, atol=1e-7)


def test_prune_rejects_unknown_method(setup):
    params, batches, *_ = setup
    with pytest.raises(ValueError, match="method='obs'"):
        prune(params, batches, 0.5, method="obs")
