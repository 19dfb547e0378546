"""Micro-batch pipeline: train on rollouts as they finish, step when version v is complete.

Per agent and version v the trainer consumes micro-batches (``micro_inputs`` inputs' G
trajectories, rows taken from the :class:`~jaxflow.marl.store.ExperienceStore` in input order)
as soon as the rollout engine stores them, accumulates ``grad(loss_mb) * weight_mb`` (weight =
the micro-batch's share of the loss normaliser: unmasked tokens for ``token-mean``, rows for the
``seq-mean-*`` aggs) in one jitted call per micro-batch, and applies one optimizer step with
``sum(grads) / sum(weights)`` once all of v's rows are consumed; then it publishes version v+1.

Modes (:func:`run_pipeline`):

  strict    rollouts of batch v use exactly version v's weights (they start after the publish):
            the synchronous algorithm (:func:`run_sync`: roll out everything, then one
            full-batch GRPO step per agent) on the same samples, up to the summation order of
            the gradient. pi_old == the current params throughout v.
  bounded   staleness ``eta``: rollouts of batch v may start as soon as *some* complete version
            w >= v - eta is published and use the newest one; the trainer of step v consumes
            batch v's rows, whose version lag v - w <= eta is checked, and the run reports the
            observed lag (``RunResult.staleness``). pi_old is the trainer's current params, the
            sampler's log-probs are the behaviour policy (GRPOConfig's importance correction).
            ``eta = 0`` is strict.

Micro-batches are consumed in input order, so a run is deterministic whatever order the rollout
workers finish in (strict runs with and without state swapping, or resumed from a checkpoint,
are bit-identical). Samples are a pure function of (seed, batch v, input, turn, row).

Durability: with ``persist_state`` every micro-batch commit also stores the trainer's state
(version, micro-batches done, gradient accumulator, weight sum, params + optimizer state)
atomically with the consumed rows, and ``resume=True`` restarts every trainer from it (the
rollouts regenerate only rows that are missing).
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
from jaxflow.marl.balance import allocate_workers
from jaxflow.marl.engine import EngineStats, RolloutEngine, row_keys
from jaxflow.marl.store import ExperienceStore, SampleId
from jaxflow.marl.swap import AgentStateSwapper
from jaxflow.marl.workflow import AgentSpec, Workflow
from jaxflow.rl.advantages import grpo_advantages
from jaxflow.rl.grpo import (GRPOConfig, MiniBatch, compiled_functions, grpo_loss,
                              old_stats)
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.rollout import RolloutBatch, batch_sharding
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
    w = loss_weight(mb, config.loss.agg)
    return jax.tree.map(lambda g: g * w, grads), w


def apply_accumulated(policy: dict, grad_sum: Any, weight_sum: jax.Array, *,
                      tx: optax.GradientTransformation) -> dict:
    """One optimizer step with the accumulated mean gradient ``grad_sum / weight_sum``."""
    grads = jax.tree.map(lambda g: g / weight_sum, grad_sum)
    updates, opt_state = tx.update(grads, policy["opt_state"], policy["params"])
    return {"params": optax.apply_updates(policy["params"], updates), "opt_state": opt_state,
            "step": policy["step"] + 1}


def accumulate(grad_sum: Any, weight_sum: jax.Array, params: Any, mb: MiniBatch, *, fns,
               config: GRPOConfig, key: jax.Array) -> tuple[Any, jax.Array]:
    """One micro-batch into the accumulator: pi_old stats, weighted gradient and the sums, in
    one program (one dispatch per micro-batch instead of one per op and leaf)."""
    old = old_stats(fns, params, None, mb, config=config)
    g, w = weighted_grad(params, mb, old, fns=fns, config=config, key=key)
    return jax.tree.map(jnp.add, grad_sum, g), weight_sum + w


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
    """One agent's compiled functions, optimizer and rollout engine (shared GRPO code)."""

    def __init__(self, spec: AgentSpec, workflow: Workflow, meshes: dict[str, Mesh],
                 optim: OptimConfig, *, n_inputs: int, total_steps: int, engine_chunk: int = 2,
                 engine_compact: bool = True, **grpo_overrides):
        self.spec = spec
        self.config = GRPOConfig(prompts_per_rollout=n_inputs, group_size=spec.group_size,
                                 max_new_tokens=spec.max_new_tokens, lag=1,
                                 **{"sis_topk": 4} | grpo_overrides)
        self.mesh = meshes["trainer"]
        (self.fns, self.tx, self.shardings, self.old_stats,
         self.update) = compiled_functions(spec.model, self.mesh, self.config, optim, total_steps)
        self.tokenizer = CharTokenizer()
        self.task = workflow.task(spec.name)
        self.engine = RolloutEngine(spec.model, meshes["rollout"],
                                    max_new_tokens=spec.max_new_tokens,
                                    temperature=self.config.temperature, task=self.task,
                                    tokenizer=self.tokenizer, chunk=engine_chunk,
                                    compact=engine_compact)
        self.weighted_grad = jax.jit(functools.partial(weighted_grad, fns=self.fns,
                                                       config=self.config))
        self.apply = jax.jit(functools.partial(apply_accumulated, tx=self.tx),
                             out_shardings=self.shardings)
        self._opt_init = jax.jit(self.tx.init, out_shardings=self.shardings["opt_state"])
        self.accumulate = jax.jit(functools.partial(accumulate, fns=self.fns, config=self.config),
                                  donate_argnums=0)
        self.zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p),
                             out_shardings=self.shardings["params"])

    def init_policy(self, params: Any) -> dict:
        params = jax.device_put(params, self.fns.param_shardings)
        opt_state = self._opt_init(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, PartitionSpec()))
        return {"params": jax.tree.map(jnp.copy, params), "opt_state": opt_state, "step": step}

    def place(self, mb: MiniBatch) -> MiniBatch:
        sharding = batch_sharding(self.mesh, mb.tokens.shape[0])
        return MiniBatch(*(jax.device_put(x, sharding) for x in mb))

    def publish(self, policy: dict) -> Any:
        return publish_weights(policy["params"], self.engine.param_shardings)


def input_prompts(workflow: Workflow, seed: int, version: int, n_inputs: int) -> list[str]:
    """The turn-0 prompts of version ``version``: a pure function of (seed, version)."""
    first = workflow.order()[0]
    return workflow.task(first).prompts(np.random.default_rng([seed, version, 0x3A71]), n_inputs)


def sample_key(seed: int, version: int, input_id: int, turn: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), version)
    return jax.random.fold_in(jax.random.fold_in(key, input_id), turn)


@functools.partial(jax.jit, static_argnums=4)
def _request_row_keys(seed, version, input_ids, turn, group_size):
    def one(i):
        return row_keys(sample_key(seed, version, i, turn), group_size)
    return jax.vmap(one)(input_ids).reshape(-1)


def request_row_keys(seed: int, version: int, input_ids: list[int], turn: int,
                     group_size: int) -> jax.Array:
    """Row keys [len(input_ids) * G]: row t of input i is ``fold_in(sample_key(seed, version,
    i, turn), t)`` (one jitted call instead of per-key eager ops)."""
    return _request_row_keys(np.uint32(seed), np.uint32(version),
                             np.asarray(input_ids, np.uint32), np.uint32(turn), group_size)


def rollout_inputs(workflow: Workflow, runtimes: dict[str, AgentRuntime], published: dict,
                   prompts: list[str], *, seed: int, version: int, input_ids: list[int]
                   ) -> dict[str, RolloutBatch]:
    """Runs every agent on a batch of inputs in turn order (one engine call per agent; rows
    ``k*G .. k*G+G-1`` belong to ``input_ids[k]``); a target's prompt comes from its source.
    Samples do not depend on how inputs are batched (per-row keys, see ``engine``)."""
    out: dict[str, RolloutBatch] = {}
    texts: dict[str, list[str]] = {}
    for name in workflow.order():
        rt, edge = runtimes[name], workflow.upstream(name)
        if edge is None:
            texts[name] = list(prompts)
        else:
            src = runtimes[edge.source]
            g = src.spec.group_size
            texts[name] = [rt.task.from_upstream(
                texts[edge.source][k],
                completion_text(src.tokenizer, out[edge.source].tokens[k * g + edge.trajectory]))
                for k in range(len(prompts))]
        keys = request_row_keys(seed, version, input_ids, workflow.turn(name), rt.spec.group_size)
        out[name] = rt.engine.generate_rows(published[name], texts[name], keys,
                                            rt.spec.group_size)
    return out


def _chunks(items: list, size: int) -> list[list]:
    if size < 1:
        raise ValueError(f"rollout_batch={size}: need >= 1")
    return [items[k:k + size] for k in range(0, len(items), size)]


def split_batch(batch: RolloutBatch, group_size: int) -> list[RolloutBatch]:
    """A multi-input rollout -> one RolloutBatch per input (its G rows)."""
    n = batch.tokens.shape[0] // group_size
    return [RolloutBatch(*(x[k * group_size:(k + 1) * group_size] for x in batch))
            for k in range(n)]


def rollout_input(workflow: Workflow, runtimes: dict[str, AgentRuntime], published: dict,
                  prompt: str, *, seed: int, version: int, input_id: int
                  ) -> dict[str, RolloutBatch]:
    """:func:`rollout_inputs` on one input."""
    return rollout_inputs(workflow, runtimes, published, [prompt], seed=seed, version=version,
                          input_ids=[input_id])


@dataclasses.dataclass
class RunResult:
    """Per-step host params per agent, reward means, per-role busy seconds and run facts.

    ``params[v]`` / ``rewards[v]`` are empty dicts for versions a resumed run did not train.
    ``staleness``: max / mean version lag (step - policy version) of the consumed rows.
    ``engine``: decode row-steps executed vs a padded batch decode (see
    :class:`~jaxflow.marl.engine.EngineStats`). ``workers``: rollout workers per agent.
    """

    params: list[dict[str, Any]]
    rewards: list[dict[str, float]]
    busy_s: dict[str, float]
    wall_s: float
    samples: int
    staleness: dict[str, float] = dataclasses.field(default_factory=dict)
    engine: dict[str, float] = dataclasses.field(default_factory=dict)
    workers: dict[str, int] = dataclasses.field(default_factory=dict)
    swap: dict[str, float] = dataclasses.field(default_factory=dict)


def _engine_stats(runtimes: dict[str, "AgentRuntime"], before: dict[str, EngineStats]
                  ) -> dict[str, float]:
    total = EngineStats()
    for n, rt in runtimes.items():
        s = dataclasses.replace(rt.engine.stats)
        for f in dataclasses.fields(s):
            setattr(s, f.name, getattr(s, f.name) - getattr(before[n], f.name))
        total.add(s)
    return dataclasses.asdict(total) | {"saved_fraction": total.saved_fraction}


def _snapshot(runtimes) -> dict[str, EngineStats]:
    return {n: dataclasses.replace(rt.engine.stats) for n, rt in runtimes.items()}


def _loss_key(seed: int, version: int, agent_index: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), version), agent_index)


# ----------------------------------------------------------------------------- synchronous


def run_sync(workflow: Workflow, runtimes: dict[str, AgentRuntime], policies: dict[str, dict],
             *, steps: int, n_inputs: int, seed: int, rollout_batch: int = 1) -> RunResult:
    """Barrier baseline: roll out all inputs for every agent (``rollout_batch`` inputs per
    engine call), then one full-batch step per agent, agents one after another."""
    names = workflow.order()
    busy = {"rollout": 0.0} | {f"train/{n}": 0.0 for n in names}
    stats0 = _snapshot(runtimes)
    out_params, out_rewards, start = [], [], time.perf_counter()
    for v in range(steps):
        t0 = time.perf_counter()
        published = {n: runtimes[n].publish(policies[n]) for n in names}
        rows: dict[str, list] = {n: [] for n in names}
        prompts = input_prompts(workflow, seed, v, n_inputs)
        for chunk in _chunks(list(range(n_inputs)), rollout_batch):
            out = rollout_inputs(workflow, runtimes, published, [prompts[i] for i in chunk],
                                 seed=seed, version=v,
                                 input_ids=[v * n_inputs + i for i in chunk])
            for n in names:
                g = runtimes[n].spec.group_size
                for part in split_batch(out[n], g):
                    rows[n] += group_rows(part, g)
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
    return RunResult(out_params, out_rewards, busy, wall, samples,
                     staleness={"max": 0.0, "mean": 0.0},
                     engine=_engine_stats(runtimes, stats0), workers={"all": 1})


# ----------------------------------------------------------------------------- pipeline


class Interrupted(Exception):
    """Raised by a trainer when the ``interrupt`` hook of :func:`run_pipeline` fires."""


class _Published:
    """Published weights per (version, agent). A version is complete when every agent has
    published it; rollouts ask for the newest complete version >= a minimum."""

    def __init__(self, names):
        self.names, self.by_version, self.cond = tuple(names), {}, threading.Condition()
        self.stop = False

    def _complete(self):
        return [v for v, d in self.by_version.items() if len(d) == len(self.names)]

    def put(self, version, name, params):
        with self.cond:
            self.by_version.setdefault(version, {})[name] = params
            done = self._complete()
            if done:
                for v in [v for v in self.by_version if v < max(done)]:
                    del self.by_version[v]
            self.cond.notify_all()

    def get_at_least(self, version, timeout) -> tuple[int, dict]:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.stop or any(v >= version
                                                             for v in self._complete()),
                                    timeout)
            if self.stop or not ok:
                raise RuntimeError(f"weights of version >= {version} not published in "
                                   f"{timeout} s (or the run stopped)")
            newest = max(self._complete())
            return newest, dict(self.by_version[newest])

    def halt(self):
        with self.cond:
            self.stop = True
            self.cond.notify_all()


def _flatten_state(version: int, micro: int, grad_sum, weight_sum, policy) -> dict:
    out = {"version": np.asarray(version), "micro": np.asarray(micro),
           "weight_sum": np.asarray(jax.device_get(weight_sum))}
    for i, x in enumerate(jax.tree.leaves(jax.device_get(grad_sum))):
        out[f"g{i}"] = np.asarray(x)
    for i, x in enumerate(jax.tree.leaves(jax.device_get(policy))):
        out[f"p{i}"] = np.asarray(x)
    return out


def _unflatten_state(state: dict, rt: "AgentRuntime", like_policy: dict):
    pdef = jax.tree.structure(like_policy)
    gdef = jax.tree.structure(like_policy["params"])
    policy = jax.tree.unflatten(pdef, [state[f"p{i}"] for i in range(pdef.num_leaves)])
    grads = jax.tree.unflatten(gdef, [state[f"g{i}"] for i in range(gdef.num_leaves)])
    policy = jax.tree.map(jax.device_put, policy, rt.shardings)
    grads = jax.tree.map(jax.device_put, grads, rt.shardings["params"])
    weight = jnp.asarray(state["weight_sum"])
    return int(state["version"]), int(state["micro"]), grads, weight, policy


def agent_loads(workflow: Workflow, runtimes: dict[str, "AgentRuntime"]) -> dict[str, float]:
    """Estimated rollout load per agent: G * max_new_tokens * parameter count."""
    out = {}
    for n in workflow.order():
        rt = runtimes[n]
        n_params = sum(int(np.prod(x.shape))
                       for x in jax.tree.leaves(rt.fns.abstract_params()))
        out[n] = float(rt.spec.group_size * rt.spec.max_new_tokens * n_params)
    return out


def run_pipeline(workflow: Workflow, runtimes: dict[str, AgentRuntime],
                 policies: dict[str, dict], *, steps: int, n_inputs: int, seed: int,
                 mode: str = "strict", eta: int = 0, micro_inputs: int = 1,
                 store: ExperienceStore | None = None, rollout_batch: int = 1,
                 rollout_workers: int = 1,
                 swapper: AgentStateSwapper | None = None, persist_state: bool | None = None,
                 resume: bool = False,
                 interrupt: Callable[[str, int, int], bool] | None = None,
                 timeout_s: float = 600.0) -> RunResult:
    """FlexMARL pipeline (see module doc).

    Args:
      mode: "strict" or "bounded" (staleness ``eta`` >= 0; 0 is strict).
      micro_inputs: inputs per trainer micro-batch (must divide ``n_inputs``).
      rollout_batch: inputs per rollout engine call (a request).
      rollout_workers: 1: one rollout thread runs every agent in turn order per input.
        >= number of agents: agent-level balancing gives each agent
        :func:`~jaxflow.marl.balance.allocate_workers` threads in proportion to its load
        (:func:`agent_loads`, then the measured busy seconds of the previous version); each
        agent's threads pull its requests longest-first (predicted cost: the input's upstream
        response length, else equal) from a shared queue (dynamic list scheduling = work
        stealing); a downstream agent's request waits for its upstream output.
      swapper: swap each agent's training state to host while it waits for its next version.
      persist_state: store each trainer's state with every commit (default: the store has a
        path); ``resume=True`` restarts from those states.
      interrupt: ``(agent, version, micro_batches_done) -> bool`` called after every commit;
        True makes that trainer raise :class:`Interrupted` (tests of resumption).
    """
    if mode not in ("strict", "bounded"):
        raise ValueError(f"unknown mode {mode!r}; valid: 'strict', 'bounded'")
    if eta < 0 or (mode == "strict" and eta != 0):
        raise ValueError(f"eta={eta}: need 0 for strict, >= 0 for bounded")
    if n_inputs % micro_inputs:
        raise ValueError(f"micro_inputs={micro_inputs} must divide n_inputs={n_inputs}")
    names = workflow.order()
    if rollout_workers != 1 and rollout_workers < len(names):
        raise ValueError(f"rollout_workers={rollout_workers}: need 1 or >= {len(names)} "
                         "(one per agent)")
    store = store or ExperienceStore(names)
    persist = (store.path is not None) if persist_state is None else persist_state
    published = _Published(names)
    lock = threading.Lock()
    busy = {"rollout": 0.0} | {f"train/{n}": 0.0 for n in names}
    out_params: list[dict] = [{} for _ in range(steps)]
    out_rewards: list[dict] = [{} for _ in range(steps)]
    lags: list[int] = []
    errors: list[BaseException] = []
    stats0 = _snapshot(runtimes)
    n_mb = n_inputs // micro_inputs
    turn = {n: workflow.turn(n) for n in names}
    allocation = (allocate_workers(agent_loads(workflow, runtimes), rollout_workers)
                  if rollout_workers > 1 else {"all": 1})

    def add_busy(role, seconds):
        with lock:
            busy[role] += seconds

    def guarded(fn: Callable) -> Callable:
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # surfaced in the caller after join
                errors.append(e)
                published.halt()
        return run

    # -- restore -------------------------------------------------------------------------
    start_state: dict[str, tuple] = {}
    for n in names:
        state = store.consumer_state(n) if resume else None
        if state is not None:
            start_state[n] = _unflatten_state(state, runtimes[n], policies[n])
            policies[n] = start_state[n][4]
    first = min(start_state[n][0] if n in start_state else 0 for n in names)
    for n in names:
        published.put(start_state[n][0] if n in start_state else 0, n,
                      runtimes[n].publish(policies[n]))

    # -- rollouts ------------------------------------------------------------------------
    def put_rows(n, v, wver, i, batch):
        for t, row in enumerate(group_rows(batch, runtimes[n].spec.group_size)):
            sid = SampleId(v * n_inputs + i, turn[n], t)
            if not store.has(n, sid):
                store.put(n, sid, wver, row)

    def missing(v, i):
        return [n for n in names if not all(
            store.has(n, SampleId(v * n_inputs + i, turn[n], t))
            for t in range(runtimes[n].spec.group_size))]

    def rollout_serial(v, wver, weights, todo, prompts):
        for chunk in _chunks(todo, rollout_batch):
            t0 = time.perf_counter()
            out = rollout_inputs(workflow, runtimes, weights, [prompts[i] for i in chunk],
                                 seed=seed, version=v, input_ids=[v * n_inputs + i for i in chunk])
            add_busy("rollout", time.perf_counter() - t0)
            for n in names:
                for i, part in zip(chunk, split_batch(out[n], runtimes[n].spec.group_size)):
                    put_rows(n, v, wver, i, part)

    def rollout_parallel(v, wver, weights, todo, prompts):
        """Per-agent worker pools over requests (``rollout_batch`` inputs each); a downstream
        request waits for the same inputs' upstream outputs."""
        requests = _chunks(todo, rollout_batch)
        text = {(n, i): prompts[i] for n in names if workflow.upstream(n) is None
                for i in todo}  # downstream prompts are added as upstream outputs arrive
        ready = {(n, r): threading.Event() for n in names for r in range(len(requests))}
        agent_busy = dict.fromkeys(names, 0.0)
        queues = {n: list(range(len(requests))) for n in names}
        qlock = threading.Lock()

        def next_request(n):
            edge = workflow.upstream(n)
            with qlock:
                if not queues[n]:
                    return None
                if edge is None:  # equal predicted cost: input order
                    r = queues[n][0]
                else:  # longest-first among requests whose upstream output is in: longer
                    # prompts (the upstream answers) predict longer decodes here
                    avail = [r for r in queues[n] if ready[edge.source, r].is_set()]
                    r = (max(avail, key=lambda r: (sum(len(text[n, i]) for i in requests[r]),
                                                   -r)) if avail else queues[n][0])
                queues[n].remove(r)
                return r

        def worker(n):
            rt, edge = runtimes[n], workflow.upstream(n)
            g = rt.spec.group_size
            while not published.stop:
                r = next_request(n)
                if r is None:
                    return
                if edge is not None:
                    while not ready[edge.source, r].wait(0.5):
                        if published.stop:
                            return
                chunk = requests[r]
                t0 = time.perf_counter()
                batch = rt.engine.generate_rows(
                    weights[n], [text[n, i] for i in chunk],
                    request_row_keys(seed, v, [v * n_inputs + i for i in chunk], turn[n], g), g)
                dt = time.perf_counter() - t0
                with lock:
                    agent_busy[n] += dt
                    busy["rollout"] += dt
                parts = split_batch(batch, g)
                for i, part in zip(chunk, parts):
                    put_rows(n, v, wver, i, part)
                for m in names:  # downstream prompts read this agent's trajectory
                    e = workflow.upstream(m)
                    if e is not None and e.source == n:
                        for i, part in zip(chunk, parts):
                            done = completion_text(rt.tokenizer, part.tokens[e.trajectory])
                            text[m, i] = runtimes[m].task.from_upstream(text[n, i], done)
                ready[n, r].set()

        threads = [threading.Thread(target=guarded(worker), args=(n,), daemon=True)
                   for n in names for _ in range(allocation[n])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # agent level: the next version's split follows the measured per-agent rollout time
        if all(agent_busy[n] > 0 for n in names):
            allocation.update(allocate_workers(agent_busy, rollout_workers))

    def rollouts():
        for v in range(first, steps):
            todo = [i for i in range(n_inputs) if missing(v, i)]
            if not todo:
                continue
            wver, weights = published.get_at_least(v - eta, timeout_s)
            if mode == "strict" and wver != v:
                raise RuntimeError(f"strict: batch {v} would use weights of version {wver}")
            prompts = input_prompts(workflow, seed, v, n_inputs)
            (rollout_parallel if rollout_workers > 1 else rollout_serial)(
                v, wver, weights, todo, prompts)

    # -- trainers ------------------------------------------------------------------------
    def trainer(a: int, n: str):
        rt = runtimes[n]
        g = rt.spec.group_size
        policy = policies[n]
        v0, j0, grad_sum, weight_sum = 0, 0, None, None
        if n in start_state:
            v0, j0, grad_sum, weight_sum, policy = start_state[n]
        for v in range(v0, steps):
            for j in range(j0, n_mb):
                ids = [SampleId(v * n_inputs + i, turn[n], t)
                       for i in range(j * micro_inputs, (j + 1) * micro_inputs)
                       for t in range(g)]
                rows = None
                while rows is None:
                    if published.stop:
                        return
                    rows = store.take_ids(n, ids, timeout=0.5)
                if swapper is not None and swapper.is_swapped(n):
                    policy = swapper.swap_in(n)
                t0 = time.perf_counter()
                if grad_sum is None:
                    grad_sum = rt.zeros(policy["params"])
                    weight_sum = jnp.zeros((), jnp.float32)
                row_lags = [v - r.version for r in rows]
                if max(row_lags) > eta or min(row_lags) < 0:
                    raise RuntimeError(f"agent {n!r} step {v}: row version lag {row_lags} "
                                       f"outside [0, eta={eta}]")
                mb = rt.place(stack_rows([r.payload for r in rows]))
                grad_sum, weight_sum = rt.accumulate(grad_sum, weight_sum, policy["params"], mb,
                                                     key=_loss_key(seed, v, a))
                jax.block_until_ready(grad_sum)
                add_busy(f"train/{n}", time.perf_counter() - t0)
                state = (_flatten_state(v, j + 1, grad_sum, weight_sum, policy)
                         if persist else None)
                store.commit(n, ids, state)
                with lock:
                    lags.extend(row_lags)
                if interrupt is not None and interrupt(n, v, j + 1):
                    raise Interrupted(f"agent {n!r} stopped at version {v} after {j + 1} "
                                      "micro-batches")
            t0 = time.perf_counter()
            policy = rt.apply(policy, grad_sum, weight_sum)
            jax.block_until_ready(policy["params"])
            add_busy(f"train/{n}", time.perf_counter() - t0)
            out_params[v][n] = jax.device_get(policy["params"])
            out_rewards[v][n] = float(np.mean([
                float(store.get(n, SampleId(v * n_inputs + i, turn[n], t)).payload["reward"])
                for i in range(n_inputs) for t in range(g)]))
            published.put(v + 1, n, rt.publish(policy))
            if swapper is not None and v + 1 < steps:  # idle until version v+1's rows arrive
                swapper.swap_out(n, policy, version=v + 1)
                policy = None
            j0, grad_sum, weight_sum = 0, None, None  # only a resumed first version starts late
        policies[n] = policy

    start = time.perf_counter()
    threads = [threading.Thread(target=guarded(rollouts), daemon=True)]
    threads += [threading.Thread(target=guarded(trainer), args=(a, n), daemon=True)
                for a, n in enumerate(names)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        published.halt()
        raise TimeoutError(f"run_pipeline did not finish in {timeout_s} s")
    if errors:
        raise errors[0]
    wall = time.perf_counter() - start
    samples = (steps - first) * n_inputs * sum(runtimes[n].spec.group_size for n in names)
    busy["rollout"] /= rollout_workers  # busy fraction of the pool
    swap = ({"seconds": swapper.swap_seconds, "swaps": swapper.swaps} if swapper is not None
            else {})
    return RunResult(out_params, out_rewards, busy, wall, samples,
                     staleness={"max": float(max(lags, default=0)),
                                "mean": float(np.mean(lags)) if lags else 0.0},
                     engine=_engine_stats(runtimes, stats0), workers=dict(allocation), swap=swap)


def run_strict(workflow: Workflow, runtimes: dict[str, AgentRuntime],
               policies: dict[str, dict], **kw) -> RunResult:
    """FlexMARL strict mode (:func:`run_pipeline` with ``mode="strict"``)."""
    return run_pipeline(workflow, runtimes, policies, mode="strict", **kw)


def run_bounded(workflow: Workflow, runtimes: dict[str, AgentRuntime],
                policies: dict[str, dict], *, eta: int, **kw) -> RunResult:
    """FlexMARL bounded-staleness mode (:func:`run_pipeline` with ``mode="bounded"``)."""
    return run_pipeline(workflow, runtimes, policies, mode="bounded", eta=eta, **kw)
