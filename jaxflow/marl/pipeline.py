"""Micro-batch pipeline: train on rollouts as they finish, step when version v is complete.

Per agent and version v the trainer consumes micro-batches (one input's G trajectories, rows
taken from the :class:`~jaxflow.marl.store.ExperienceStore`) as soon as the rollout engine
stores them, accumulates ``grad(loss_mb) * weight_mb`` (weight = the micro-batch's share of
the loss normaliser: unmasked tokens for ``token-mean``, rows for the ``seq-mean-*`` aggs) and
applies one optimizer step with ``sum(grads) / sum(weights)`` once all of v's rows are
consumed; then it publishes version v+1 and rollouts for v+1 start (``strict`` mode). This is
the synchronous algorithm (:func:`run_sync`: roll out everything, then one full-batch GRPO
step per agent, ``jaxflow.rl.grpo.update_step`` with lag 1) on the same samples, up to the
summation order of the gradient. pi_old == the current params throughout v, so old log-probs
computed per micro-batch equal the full-batch ones.

Samples are a pure function of (seed, version, input, turn), so both runs see the same ones.
``bounded`` (staleness eta) mode is not implemented.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.marl.store import ExperienceStore, Row, SampleId
from jaxflow.marl.workflow import AgentSpec, Workflow
from jaxflow.rl.advantages import grpo_advantages
from jaxflow.rl.grpo import GRPOConfig, MiniBatch, _compiled, grpo_loss
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.rollout import RolloutBatch, RolloutWorker, batch_sharding
from jaxflow.rl.tasks import completion_text
from jaxflow.train.lm_state import OptimConfig

PAYLOAD_FIELDS = MiniBatch._fields  # prompts, prompt_lengths, tokens, mask, behaviour_logp, advantages


# ----------------------------------------------------------------------------- pure functions


def loss_weight(mb: MiniBatch, agg: str) -> jax.Array:
    """The micro-batch's share of the loss normaliser (see module doc)."""
    if agg == "token-mean":
        return jnp.sum(mb.mask)
    return jnp.asarray(mb.mask.shape[0], jnp.float32)


def weighted_grad(params: Any, mb: MiniBatch, old: Any, *, fns, config: GRPOConfig,
                  key: jax.Array) -> tuple[Any, jax.Array]:
    """``(grad(loss_mb) * weight_mb, weight_mb)`` for gradient accumulation."""
    grads, _ = jax.grad(grpo_loss, has_aux=True)(params, mb, old, fns=fns, config=config, key=key)
    w = loss_weight(mb, config.agg)
    return jax.tree.map(lambda g: g * w, grads), w


def apply_accumulated(policy: dict, grad_sum: Any, weight_sum: jax.Array, *,
                      tx: optax.GradientTransformation) -> dict:
    """One optimizer step with the accumulated mean gradient ``grad_sum / weight_sum``."""
    grads = jax.tree.map(lambda g: g / weight_sum, grad_sum)
    updates, opt_state = tx.update(grads, policy["opt_state"], policy["params"])
    return {"params": optax.apply_updates(policy["params"], updates), "opt_state": opt_state,
            "step": policy["step"] + 1}


def group_rows(batch: RolloutBatch, group_size: int, normalize_std: bool = True
               ) -> list[dict[str, np.ndarray]]:
    """One input's G trajectories -> G row payloads with group-normalised advantages."""
    adv = np.asarray(grpo_advantages(jnp.asarray(batch.rewards), group_size,
                                     normalize_std=normalize_std), np.float32)
    arrays = (batch.prompts, batch.prompt_lengths, batch.tokens, batch.mask,
              batch.behaviour_logp, adv)
    return [{f: a[t] for f, a in zip(PAYLOAD_FIELDS, arrays)} | {"reward": batch.rewards[t]}
            for t in range(group_size)]


def stack_rows(payloads: list[dict[str, np.ndarray]]) -> MiniBatch:
    """Row payloads -> a host MiniBatch (rows in the given order)."""
    return MiniBatch(*(np.stack([p[f] for p in payloads]) for f in PAYLOAD_FIELDS))


def relative_param_diff(a: Any, b: Any) -> float:
    """Max over leaves of ``||a - b||_2 / ||b||_2`` (host or device pytrees of equal structure)."""
    def leaf(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    return max(jax.tree.leaves(jax.tree.map(leaf, a, b)))


# ----------------------------------------------------------------------------- per-agent runtime


class AgentRuntime:
    """One agent's compiled functions, optimizer, rollout worker (shared GRPO code)."""

    def __init__(self, spec: AgentSpec, workflow: Workflow, meshes: dict[str, Mesh],
                 optim: OptimConfig, *, n_inputs: int, total_steps: int, **grpo_overrides):
        self.spec = spec
        self.config = GRPOConfig(prompts_per_rollout=n_inputs, group_size=spec.group_size,
                                 max_new_tokens=spec.max_new_tokens, lag=1,
                                 **{"sis_topk": 4} | grpo_overrides)
        self.mesh = meshes["trainer"]
        (self.fns, self.tx, self.shardings, self.old_stats,
         self.update) = _compiled(spec.model, self.mesh, self.config, optim, total_steps)
        self.tokenizer = CharTokenizer()
        self.task = workflow.task(spec.name)
        self.worker = RolloutWorker(spec.model, meshes["rollout"], self.config.rollout_spec,
                                    self.task, self.tokenizer)
        self.weighted_grad = jax.jit(functools.partial(weighted_grad, fns=self.fns,
                                                       config=self.config))
        self.apply = jax.jit(functools.partial(apply_accumulated, tx=self.tx),
                             out_shardings=self.shardings)
        self._opt_init = jax.jit(self.tx.init, out_shardings=self.shardings["opt_state"])

    def init_policy(self, params: Any) -> dict:
        params = jax.device_put(params, self.fns.param_shardings)
        opt_state = self._opt_init(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, PartitionSpec()))
        return {"params": jax.tree.map(jnp.copy, params), "opt_state": opt_state, "step": step}

    def place(self, mb: MiniBatch) -> MiniBatch:
        sharding = batch_sharding(self.mesh, mb.tokens.shape[0])
        return MiniBatch(*(jax.device_put(x, sharding) for x in mb))

    def publish(self, policy: dict) -> Any:
        return publish_weights(policy["params"], self.worker.param_shardings)


def input_prompts(workflow: Workflow, seed: int, version: int, n_inputs: int) -> list[str]:
    """The turn-0 prompts of version ``version``: a pure function of (seed, version)."""
    first = workflow.order()[0]
    return workflow.task(first).prompts(np.random.default_rng([seed, version, 0x3A71]), n_inputs)


def sample_key(seed: int, version: int, input_id: int, turn: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), version)
    return jax.random.fold_in(jax.random.fold_in(key, input_id), turn)


def rollout_input(workflow: Workflow, runtimes: dict[str, AgentRuntime], published: dict,
                  prompt: str, *, seed: int, version: int, input_id: int
                  ) -> dict[str, RolloutBatch]:
    """Runs every agent on one input in turn order; a target's prompt comes from its source."""
    out: dict[str, RolloutBatch] = {}
    texts: dict[str, str] = {}
    for name in workflow.order():
        rt, edge = runtimes[name], workflow.upstream(name)
        if edge is None:
            text = prompt
        else:
            src = runtimes[edge.source]
            done = completion_text(src.tokenizer, out[edge.source].tokens[edge.trajectory])
            text = rt.task.from_upstream(texts[edge.source], done)
        texts[name] = text
        out[name] = rt.worker.generate(published[name], [text],
                                       sample_key(seed, version, input_id, workflow.turn(name)))
    return out


@dataclasses.dataclass
class RunResult:
    """Per-step host params per agent, reward means, and per-role busy seconds."""

    params: list[dict[str, Any]]
    rewards: list[dict[str, float]]
    busy_s: dict[str, float]
    wall_s: float
    samples: int


def _loss_key(seed: int, version: int, agent_index: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), version), agent_index)


# ----------------------------------------------------------------------------- synchronous


def run_sync(workflow: Workflow, runtimes: dict[str, AgentRuntime], policies: dict[str, dict],
             *, steps: int, n_inputs: int, seed: int) -> RunResult:
    """Barrier baseline: roll out all inputs for every agent, then one full-batch step each."""
    names = workflow.order()
    busy = {"rollout": 0.0} | {f"train/{n}": 0.0 for n in names}
    out_params, out_rewards, start = [], [], time.perf_counter()
    for v in range(steps):
        t0 = time.perf_counter()
        published = {n: runtimes[n].publish(policies[n]) for n in names}
        rows: dict[str, list] = {n: [] for n in names}
        for i, prompt in enumerate(input_prompts(workflow, seed, v, n_inputs)):
            out = rollout_input(workflow, runtimes, published, prompt, seed=seed, version=v,
                                input_id=v * n_inputs + i)
            for n in names:
                rows[n] += group_rows(out[n], runtimes[n].spec.group_size)
        busy["rollout"] += time.perf_counter() - t0
        for a, n in enumerate(names):
            t0 = time.perf_counter()
            rt = runtimes[n]
            mb = rt.place(stack_rows(rows[n]))
            old = rt.old_stats(policies[n]["params"], None, mb)
            policies[n], _ = rt.update(policies[n], mb, old, key=_loss_key(seed, v, a))
            jax.block_until_ready(policies[n]["params"])
            busy[f"train/{n}"] += time.perf_counter() - t0
        out_params.append({n: jax.device_get(policies[n]["params"]) for n in names})
        out_rewards.append({n: float(np.mean([r["reward"] for r in rows[n]])) for n in names})
    wall = time.perf_counter() - start
    samples = steps * n_inputs * sum(runtimes[n].spec.group_size for n in names)
    return RunResult(out_params, out_rewards, busy, wall, samples)


# ----------------------------------------------------------------------------- strict pipeline


class _Published:
    """Published weights per (version, agent); rollouts wait on a version being complete."""

    def __init__(self, names):
        self.names, self.by_version, self.cond = tuple(names), {}, threading.Condition()
        self.stop = False

    def put(self, version, name, params):
        with self.cond:
            self.by_version.setdefault(version, {})[name] = params
            self.by_version.pop(version - 2, None)
            self.cond.notify_all()

    def get(self, version, timeout):
        with self.cond:
            ok = self.cond.wait_for(lambda: self.stop or len(self.by_version.get(version, {}))
                                    == len(self.names), timeout)
            if self.stop or not ok:
                raise RuntimeError(f"weights of version {version} not published in {timeout} s")
            return dict(self.by_version[version])


def run_strict(workflow: Workflow, runtimes: dict[str, AgentRuntime],
               policies: dict[str, dict], *, steps: int, n_inputs: int, seed: int,
               micro_inputs: int = 1, store: ExperienceStore | None = None,
               timeout_s: float = 600.0) -> RunResult:
    """FlexMARL strict mode: one rollout thread streams rows into ``store``; one trainer
    thread per agent consumes ``micro_inputs`` inputs' rows at a time (see module doc)."""
    names = workflow.order()
    store = store or ExperienceStore(names)
    published = _Published(names)
    busy = {"rollout": 0.0} | {f"train/{n}": 0.0 for n in names}
    out_params: list[dict] = [{} for _ in range(steps)]
    out_rewards: list[dict] = [{} for _ in range(steps)]
    errors: list[BaseException] = []

    def guarded(fn: Callable) -> Callable:
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # surfaced in the caller after join
                errors.append(e)
                with published.cond:
                    published.stop = True
                    published.cond.notify_all()
        return run

    def rollouts():
        for v in range(steps):
            weights = published.get(v, timeout_s)
            for i, prompt in enumerate(input_prompts(workflow, seed, v, n_inputs)):
                t0 = time.perf_counter()
                out = rollout_input(workflow, runtimes, weights, prompt, seed=seed, version=v,
                                    input_id=v * n_inputs + i)
                busy["rollout"] += time.perf_counter() - t0
                for n in names:
                    for t, row in enumerate(group_rows(out[n], runtimes[n].spec.group_size)):
                        store.put(n, SampleId(v * n_inputs + i, workflow.turn(n), t), v, row)

    def trainer(a: int, n: str):
        rt = runtimes[n]
        need = n_inputs * rt.spec.group_size
        for v in range(steps):
            grad_sum, weight_sum, consumed, rewards = None, 0.0, 0, []
            while consumed < need:
                if published.stop:
                    return
                if not store.wait_ready(n, v, timeout=1.0):
                    continue
                rows: list[Row] = store.take(n, micro_inputs * rt.spec.group_size, version=v)
                t0 = time.perf_counter()
                mb = rt.place(stack_rows([r.payload for r in rows]))
                old = rt.old_stats(policies[n]["params"], None, mb)
                g, w = rt.weighted_grad(policies[n]["params"], mb, old,
                                        key=_loss_key(seed, v, a))
                grad_sum = g if grad_sum is None else jax.tree.map(jnp.add, grad_sum, g)
                weight_sum = weight_sum + w
                jax.block_until_ready(grad_sum)
                busy[f"train/{n}"] += time.perf_counter() - t0
                store.commit(n, [r.sample_id for r in rows])
                consumed += len(rows)
                rewards += [float(r.payload["reward"]) for r in rows]
            t0 = time.perf_counter()
            policies[n] = rt.apply(policies[n], grad_sum, weight_sum)
            jax.block_until_ready(policies[n]["params"])
            busy[f"train/{n}"] += time.perf_counter() - t0
            out_params[v][n] = jax.device_get(policies[n]["params"])
            out_rewards[v][n] = float(np.mean(rewards))
            published.put(v + 1, n, rt.publish(policies[n]))

    start = time.perf_counter()
    for n in names:
        published.put(0, n, runtimes[n].publish(policies[n]))
    threads = [threading.Thread(target=guarded(rollouts), daemon=True)]
    threads += [threading.Thread(target=guarded(trainer), args=(a, n), daemon=True)
                for a, n in enumerate(names)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        with published.cond:
            published.stop = True
            published.cond.notify_all()
        raise TimeoutError(f"run_strict did not finish in {timeout_s} s")
    if errors:
        raise errors[0]
    wall = time.perf_counter() - start
    samples = steps * n_inputs * sum(runtimes[n].spec.group_size for n in names)
    return RunResult(out_params, out_rewards, busy, wall, samples)
