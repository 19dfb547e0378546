"""strict micro-batch pipeline == synchronous barrier training (same samples, same updates);
bounded staleness; parallel rollout workers, state swapping and resumption are bit-exact.

Two agents of different sizes (solver d=32, verifier d=16) on disjoint trainer / rollout
sub-meshes of the 8 fake CPU devices. The module fixture compiles once; later tests reuse it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.marl.pipeline import (
    AgentRuntime,
    Interrupted,
    PipelineConfig,
    group_rows,
    input_prompts,
    relative_param_diff,
    rollout_input,
    run_bounded,
    run_strict,
    run_sync,
    stack_rows,
    weighted_grad,
)
from jaxflow.marl.store import ExperienceStore
from jaxflow.marl.swap import AgentStateSwapper, swap_in, swap_out
from jaxflow.marl.workflow import solver_verifier_workflow
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import grpo_loss
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


def test_pipeline_config_is_frozen_and_validated():
    wf = solver_verifier_workflow(SOLVER, VERIFIER, group_size=4)
    config = PipelineConfig(wf, {}, steps=STEPS, n_inputs=INPUTS, seed=0)
    assert config.names == tuple(wf.order()) and config.inline  # auto: strict, one worker
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout_s = 0.0
    assert not dataclasses.replace(config, driver="threads").inline
    assert not dataclasses.replace(config, mode="bounded", eta=1).inline
    for bad, match in [(dict(mode="lazy"), "'lazy'"), (dict(eta=1), "eta=1"),
                       (dict(micro_inputs=3), "micro_inputs=3"),
                       (dict(mode="bounded", eta=1, rollout_workers=3, driver="inline"),
                        "mode='bounded'")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(config, **bad)


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
    params = rt.init_policy(init["solver"]).params
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
    # Only the summation order differs (per-input micro-batch programs vs one full-batch program),
    # so the tolerance is a few tens of f32 ulps: XLA CPU's rounding of the reordered reductions
    # reaches 1.7e-6 per leaf on an AVX-512 AMD EPYC host (1e-6 held on the CPU it was first
    # calibrated on). A wrong accumulation is 3-4 orders of magnitude further away (below).
    tol = 32 * float(np.finfo(np.float32).eps)  # 3.8e-6
    assert relative_param_diff(got, want) <= tol
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want)) > 0
    unweighted = jax.tree.map(lambda x: x / len(groups), total)  # mean of sums: not the loss
    assert relative_param_diff(unweighted, want) > 1e3 * tol
    partial_sum = jax.tree.map(lambda x, g: x - g, total, gr)  # last micro-batch dropped
    assert relative_param_diff(jax.tree.map(lambda x: x / (weight - w), partial_sum), want) > 1e3 * tol


def test_accumulation_weights_tokens_after_the_correction_mask(setup):
    # Geo-RS drops a row whose geometric-mean pi_old / pi_behaviour leaves [0.999, 1.001] from
    # the loss and its normaliser; the micro-batches drop different shares (two rows / one), so
    # weighting them by their raw response tokens is not the full-batch gradient, weighting by
    # the tokens the correction keeps (policy_loss.aggregation_weight) is.
    wf, runtimes, init = setup
    rt = runtimes["solver"]
    config = dataclasses.replace(rt.config, loss=dataclasses.replace(rt.config.loss, correction="geo-rs"))
    params = rt.init_policy(init["solver"]).params
    published = {n: r.publish(r.init_policy(init[n])) for n, r in runtimes.items()}
    groups = []
    for i, prompt in enumerate(input_prompts(wf, 0, 0, INPUTS)):
        out = rollout_input(wf, runtimes, published, prompt, seed=0, version=0, input_id=i)
        rows = group_rows(out["solver"], rt.spec.group_size)
        for j, r in enumerate(rows):  # behaviour 1 nat above pi_old on one token
            hit = np.zeros(r["mask"].shape, bool)
            if (i == 0 and j < 2) or (i == 1 and j == 0):  # two rows of the first, one of the second
                hit[np.flatnonzero(r["mask"])[0]] = True
            r["behaviour_logp"] = r["behaviour_logp"] + np.where(hit, 1.0, 0.0).astype(np.float32)
        groups.append(rows)
    key = jax.random.key(0)
    grad_of = jax.jit(functools.partial(weighted_grad, fns=rt.fns, config=config))
    full = rt.place(stack_rows([r for g in groups for r in g]))
    loss = functools.partial(grpo_loss, fns=rt.fns, config=config)
    want, metrics = jax.jit(jax.grad(loss, has_aux=True))(params, full, rt.old_stats(params, None, full), key=key)
    total, weight, raw_total, raw_weight = None, 0.0, None, 0.0
    for g in groups:
        mb = rt.place(stack_rows(g))
        gr, w = grad_of(params, mb, rt.old_stats(params, None, mb), key=key)
        raw = float(jnp.sum(mb.mask))
        assert float(w) < raw  # the correction dropped tokens of this micro-batch
        raw_g = jax.tree.map(lambda x: x / w * raw, gr)  # the raw-mask weighting this replaced
        total = gr if total is None else jax.tree.map(jnp.add, total, gr)
        raw_total = raw_g if raw_total is None else jax.tree.map(jnp.add, raw_total, raw_g)
        weight, raw_weight = weight + w, raw_weight + raw
    tol = 32 * float(np.finfo(np.float32).eps)
    assert relative_param_diff(jax.tree.map(lambda x: x / weight, total), want) <= tol
    assert relative_param_diff(jax.tree.map(lambda x: x / raw_weight, raw_total), want) > 1e3 * tol


def _bit_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def strict_run(setup):
    wf, runtimes, init = setup
    return run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                      seed=0, timeout_s=300)


def test_bounded_eta0_is_strict_and_eta1_is_stale_and_says_so(setup, strict_run):
    wf, runtimes, init = setup
    kw = dict(steps=STEPS, n_inputs=INPUTS, seed=0, timeout_s=300)
    b0 = run_bounded(wf, runtimes, _policies(runtimes, init), eta=0, **kw)
    assert all(_bit_equal(b0.params[v], strict_run.params[v]) for v in range(STEPS))
    assert b0.staleness == {"max": 0.0, "mean": 0.0}
    b1 = run_bounded(wf, runtimes, _policies(runtimes, init), eta=1, **kw)
    # batch 1 may roll out on version 0 weights (the rollout thread runs ahead); the run
    # reports the lag it actually consumed, bounded by eta
    assert 0.0 <= b1.staleness["mean"] <= b1.staleness["max"] <= 1.0
    if b1.staleness["max"] == 1.0:  # stale rows change the update far beyond 1e-6
        assert max(relative_param_diff(b1.params[-1][n], strict_run.params[-1][n])
                   for n in wf.order()) > 1e-3
    assert all(_bit_equal(b1.params[0][n], strict_run.params[0][n]) for n in wf.order())


def test_parallel_batched_rollout_workers_are_bit_identical_to_one_worker(setup, strict_run):
    # per-agent worker pools (agent-level split), requests of 2 inputs per engine call:
    # samples do not depend on batching or on which worker ran them
    wf, runtimes, init = setup
    par = run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                     seed=0, rollout_workers=3, rollout_batch=2, timeout_s=300)
    assert sum(par.workers.values()) == 3 and min(par.workers.values()) >= 1
    assert par.rewards == strict_run.rewards
    assert all(_bit_equal(par.params[v], strict_run.params[v]) for v in range(STEPS))


def test_swap_round_trip_and_swapping_run_are_bit_exact(setup, strict_run, tmp_path):
    wf, runtimes, init = setup
    rt = runtimes["solver"]
    policy = rt.init_policy(init["solver"])
    want = jax.device_get(policy)
    shardings = jax.tree.map(lambda x: x.sharding, policy)
    host = swap_out(policy)
    assert all(x.is_deleted() for x in jax.tree.leaves(policy))  # device memory freed
    back = swap_in(host, shardings)
    assert _bit_equal(back, want)
    assert jax.tree.map(lambda x: x.sharding, back) == shardings
    swapper = AgentStateSwapper(str(tmp_path / "states"))
    run = run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                     seed=0, swapper=swapper, timeout_s=300)
    assert run.swap["swaps"] >= 2 * (STEPS - 1) * len(wf.order())
    assert all(_bit_equal(run.params[v], strict_run.params[v]) for v in range(STEPS))
    # orbax durability: the copy saved when the solver went idle after step 0
    restored = swapper.restore("solver", 1)
    assert _bit_equal(restored.params, strict_run.params[0]["solver"])
    swapper.close()


def test_trainer_stopped_mid_version_resumes_bit_identically(setup, strict_run, tmp_path):
    wf, runtimes, init = setup
    store = ExperienceStore(wf.order(), str(tmp_path))
    stop_at = ("solver", 1, 1)  # after the first of version 1's two micro-batches
    with pytest.raises(Interrupted):
        run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                   seed=0, store=store, interrupt=lambda *at: at == stop_at, timeout_s=300)
    store.close()  # the stopped trainer's process is gone: its writer lock with it
    reopened = ExperienceStore.open(str(tmp_path))
    state = reopened.consumer_state("solver")
    assert (int(state["version"]), int(state["micro"])) == (1, 1)  # really mid-version
    resumed = run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS,
                         n_inputs=INPUTS, seed=0, store=reopened, resume=True, timeout_s=300)
    assert _bit_equal(resumed.params[-1], strict_run.params[-1])
    for n in wf.order():
        total = STEPS * INPUTS * runtimes[n].spec.group_size
        assert reopened.count(n, "consumed") == total == reopened.count(n)


def test_inline_and_thread_drivers_and_unblocked_lockstep_are_bit_identical(setup, strict_run):
    # auto picks the inline driver here (strict, one rollout worker): the trainers dispatch on
    # the rollout's thread; the thread driver runs the same programs on blocking threads
    wf, runtimes, init = setup
    kw = dict(steps=STEPS, n_inputs=INPUTS, seed=0, timeout_s=300)
    threads = run_strict(wf, runtimes, _policies(runtimes, init), driver="threads", **kw)
    assert threads.rewards == strict_run.rewards
    assert all(_bit_equal(threads.params[v], strict_run.params[v]) for v in range(STEPS))
    blocked = run_sync(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                       seed=0)
    unblocked = run_sync(wf, runtimes, _policies(runtimes, init), steps=STEPS,
                         n_inputs=INPUTS, seed=0, block_stages=False)
    assert all(_bit_equal(unblocked.params[v], blocked.params[v]) for v in range(STEPS))
    for bad, match in [(dict(driver="inline", rollout_workers=3), "rollout_workers=3"),
                       (dict(driver="fibers"), "'fibers'")]:
        with pytest.raises(ValueError, match=match):
            run_strict(wf, runtimes, _policies(runtimes, init), **bad, **kw)
    with pytest.raises(ValueError, match="mode='bounded'"):
        run_bounded(wf, runtimes, _policies(runtimes, init), eta=1, driver="inline", **kw)


def test_trainer_stopped_after_its_step_resumes_from_stored_upstream_rows(setup, strict_run,
                                                                         tmp_path):
    # the solver stops right after version 0's step (its state: version 1, nothing
    # accumulated) before the verifier rolled out version 0: the resumed rollout regenerates
    # only the verifier's rows, on prompts read from the stored solver rows (the solver's
    # version-0 weights are gone)
    wf, runtimes, init = setup
    store = ExperienceStore(wf.order(), str(tmp_path))
    with pytest.raises(Interrupted):
        run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS,
                   seed=0, store=store, interrupt=lambda *at: at == ("solver", 0, INPUTS),
                   timeout_s=300)
    store.close()
    reopened = ExperienceStore.open(str(tmp_path))
    state = reopened.consumer_state("solver")
    assert (int(state["version"]), int(state["micro"])) == (1, 0) and "weight_sum" not in state
    assert reopened.count("verifier") == 0
    resumed = run_strict(wf, runtimes, _policies(runtimes, init), steps=STEPS,
                         n_inputs=INPUTS, seed=0, store=reopened, resume=True, timeout_s=300)
    assert _bit_equal(resumed.params[-1], strict_run.params[-1])
    assert resumed.params[0]["verifier"] and not resumed.params[0].get("solver")


def test_flexmarl_system_step_is_the_lockstep_version_and_evaluate_trains_nothing(setup):
    # FlexMARLSystem.step (one lockstep version, keyed by version_keys) equals run_sync's
    # version bit for bit; its state is a frozen pytree of the policies and initial params
    from configs.flexmarl import get_config
    from jaxflow.marl.pipeline import group_row_keys, request_row_keys, version_keys
    from jaxflow.marl.processes import host_tree
    from jaxflow.marl.system import FlexMARLParts, FlexMARLState, FlexMARLSystem
    from jaxflow.system import check_system

    wf, runtimes, init = setup
    system = FlexMARLSystem()
    assert check_system(system) == []
    config = dataclasses.replace(get_config("quick"), n_inputs=INPUTS, seed=0, rollout_batch=1)
    state = system.restart(FlexMARLState({}, init, 0, FlexMARLParts(config, wf, runtimes, {})))
    sync = run_sync(wf, runtimes, _policies(runtimes, init), steps=STEPS, n_inputs=INPUTS, seed=0)
    for v in range(STEPS):
        state, metrics = system.step(state, None, key=version_keys(0, v))
        assert state.version == v + 1
        assert {n: metrics[f"reward/{n}"] for n in wf.order()} == sync.rewards[v]
        assert _bit_equal({n: host_tree(p.params) for n, p in state.policies.items()},
                          sync.params[v])
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.version = 0
    # the static fields are not leaves: only arrays are
    assert all(hasattr(x, "shape") for x in jax.tree.leaves(state))
    params = {n: host_tree(p.params) for n, p in state.policies.items()}
    scores = system.evaluate(state)
    assert sorted(scores) == [f"eval/reward/{n}" for n in sorted(wf.order())]
    assert all(0.0 <= s <= 1.0 for s in scores.values())
    assert _bit_equal({n: host_tree(p.params) for n, p in state.policies.items()}, params)
    # the step's keys are the pipeline's: row keys from the sample stream equal request_row_keys
    a = group_row_keys(version_keys(3, 1)[0], [5, 6], 1, 4)
    b = request_row_keys(3, 1, [5, 6], 1, 4)
    assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    with pytest.raises(ValueError, match=r"one key per agent, shape \(2,\)"):
        system.init(config, {}, jax.random.key(0))
