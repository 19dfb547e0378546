"""R3 routing replay for the MoE model: the sampler's record equals the forward's routing, a
replayed forward routes as recorded (and, with the same weights, gives the sampler's log-probs),
and the trainer's router-disagreement metric."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import SamplingConfig, Transformer, make_sampler
from jaxflow.models.moe import expert_index_dtype, moe_dense, route, routing_disagreement
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl import PolicyLossConfig
from jaxflow.rl.grpo_step import GRPOConfig, MiniBatch, grpo_loss, response_hidden, routed_response_hidden
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.rollout import RolloutSpec

MOE = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32, max_seq_len=16,
                        n_experts=8, n_experts_per_token=2, d_ff_expert=16)
B, P, N = 3, 4, 5
LENGTHS = jnp.array([4, 2, 3], jnp.int32)


def test_replayed_route_takes_the_given_experts_with_the_routers_gates():
    x = jax.random.normal(jax.random.key(0), (6, 4))
    router = jax.random.normal(jax.random.key(1), (4, 5))
    own = route(x, router, k=2, norm_topk_prob=True)
    same = route(x, router, k=2, norm_topk_prob=True, experts=own.experts.astype(jnp.uint8))
    np.testing.assert_array_equal(np.asarray(same.weights), np.asarray(own.weights))
    np.testing.assert_array_equal(np.asarray(same.experts), np.asarray(own.experts))
    other = jnp.tile(jnp.array([[3, 4]], jnp.uint8), (6, 1))
    replayed = route(x, router, k=2, norm_topk_prob=True, experts=other)
    probs = jax.nn.softmax(x @ router, axis=-1)[:, 3:5]
    np.testing.assert_allclose(np.asarray(replayed.weights), np.asarray(probs / probs.sum(-1, keepdims=True)),
                               rtol=1e-6)
    w = [jax.random.normal(jax.random.key(i), s) for i, s in ((2, (5, 4, 3)), (3, (5, 4, 3)), (4, (5, 3, 4)))]
    assert not np.allclose(np.asarray(moe_dense(x, replayed, *w)), np.asarray(moe_dense(x, own, *w)))
    # the router still gets a gradient through the replayed gates
    grad = jax.grad(lambda r: moe_dense(x, route(x, r, k=2, norm_topk_prob=True, experts=other), *w).sum())(router)
    assert np.abs(np.asarray(grad)).max() > 0
    with pytest.raises(ValueError, match=r"replayed experts shape \(6, 3\); need \[N, k\] = \[6, 2\]"):
        route(x, router, k=2, norm_topk_prob=True, experts=jnp.zeros((6, 3), jnp.uint8))


def test_expert_index_dtype_and_disagreement():
    assert expert_index_dtype(8) == jnp.uint8 and expert_index_dtype(256) == jnp.uint8
    assert expert_index_dtype(257) == jnp.uint16 and expert_index_dtype(70000) == jnp.uint32
    with pytest.raises(ValueError, match="n_experts=0: need an int >= 1"):
        expert_index_dtype(0)
    a = jnp.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [2 tokens, 2 layers, k 2]
    b = jnp.array([[[1, 0], [2, 4]], [[4, 5], [0, 1]]])  # same set, differs, same, differs
    assert float(routing_disagreement(a, b)) == 0.5
    assert float(routing_disagreement(a, b, jnp.array([[True, False], [True, False]]))) == 0.0


@pytest.fixture(scope="module")
def moe_model():
    graphdef, state = nnx.split(Transformer(MOE, rngs=nnx.Rngs(0)))
    prompts = jax.random.randint(jax.random.key(1), (B, P), 1, MOE.vocab_size, jnp.int32)
    prompts = jnp.where(jnp.arange(P)[None] < LENGTHS[:, None], prompts, 0)
    out = make_sampler(graphdef, SamplingConfig(max_new_tokens=N), record_routing=True)(
        state, prompts, LENGTHS, jax.random.key(0))
    return graphdef, state, prompts, out


class _Fns:
    """The two members of LMFunctions that response_hidden uses, over a live model."""

    def __init__(self, graphdef):
        self.graphdef = graphdef

    def model(self, state):
        return nnx.merge(self.graphdef, state)


def _valid(out):
    """[B, P + N - 1] the positions the trainer's forward feeds real tokens."""
    end = LENGTHS + jnp.asarray(out.mask).sum(1).astype(jnp.int32) - 1
    return np.asarray(jnp.arange(P + N - 1)[None] < end[:, None])


def test_sampler_records_the_forwards_routing_and_replay_reproduces_its_log_probs(moe_model):
    graphdef, state, prompts, out = moe_model
    assert out.routing_experts.shape == (B, P + N - 1, 2, 2) and out.routing_experts.dtype == jnp.uint8
    assert out.routing_gates.shape == out.routing_experts.shape and out.routing_gates.dtype == jnp.float32
    fns = _Fns(graphdef)
    _, _, own = routed_response_hidden(fns, state, prompts, LENGTHS, out.tokens)
    valid = _valid(out)
    np.testing.assert_array_equal(np.sort(np.asarray(own), -1)[valid],
                                  np.sort(np.asarray(out.routing_experts, np.int32), -1)[valid])
    plain = response_hidden(fns, state, prompts, LENGTHS, out.tokens)
    replayed = response_hidden(fns, state, prompts, LENGTHS, out.tokens, out.routing_experts)
    live = np.asarray(out.mask) > 0
    np.testing.assert_array_equal(np.asarray(replayed[0])[live], np.asarray(plain[0])[live])
    logp = fused_logprobs(*replayed, out.tokens, backend="xla").target_logp
    np.testing.assert_allclose(np.asarray(logp)[live], np.asarray(out.logprobs)[live], atol=1e-5)


def test_replay_overrides_a_different_router(moe_model):
    """Trainer weights whose routers differ: without replay its routing disagrees with the
    record; replayed, the forward routes as recorded (its hidden states change)."""
    graphdef, state, prompts, out = moe_model
    moved = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.5 * jax.random.normal(jax.random.key(7), x.shape, x.dtype)
        if "router" in jax.tree_util.keystr(path) else x, state)
    fns = _Fns(graphdef)
    valid = _valid(out)
    _, _, own = routed_response_hidden(fns, moved, prompts, LENGTHS, out.tokens)
    assert float(routing_disagreement(own, out.routing_experts, valid[..., None])) > 0
    plain = response_hidden(fns, moved, prompts, LENGTHS, out.tokens)[0]
    replayed = response_hidden(fns, moved, prompts, LENGTHS, out.tokens, out.routing_experts)[0]
    assert not np.allclose(np.asarray(plain), np.asarray(replayed))


def test_routing_replay_config_and_the_step_metric(moe_model):
    with pytest.raises(ValueError, match=r"^routing_replay='on'; valid: \('off', 'record', 'replay'\)"):
        GRPOConfig(routing_replay="on")
    assert GRPOConfig(routing_replay="replay").rollout_spec.record_routing
    assert not GRPOConfig().rollout_spec.record_routing
    engine_spec = RolloutSpec(record_routing=True, sampler="engine")  # the engine records too
    assert engine_spec.engine.engine_config(4, 5, 3, record_routing=True).record_routing
    from jaxflow.mesh import role_meshes
    from jaxflow.train.lm_state import init_params, lm_functions

    graphdef, state, prompts, out = moe_model
    fns = lm_functions(MOE, role_meshes({"trainer": 1})["trainer"])
    params = init_params(fns, MOE, jax.random.key(0))
    sampled = make_sampler(fns.graphdef, SamplingConfig(max_new_tokens=N), record_routing=True)(
        fns.nnx_state(params), prompts, LENGTHS, jax.random.key(0))
    mb = MiniBatch(prompts, LENGTHS, sampled.tokens, sampled.mask, sampled.logprobs, jnp.array([1.0, -1.0, 0.5]),
                   routing=sampled.routing_experts)
    kw = dict(loss=PolicyLossConfig(), group_size=3, prompts_per_rollout=1, max_new_tokens=N)
    for mode in ("record", "replay"):
        # compiled: op-by-op dispatch of the MoE forward and backward costs more than the compile
        loss = jax.jit(functools.partial(grpo_loss, fns=fns, config=GRPOConfig(routing_replay=mode, **kw)))
        metrics = loss(params, mb, None, key=jax.random.key(1))[1]
        assert float(metrics["moe/router_disagreement"]) == 0.0  # same weights: the same routers
    with pytest.raises(ValueError, match="needs the mini-batch's routing"):
        grpo_loss(params, mb._replace(routing=None), None, fns=fns, config=GRPOConfig(routing_replay="record", **kw),
                  key=jax.random.key(1))


def test_a_trainer_step_with_sis_b_and_routing_replay_shards_the_records():
    """One GRPO step of an MoE policy (trainer 4 + rollout 4 devices, lag 2) with ``sis_b`` and
    R3 replay: the rollout carries the top-K and the routing, the mini-batches carry them sharded
    as the rows, and the step reports the accept rate and the router disagreement (0: the same
    weights sample and train in f32)."""
    import dataclasses

    from jaxflow.data.tokenizer import CharTokenizer
    from jaxflow.mesh import role_meshes
    from jaxflow.rl.grpo import GRPOTrainer
    from jaxflow.rl.tasks import AdditionRLTask
    from jaxflow.train.lm_state import OptimConfig, init_params

    model = dataclasses.replace(MOE, vocab_size=23, max_seq_len=32)
    cfg = GRPOConfig(prompts_per_rollout=2, group_size=4, max_new_tokens=3, sis_topk=4, lag=2,
                     loss=PolicyLossConfig(correction="sis_b"), routing_replay="replay")
    # lr 1e-9: the second mini-batch's routers are (to the top-k) the sampler's too
    trainer = GRPOTrainer(model, cfg, OptimConfig(lr=1e-9, warmup_steps=0), AdditionRLTask(max_digits=1),
                          CharTokenizer(), role_meshes({"trainer": 4, "rollout": 4}), seed=0, total_rollouts=2)
    state = trainer.init_state(init_params(trainer.fns, model, jax.random.key(0)))
    batch = trainer.generate(state)
    width = batch.prompts.shape[1]
    assert batch.behaviour_topk_ids.shape == (8, 3, 4)
    assert batch.routing_experts.shape == (8, width + 2, 2, 2) and batch.routing_experts.dtype == np.uint8
    mbs = trainer.minibatches(batch)
    assert len(mbs) == 2 and mbs[0].routing.shape == (4, width + 2, 2, 2)
    assert mbs[0].routing.sharding == mbs[0].tokens.sharding
    _, metrics = trainer.step(state)
    assert 0 < metrics["actor/accept_rate"] <= 1
    assert metrics["actor/moe/router_disagreement"] == 0.0
