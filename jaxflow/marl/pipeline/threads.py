"""The FlexMARL pipeline's threads: one rollout thread (or per-agent worker pools) and one
trainer thread per agent, sharing a :class:`PipelineRun` (see the package doc for the modes).

* :func:`rollout_thread` walks the versions: it waits on the
  :class:`~jaxflow.marl.pipeline.versions.VersionBoard` for weights of version >= v - eta,
  rolls out batch v's missing inputs (:func:`rollout_serial`, or :func:`rollout_parallel` with
  per-agent worker pools running :func:`rollout_worker`) and puts the rows into the
  :class:`~jaxflow.marl.store.ExperienceStore`.
* :func:`trainer_thread` takes its agent's micro-batches in input order, accumulates them
  (:mod:`jaxflow.marl.pipeline.accumulate`), steps and publishes version v+1 to the board.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.marl.balance import allocate_workers
from jaxflow.marl.pipeline.accumulate import (Accumulator, flatten_accumulator, group_rows,
                                              stack_rows, unflatten_accumulator)
from jaxflow.marl.pipeline.runtime import (AgentRuntime, agent_loads, chunks, input_prompts,
                                           loss_key, request_row_keys, rollout_inputs,
                                           split_batch)
from jaxflow.marl.pipeline.sync import RunResult, engine_snapshot, engine_stats_since
from jaxflow.marl.pipeline.versions import VersionBoard
from jaxflow.marl.store import ExperienceStore, SampleId
from jaxflow.marl.swap import AgentStateSwapper
from jaxflow.marl.workflow import Workflow
from jaxflow.rl.rollout import RolloutBatch
from jaxflow.rl.tasks import completion_text

MODES = ("strict", "bounded")


class Interrupted(Exception):
    """Raised by a trainer when the ``interrupt`` hook of :func:`run_pipeline` fires."""


@dataclasses.dataclass
class PipelineRun:
    """What one run's threads share. The counters (``busy``, ``lags``) are guarded by
    ``lock``; ``out_params[v][n]`` / ``out_rewards[v][n]`` are written by agent n's trainer
    only; the board and the store lock themselves."""

    workflow: Workflow
    runtimes: dict[str, AgentRuntime]
    store: ExperienceStore
    board: VersionBoard
    seed: int
    steps: int
    n_inputs: int
    mode: str
    eta: int
    micro_inputs: int
    rollout_batch: int
    rollout_workers: int
    swapper: AgentStateSwapper | None
    persist: bool
    interrupt: Callable[[str, int, int], bool] | None
    timeout_s: float
    allocation: dict[str, int]
    first: int = 0  # first version any trainer still has to train
    resumed: dict[str, Accumulator] = dataclasses.field(default_factory=dict)
    busy: dict[str, float] = dataclasses.field(default_factory=dict)
    lags: list[int] = dataclasses.field(default_factory=list)
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    out_params: list[dict] = dataclasses.field(default_factory=list)
    out_rewards: list[dict] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def names(self) -> list[str]:
        return self.workflow.order()

    def add_busy(self, role: str, seconds: float) -> None:
        with self.lock:
            self.busy[role] += seconds

    def sample_id(self, name: str, version: int, i: int, t: int) -> SampleId:
        return SampleId(version * self.n_inputs + i, self.workflow.turn(name), t)

    def put_rows(self, name: str, version: int, weights_version: int, i: int,
                 batch: RolloutBatch) -> None:
        """Input i's G rows of agent ``name`` into the store (rows already there are kept)."""
        for t, row in enumerate(group_rows(batch, self.runtimes[name].spec.group_size)):
            sid = self.sample_id(name, version, i, t)
            if not self.store.has(name, sid):
                self.store.put(name, sid, weights_version, row)

    def missing(self, version: int, i: int) -> list[str]:
        """Agents that lack some of input i's rows of ``version``."""
        return [n for n in self.names if not all(
            self.store.has(n, self.sample_id(n, version, i, t))
            for t in range(self.runtimes[n].spec.group_size))]

    def guarded(self, fn: Callable) -> Callable:
        """``fn`` that records its exception (re-raised after join) and halts the board."""
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # surfaced in the caller after join
                self.errors.append(e)
                self.board.halt()
        return run


# ----------------------------------------------------------------------------- rollouts


def rollout_serial(run: PipelineRun, version: int, weights_version: int, weights: dict,
                   todo: list[int], prompts: list[str]) -> None:
    """Every agent in turn order, ``rollout_batch`` inputs per engine call, on this thread."""
    for chunk in chunks(todo, run.rollout_batch):
        t0 = time.perf_counter()
        out = rollout_inputs(run.workflow, run.runtimes, weights, [prompts[i] for i in chunk],
                             seed=run.seed, version=version,
                             input_ids=[version * run.n_inputs + i for i in chunk])
        run.add_busy("rollout", time.perf_counter() - t0)
        for n in run.names:
            for i, part in zip(chunk, split_batch(out[n], run.runtimes[n].spec.group_size)):
                run.put_rows(n, version, weights_version, i, part)


class RequestQueues:
    """One version's rollout requests (``rollout_batch`` inputs each) per agent, the prompt
    texts known so far and which (agent, request) outputs are in."""

    def __init__(self, run: PipelineRun, todo: list[int], prompts: list[str]):
        self.run, self.requests = run, chunks(todo, run.rollout_batch)
        wf = run.workflow
        # downstream prompts are added as upstream outputs arrive
        self.text = {(n, i): prompts[i] for n in run.names if wf.upstream(n) is None
                     for i in todo}
        self.ready = {(n, r): threading.Event() for n in run.names
                      for r in range(len(self.requests))}
        self.queues = {n: list(range(len(self.requests))) for n in run.names}
        self.agent_busy = dict.fromkeys(run.names, 0.0)
        self.lock = threading.Lock()

    def next_request(self, name: str) -> int | None:
        """Agent ``name``'s next request: input order upstream (equal predicted cost);
        downstream, longest-first among the requests whose upstream output is in (longer
        prompts, the upstream answers, predict longer decodes here)."""
        edge = self.run.workflow.upstream(name)
        with self.lock:
            queue = self.queues[name]
            if not queue:
                return None
            r = queue[0]
            if edge is not None:
                avail = [r for r in queue if self.ready[edge.source, r].is_set()]
                if avail:
                    r = max(avail, key=lambda r: (sum(len(self.text[name, i])
                                                      for i in self.requests[r]), -r))
            queue.remove(r)
            return r


def rollout_worker(run: PipelineRun, rq: RequestQueues, name: str, version: int,
                   weights_version: int, weights: dict) -> None:
    """Pulls agent ``name``'s requests until none is left; a downstream request waits for its
    upstream output, and each output extends the downstream agents' prompts."""
    rt, edge = run.runtimes[name], run.workflow.upstream(name)
    g = rt.spec.group_size
    while not run.board.stop:
        r = rq.next_request(name)
        if r is None:
            return
        if edge is not None:
            while not rq.ready[edge.source, r].wait(0.5):
                if run.board.stop:
                    return
        chunk = rq.requests[r]
        t0 = time.perf_counter()
        ids = [version * run.n_inputs + i for i in chunk]
        batch = rt.engine.generate_rows(
            weights[name], [rq.text[name, i] for i in chunk],
            request_row_keys(run.seed, version, ids, run.workflow.turn(name), g), g)
        dt = time.perf_counter() - t0
        with run.lock:
            rq.agent_busy[name] += dt
            run.busy["rollout"] += dt
        parts = split_batch(batch, g)
        for i, part in zip(chunk, parts):
            run.put_rows(name, version, weights_version, i, part)
        for m in run.names:  # downstream prompts read this agent's trajectory
            e = run.workflow.upstream(m)
            if e is not None and e.source == name:
                for i, part in zip(chunk, parts):
                    done = completion_text(rt.tokenizer, part.tokens[e.trajectory])
                    rq.text[m, i] = run.runtimes[m].task.from_upstream(rq.text[name, i], done)
        rq.ready[name, r].set()


def rollout_parallel(run: PipelineRun, version: int, weights_version: int, weights: dict,
                     todo: list[int], prompts: list[str]) -> None:
    """Per-agent worker pools (``run.allocation``) over the version's requests; afterwards the
    next version's split follows the measured per-agent rollout time (agent level)."""
    rq = RequestQueues(run, todo, prompts)
    threads = [threading.Thread(target=run.guarded(rollout_worker),
                                args=(run, rq, n, version, weights_version, weights),
                                daemon=True)
               for n in run.names for _ in range(run.allocation[n])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if all(rq.agent_busy[n] > 0 for n in run.names):
        run.allocation.update(allocate_workers(rq.agent_busy, run.rollout_workers))


def rollout_thread(run: PipelineRun) -> None:
    """Rolls out every version's missing inputs with the newest weights the mode allows."""
    for v in range(run.first, run.steps):
        todo = [i for i in range(run.n_inputs) if run.missing(v, i)]
        if not todo:
            continue
        wver, weights = run.board.get_at_least(v - run.eta, run.timeout_s)
        if run.mode == "strict" and wver != v:
            raise RuntimeError(f"strict: batch {v} would use weights of version {wver}")
        prompts = input_prompts(run.workflow, run.seed, v, run.n_inputs)
        rollout = rollout_parallel if run.rollout_workers > 1 else rollout_serial
        rollout(run, v, wver, weights, todo, prompts)


# ----------------------------------------------------------------------------- trainers


def _take_micro_batch(run: PipelineRun, name: str, ids: list[SampleId]):
    rows = None
    while rows is None:
        if run.board.stop:
            return None
        rows = run.store.take_ids(name, ids, timeout=0.5)
    return rows


def trainer_thread(run: PipelineRun, agent_index: int, name: str, policies: dict) -> None:
    """Agent ``name``'s trainer: per version, its micro-batches in input order into the
    accumulator (committed with the rows), then one step, and publish version v+1."""
    rt = run.runtimes[name]
    g, n_mb = rt.spec.group_size, run.n_inputs // run.micro_inputs
    acc = run.resumed.get(name, Accumulator(0, 0, None, None, policies[name]))
    policy = acc.policy
    grad_sum, weight_sum = acc.grad_sum, acc.weight_sum
    j0 = acc.micro
    for v in range(acc.version, run.steps):
        for j in range(j0, n_mb):
            ids = [run.sample_id(name, v, i, t)
                   for i in range(j * run.micro_inputs, (j + 1) * run.micro_inputs)
                   for t in range(g)]
            rows = _take_micro_batch(run, name, ids)
            if rows is None:
                return
            if run.swapper is not None and run.swapper.is_swapped(name):
                policy = run.swapper.swap_in(name)
            t0 = time.perf_counter()
            if grad_sum is None:
                grad_sum = rt.zeros(policy["params"])
                weight_sum = jnp.zeros((), jnp.float32)
            row_lags = [v - r.version for r in rows]
            if max(row_lags) > run.eta or min(row_lags) < 0:
                raise RuntimeError(f"agent {name!r} step {v}: row version lag {row_lags} "
                                   f"outside [0, eta={run.eta}]")
            mb = rt.place(stack_rows([r.payload for r in rows]))
            grad_sum, weight_sum = rt.accumulate(grad_sum, weight_sum, policy["params"], mb,
                                                 key=loss_key(run.seed, v, agent_index))
            jax.block_until_ready(grad_sum)
            run.add_busy(f"train/{name}", time.perf_counter() - t0)
            state = (flatten_accumulator(Accumulator(v, j + 1, grad_sum, weight_sum, policy))
                     if run.persist else None)
            run.store.commit(name, ids, state)
            with run.lock:
                run.lags.extend(row_lags)
            if run.interrupt is not None and run.interrupt(name, v, j + 1):
                raise Interrupted(f"agent {name!r} stopped at version {v} after {j + 1} "
                                  "micro-batches")
        t0 = time.perf_counter()
        policy = rt.apply(policy, grad_sum, weight_sum)
        jax.block_until_ready(policy["params"])
        run.add_busy(f"train/{name}", time.perf_counter() - t0)
        run.out_params[v][name] = jax.device_get(policy["params"])
        run.out_rewards[v][name] = float(np.mean([
            float(run.store.get(name, run.sample_id(name, v, i, t)).payload["reward"])
            for i in range(run.n_inputs) for t in range(g)]))
        run.board.put(v + 1, name, rt.publish(policy))
        if run.swapper is not None and v + 1 < run.steps:  # idle until v+1's rows arrive
            run.swapper.swap_out(name, policy, version=v + 1)
            policy = None
        j0, grad_sum, weight_sum = 0, None, None  # only a resumed first version starts late
    policies[name] = policy


# ----------------------------------------------------------------------------- the run


def _check_arguments(names, *, mode, eta, n_inputs, micro_inputs, rollout_workers) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: 'strict', 'bounded'")
    if eta < 0 or (mode == "strict" and eta != 0):
        raise ValueError(f"eta={eta}: need 0 for strict, >= 0 for bounded")
    if n_inputs % micro_inputs:
        raise ValueError(f"micro_inputs={micro_inputs} must divide n_inputs={n_inputs}")
    if rollout_workers != 1 and rollout_workers < len(names):
        raise ValueError(f"rollout_workers={rollout_workers}: need 1 or >= {len(names)} "
                         "(one per agent)")


def _restore(run: PipelineRun, policies: dict[str, dict], resume: bool) -> None:
    """Resumed trainers' accumulators, then every agent's current weights on the board."""
    for n in run.names:
        state = run.store.consumer_state(n) if resume else None
        if state is not None:
            acc = unflatten_accumulator(state, policies[n], run.runtimes[n].shardings)
            run.resumed[n] = acc
            policies[n] = acc.policy
    run.first = min(run.resumed[n].version if n in run.resumed else 0 for n in run.names)
    for n in run.names:
        version = run.resumed[n].version if n in run.resumed else 0
        run.board.put(version, n, run.runtimes[n].publish(policies[n]))


def run_pipeline(workflow: Workflow, runtimes: dict[str, AgentRuntime],
                 policies: dict[str, dict], *, steps: int, n_inputs: int, seed: int,
                 mode: str = "strict", eta: int = 0, micro_inputs: int = 1,
                 store: ExperienceStore | None = None, rollout_batch: int = 1,
                 rollout_workers: int = 1,
                 swapper: AgentStateSwapper | None = None, persist_state: bool | None = None,
                 resume: bool = False,
                 interrupt: Callable[[str, int, int], bool] | None = None,
                 timeout_s: float = 600.0) -> RunResult:
    """FlexMARL pipeline (see the package doc). ``policies`` is updated in place.

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
    names = workflow.order()
    _check_arguments(names, mode=mode, eta=eta, n_inputs=n_inputs, micro_inputs=micro_inputs,
                     rollout_workers=rollout_workers)
    store = store or ExperienceStore(names)
    run = PipelineRun(
        workflow, runtimes, store, VersionBoard(names), seed=seed, steps=steps,
        n_inputs=n_inputs, mode=mode, eta=eta, micro_inputs=micro_inputs,
        rollout_batch=rollout_batch, rollout_workers=rollout_workers, swapper=swapper,
        persist=(store.path is not None) if persist_state is None else persist_state,
        interrupt=interrupt, timeout_s=timeout_s,
        allocation=(allocate_workers(agent_loads(workflow, runtimes), rollout_workers)
                    if rollout_workers > 1 else {"all": 1}),
        busy={"rollout": 0.0} | {f"train/{n}": 0.0 for n in names},
        out_params=[{} for _ in range(steps)], out_rewards=[{} for _ in range(steps)])
    stats0 = engine_snapshot(runtimes)
    _restore(run, policies, resume)

    start = time.perf_counter()
    threads = [threading.Thread(target=run.guarded(rollout_thread), args=(run,), daemon=True)]
    threads += [threading.Thread(target=run.guarded(trainer_thread), args=(run, a, n, policies),
                                 daemon=True) for a, n in enumerate(names)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        run.board.halt()
        raise TimeoutError(f"run_pipeline did not finish in {timeout_s} s")
    if run.errors:
        raise run.errors[0]
    wall = time.perf_counter() - start
    samples = (steps - run.first) * n_inputs * sum(runtimes[n].spec.group_size for n in names)
    run.busy["rollout"] /= rollout_workers  # busy fraction of the pool
    swap = ({"seconds": swapper.swap_seconds, "swaps": swapper.swaps} if swapper is not None
            else {})
    lags = run.lags
    return RunResult(run.out_params, run.out_rewards, run.busy, wall, samples,
                     staleness={"max": float(max(lags, default=0)),
                                "mean": float(np.mean(lags)) if lags else 0.0},
                     engine=engine_stats_since(runtimes, stats0), workers=dict(run.allocation),
                     swap=swap)


def run_strict(workflow: Workflow, runtimes: dict[str, AgentRuntime],
               policies: dict[str, dict], **kw) -> RunResult:
    """FlexMARL strict mode (:func:`run_pipeline` with ``mode="strict"``)."""
    return run_pipeline(workflow, runtimes, policies, mode="strict", **kw)


def run_bounded(workflow: Workflow, runtimes: dict[str, AgentRuntime],
                policies: dict[str, dict], *, eta: int, **kw) -> RunResult:
    """FlexMARL bounded-staleness mode (:func:`run_pipeline` with ``mode="bounded"``)."""
    return run_pipeline(workflow, runtimes, policies, mode="bounded", eta=eta, **kw)
