"""strict micro-batch pipeline == synchronous barrier training (same samples, same updates).

Two agents of different sizes (solver d=32, verifier d=16) on disjoint trainer / rollout
sub-meshes of the 8 fake CPU devices.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxflow.marl.pipeline import (AgentRuntime, group_rows, input_prompts, relative_param_diff,
                                   rollout_input, run_strict, run_sync, stack_rows)
from jaxflow.rl.grpo import grpo_loss
from jaxflow.marl.store import ExperienceStore
from jaxflow.marl.workflow import solver_verifier_workflow
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig, init_params

SOLVER = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                           d_ff=64, max_seq_len=32)
VERIFIER = TransformerConfig(vocab_size=23, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                             d_ff=32, max_seq_len=32)
STEPS, INPUTS = 2, 2


@pytest.fixture(scope="module")
def setup():
    wf = solver_verifier_workflow(SOLVER, VERIFIER, group_size=4)
    meshes = role_meshes({"trainer": 1, "rollout": 1})
    optim = OptimConfig(lr=1e-2, warmup_steps=0)
    # entropy bonus: non-zero gradients even when a group's rewards are all equal
    runtimes = {a.name: AgentRuntime(a, wf, meshes, optim, n_inputs=INPUTS, total_steps=STEPS,
                                     entropy_coef=0.05) for a in wf.agents}
    init = {n: jax.device_get(init_params(rt.fns, rt.spec.model, jax.random.key(i)))
            for i, (n, rt) in enumerate(runtimes.items())}
    return wf, runtimes, init


def _policies(runtimes, init):
    return {n: rt.init_policy(init[n]) for n, rt in runtimes.items()}


def test_strict_pipeline_equals_synchronous_training(setup, tmp_path):
    wf, runtimes, init = setup
    sync = run_sync(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS, seed=0)
    store = ExperienceStore(wf.order(), str(tmp_path))
    strict = run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                        seed=0, store=store, timeout_s=300)
    assert strict.rewards == sync.rewards  # the same samples
    # per step and agent: ||strict - sync|| / ||sync|| per leaf (AdamW's normalisation turns
    # summation-order ulps in small gradient entries into ~1e-7-relative parameter changes)
    for v in range(STEPS):
        for n in wf.order():
            assert relative_param_diff(strict.params[v][n], sync.params[v][n]) <= 1e-6, (v, n)
    # could fail: training moved every agent's params well beyond the tolerance
    for n in wf.order():
        assert relative_param_diff(sync.params[-1][n], init[n]) > 1e-3
    # every row was consumed exactly once
    for n in wf.order():
        total = STEPS * INPUTS * runtimes[n].spec.group_size
        assert store.count(n, "consumed") == total == store.count(n)


def test_accumulated_micro_batch_gradient_equals_full_batch_gradient(setup):
    # The optimizer-free core of strict == sync: sum_mb grad_mb * w_mb / sum_mb w_mb is the
    # full-batch gradient up to summation order (AdamW then amplifies those ulps, see above).
    wf, runtimes, init = setup
    rt = runtimes["solver"]
    params = rt.init_policy(init["solver"])["params"]
    published = {n: r.publish(r.init_policy(init[n])) for n, r in runtimes.items()}
    groups = []
    for i, prompt in enumerate(input_prompts(wf, 0, 0, INPUTS)):
        out = rollout_input(wf, runtimes, published, prompt, seed=0, version=0, input_id=i)
        groups.append(group_rows(out["solver"], rt.spec.group_size))
    key = jax.random.key(0)
    full = rt.place(stack_rows([r for g in groups for r in g]))
    old = rt.old_stats(params, None, full)
    loss = functools.partial(grpo_loss, fns=rt.fns, config=rt.config)
    want, _ = jax.jit(jax.grad(loss, has_aux=True))(params, full, old, key=key)
    total, weight = None, 0.0
    for g in groups:
        mb = rt.place(stack_rows(g))
        gr, w = rt.weighted_grad(params, mb, rt.old_stats(params, None, mb), key=key)
        total = gr if total is None else jax.tree.map(jnp.add, total, gr)
        weight = weight + w
    got = jax.tree.map(lambda x: x / weight, total)
    assert relative_param_diff(got, want) <= 1e-6
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want)) > 0
