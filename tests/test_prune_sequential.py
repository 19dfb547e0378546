"""Sequential pruning of the foundation LM: the public ``prune`` API on a param tree, proof that
each layer is calibrated on the already-pruned model's activations, and ``PruneSystem`` (the
same pipeline as a System, one block per step) giving ``prune``'s params and report bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.mesh import MeshConfig
from jaxflow.models.attention import segment_causal_mask
from jaxflow.models.transformer import PRESETS, Transformer
from jaxflow.prune import PruneConfig, PruneSystem, prune
from jaxflow.prune.masks import prune_count
from jaxflow.prune.sparsegpt import hessian_from_inputs, sparsegpt_prune
from jaxflow.system import check_system, is_system_state

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


@pytest.fixture(scope="module")
def system_run(setup):
    """PruneSystem run to the end at prune's settings (the jitted block pieces are shared)."""
    params, batches, *_ = setup
    system = PruneSystem(params, batches)
    return system, system.run(PruneConfig(sparsity=0.5, model=CFG))


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


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_system_run_is_prune_bit_for_bit(setup, system_run):
    params, batches, pruned, report, dense_fed = setup
    system, state = system_run
    assert check_system(system) == []
    assert is_system_state(state) and state.done and state.layer == CFG.n_layers
    assert jax.tree.structure(state.params) == jax.tree.structure(pruned)
    assert _leaves_equal(state.params, pruned)
    assert [(r.layer, r.name, r.calib_error, r.sparsity) for r in state.report] == \
        [(r.layer, r.name, r.calib_error, r.sparsity) for r in report]
    dense = system.run(PruneConfig(sparsity=0.5, model=CFG, feed="dense"))
    assert _leaves_equal(dense.params, dense_fed) and not _leaves_equal(dense.params, pruned)


def test_each_step_prunes_one_block_and_leaves_its_input_alone(setup):
    params, batches, *_ = setup
    system = PruneSystem(params, batches)
    state = system.init(PruneConfig(sparsity=0.5, model=CFG), {}, jax.random.key(0))
    before = jax.tree.map(np.asarray, state.params)
    one, metrics = system.step(state, None, key=jax.random.key(1))
    assert state.layer == 0 and _leaves_equal(state.params, before)  # the input state is unchanged
    assert one.layer == 1 and metrics["layer"] == 0.0 and 0 < metrics["calib_error"] < 1
    assert metrics["sparsity"] == pytest.approx(0.5)
    w0, w1 = (np.asarray(one.params["layers"][k]["attn"]["wq"]) for k in sorted(one.params["layers"], key=int)[:2])
    assert (w0 == 0).mean() == pytest.approx(0.5) and (w1 == 0).mean() == 0.0  # block 1 not yet pruned
    assert {r.layer for r in one.report} == {0}
    while not one.done:
        one, _ = system.step(one, None, key=jax.random.key(2))
    with pytest.raises(ValueError, match=rf"state.layer={CFG.n_layers}: all {CFG.n_layers} blocks are pruned"):
        system.step(one, None, key=jax.random.key(3))


def test_evaluate_reports_scores_and_retention(setup, system_run):
    params, batches, *_ = setup
    _, state = system_run

    def evaluator(p):
        return {"norm": float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(p["layers"]))), "one": 1.0}

    dense = evaluator(params)
    system = PruneSystem(params, batches, evaluator=evaluator, dense_scores=dense)
    out = system.evaluate(state)
    assert set(out) == {"score/norm", "score/one", "retention/norm", "retention/one", "retention/total"}
    assert out["score/norm"] == pytest.approx(evaluator(state.params)["norm"])
    assert 0 < out["retention/norm"] < 1 and out["retention/one"] == 1.0
    assert PruneSystem(params, batches).evaluate(state)["sparsity"] == pytest.approx(0.5)


def test_system_config_errors_name_the_value():
    with pytest.raises(ValueError, match="method='obs'; valid: sparsegpt, wanda, magnitude"):
        PruneConfig(method="obs")
    with pytest.raises(ValueError, match="feed='both'; valid: 'pruned', 'dense'"):
        PruneConfig(feed="both")
    with pytest.raises(ValueError, match="at least one calibration batch; got 0"):
        PruneSystem({"layers": {}}, []).init(PruneConfig(), {}, None)


def test_system_programs_on_a_mesh(setup):
    params, batches, *_ = setup
    meshes = {"mesh": MeshConfig().make(jax.devices()[:1])}
    programs = PruneSystem(params, batches).programs(PruneConfig(model=CFG), meshes)
    assert [p.name for p in programs] == ["prune/stage_input/attn_in", "prune/stage_input/attn_out",
                                          "prune/stage_input/mlp_in", "prune/stage_input/mlp_out",
                                          "prune/hessian_update", "prune/block_forward"]
    for p in programs:
        with jax.set_mesh(p.mesh):
            out = jax.eval_shape(p.fn, *p.args, **p.kwargs)
        assert jax.tree.leaves(out)[0].shape[0] in (4, CFG.d_model), p.name
