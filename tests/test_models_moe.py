"""MoE: capacity dispatch == dense all-experts reference when nothing is dropped, the dropped
fraction and what is dropped, shard_map expert parallelism on 8 devices == single device
(values and gradients), the MoE Transformer on an expert mesh, TPU/GPU lowering."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.mesh import make_mesh
from jaxflow.models import Transformer, TransformerConfig, from_pretrained
from jaxflow.models.hf_checkpoint import write_random_checkpoint
from jaxflow.models.moe import (
    Routing,
    expert_capacity,
    load_balancing_loss,
    moe_dense,
    moe_dispatch,
    moe_expert_parallel,
    route,
)

N, D, F, E, K = 64, 16, 24, 8, 2


@pytest.fixture(scope="module")
def weights():
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (N, D))
    router = jax.random.normal(ks[1], (D, E))
    w_gate = jax.random.normal(ks[2], (E, D, F)) * D**-0.5
    w_up = jax.random.normal(ks[3], (E, D, F)) * D**-0.5
    w_down = jax.random.normal(ks[4], (E, F, D)) * F**-0.5
    return x, router, w_gate, w_up, w_down


def _kept_mask(experts: np.ndarray, capacity: int) -> np.ndarray:
    """Choice-major first-come capacity, recomputed with plain loops."""
    load = np.zeros(E, int)
    kept = np.zeros(experts.shape, bool)
    for c in range(experts.shape[1]):
        for n in range(experts.shape[0]):
            e = experts[n, c]
            kept[n, c] = load[e] < capacity
            load[e] += 1
    return kept


def test_router_normalises_topk(weights):
    x, router = weights[:2]
    r = route(x, router, k=K, norm_topk_prob=True)
    np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-6)
    raw = route(x, router, k=K, norm_topk_prob=False)
    probs = jax.nn.softmax(x @ router, axis=-1)
    np.testing.assert_allclose(raw.weights, jnp.sort(probs, axis=-1)[:, ::-1][:, :K], rtol=1e-5)


def test_dispatch_equals_dense_when_capacity_covers_the_max_load(weights):
    x, router, *w = weights
    r = route(x, router, k=K, norm_topk_prob=True)
    max_load = int(np.bincount(np.asarray(r.experts).ravel(), minlength=E).max())
    factor = max_load * E / (N * K)  # capacity == the largest expert load exactly
    assert expert_capacity(N, K, E, factor) == max_load
    y, dropped = jax.jit(moe_dispatch, static_argnames="capacity_factor")(
        x, r, *w, capacity_factor=factor)
    assert float(dropped) == 0.0
    np.testing.assert_allclose(y, moe_dense(x, r, *w), atol=1e-5)


def test_small_capacity_drops_exactly_the_overflow(weights):
    x, router, *w = weights
    r = route(x, router, k=K, norm_topk_prob=True)
    capacity = expert_capacity(N, K, E, 0.5)
    kept = _kept_mask(np.asarray(r.experts), capacity)
    y, dropped = moe_dispatch(x, r, *w, capacity_factor=0.5)
    assert 0 < float(dropped) == pytest.approx(1 - kept.mean())
    # == dense with the dropped choices' weights set to zero
    masked = Routing(jnp.where(kept, r.weights, 0.0), r.experts, r.logits)
    np.testing.assert_allclose(y, moe_dense(x, masked, *w), atol=1e-5)


@pytest.fixture(scope="module")
def expert_mesh():
    return make_mesh({"expert": 8})


def _ep(mesh, factor):
    return jax.jit(lambda x, router, *w: moe_expert_parallel(
        x, router, *w, mesh=mesh, axis="expert", k=K, norm_topk_prob=True,
        capacity_factor=factor))


@pytest.mark.parametrize("factor", [8.0, 0.75])
def test_expert_parallel_equals_per_shard_dispatch(weights, expert_mesh, factor):
    """8 token shards x 8 expert shards with all-to-all == each shard's own dispatch on one
    device (capacity per source shard); with factor E nothing drops and it equals dense."""
    x, router, *w = weights
    y, stats = _ep(expert_mesh, factor)(x, router, *w)
    per_shard = jax.jit(jax.vmap(lambda c: moe_dispatch(
        c, route(c, router, k=K, norm_topk_prob=True), *w, capacity_factor=factor)))
    ys, drops = per_shard(x.reshape(8, N // 8, D))
    drops = np.asarray(drops)
    np.testing.assert_allclose(y, ys.reshape(N, D), atol=1e-5)
    assert float(stats.dropped_fraction) == pytest.approx(np.mean(drops), abs=1e-6)
    np.testing.assert_allclose(stats.router_logits, x @ router, atol=1e-5)
    if factor == 8.0:
        assert np.mean(drops) == 0.0
        np.testing.assert_allclose(y, moe_dense(x, route(x, router, k=K, norm_topk_prob=True),
                                                *w), atol=1e-5)
    else:
        assert np.mean(drops) > 0


def test_expert_parallel_gradients_equal_dense(weights, expert_mesh):
    x, router, *w = weights

    def loss_ep(x, router, *w):
        return jnp.sum(_ep(expert_mesh, 8.0)(x, router, *w)[0] ** 2)

    def loss_dense(x, router, *w):
        return jnp.sum(moe_dense(x, route(x, router, k=K, norm_topk_prob=True), *w) ** 2)

    g_ep = jax.jit(jax.grad(loss_ep, argnums=(0, 1, 2, 3, 4)))(x, router, *w)
    g_dense = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2, 3, 4)))(x, router, *w)
    for a, b in zip(g_ep, g_dense):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_moe_transformer_on_an_expert_mesh_equals_dense_reference(tmp_path):
    cfg = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2,
                            d_ff=32, max_seq_len=16, n_experts=8, n_experts_per_token=2,
                            d_ff_expert=8, dense_layers=(0,), capacity_factor=8.0,
                            qk_norm=True, architecture="qwen3_moe")
    path = str(tmp_path / "moe")
    write_random_checkpoint(cfg, path, seed=2, std=0.3)
    model = from_pretrained(path, capacity_factor=8.0)
    assert model.config == cfg
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 32)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda gd, s, t: nnx.merge(gd, s).forward_with_aux(t), static_argnums=0)
    dense_logits, dense_stats = fwd(graphdef, state, tokens)
    ep_graphdef, _ = nnx.split(nnx.eval_shape(
        lambda: Transformer(dataclasses.replace(cfg, moe_impl="dispatch"), rngs=nnx.Rngs(0))))
    mesh = make_mesh({"data": 1, "expert": 8})
    with jax.set_mesh(mesh):
        ep_logits, ep_stats = fwd(ep_graphdef, state, tokens)
    assert len(ep_stats) == 1 and float(ep_stats[0].dropped_fraction) == 0.0
    np.testing.assert_allclose(ep_logits, dense_logits, atol=1e-5)
    np.testing.assert_allclose(ep_stats[0].router_logits, dense_stats[0].router_logits,
                               atol=1e-5)
    loss = load_balancing_loss([s.router_logits for s in ep_stats], k=2, n_experts=8)
    assert 1.0 <= float(loss) <= 8.0  # k = 2 for a perfectly uniform router


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_expert_parallel_lowers_for_tpu_and_gpu(weights, expert_mesh, platform):
    x, router, *w = weights
    specs = [P("expert"), P(), P("expert"), P("expert"), P("expert")]
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(expert_mesh, s))
            for a, s in zip((x, router, *w), specs)]
    exported = jax.export.export(_ep(expert_mesh, 1.25), platforms=[platform])(*args)
    assert "all_to_all" in exported.mlir_module() or "all-to-all" in exported.mlir_module()
