"""The FlexMARL pipeline's rollouts and drivers over a frozen
:class:`~jaxflow.marl.pipeline.plan.PipelinePlan` (see the package doc for the modes).

* :func:`rollout_thread` walks the versions: per version it takes the weights the mode allows
  (:class:`Weights`: strict, each agent's own version v; bounded, the newest complete version
  >= v - eta from the :class:`~jaxflow.marl.pipeline.versions.VersionBoard`), rolls out batch
  v's missing inputs (:func:`rollout_serial`, agent-major, or :func:`rollout_parallel` with
  per-agent worker pools running :func:`rollout_worker`) and puts the rows into the
  :class:`~jaxflow.marl.store.ExperienceStore`. It returns its busy seconds and worker split.
* Each agent's :class:`~jaxflow.marl.pipeline.trainer.AgentTrainer` takes its micro-batches in
  input order, accumulates them, steps and publishes version v+1 to the board: on a blocking
  thread of its own (:func:`run_threads`), or on the rollout's thread between its engine calls,
  dispatching without waiting (:func:`run_inline`, strict with one rollout worker).

Nothing mutable is shared but the store and the board (which lock themselves): each trainer
owns its counters and outputs, the rollout returns its own, and :func:`run_pipeline` assembles
the :class:`~jaxflow.marl.pipeline.plan.RunResult`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np

from jaxflow.config import ConfigError
from jaxflow.marl.balance import allocate_workers
from jaxflow.marl.pipeline.accumulate import unflatten_accumulator
from jaxflow.marl.pipeline.plan import PipelineConfig, PipelinePlan, RunResult, engine_snapshot, engine_stats_since
from jaxflow.marl.pipeline.runtime import (
    AgentRuntime,
    agent_loads,
    chunks,
    input_prompts,
    request_row_keys,
    split_batch,
)
from jaxflow.marl.pipeline.trainer import AgentTrainer
from jaxflow.marl.pipeline.versions import VersionBoard
from jaxflow.marl.processes import multi_process
from jaxflow.marl.store import ExperienceStore
from jaxflow.marl.workflow import Workflow
from jaxflow.rl.tasks import completion_text
from jaxflow.train.state import TrainState


def guarded(fn: Callable, board: VersionBoard, errors: list[BaseException]) -> Callable:
    """``fn`` that records its exception in ``errors`` (re-raised after join) and halts the
    board, so the run's other threads stop waiting."""
    def run(*args):
        try:
            fn(*args)
        except BaseException as e:  # surfaced in the caller after join
            errors.append(e)
            board.halt()
    return run


# ----------------------------------------------------------------------------- rollouts


class Weights:
    """The weights one version's rollouts use: ``weights(agent)``. Strict (``published`` None):
    agent n's weights of exactly ``version``, waited for on the board when n's first rollout
    needs them, so the upstream agent of batch v+1 starts while the downstream trainer is
    still stepping v. Bounded: every agent's weights of one complete version (``published``)."""

    def __init__(self, board: VersionBoard, version: int, timeout_s: float,
                 published: dict | None = None):
        self.board, self.version, self.timeout_s = board, version, timeout_s
        self.published = published

    def __call__(self, name: str):
        if self.published is not None:
            return self.published[name]
        return self.board.get_agent(self.version, name, self.timeout_s)


def _regenerate(plan: PipelinePlan, version: int, todo: list[int]) -> dict[str, list[int]]:
    """Per agent, the inputs of ``todo`` it rolls out: those it lacks rows of, and those a
    downstream agent rolls out whose upstream trajectory row is not in the store (a resumed
    run keeps every stored row and reads a downstream prompt from it)."""
    cfg, store, need = plan.config, plan.store, {}
    for n in reversed(plan.names):
        g = cfg.runtimes[n].spec.group_size
        need[n] = [i for i in todo if not all(store.has(n, plan.sample_id(n, version, i, t))
                                              for t in range(g))]
        for m in plan.names:
            e = cfg.workflow.upstream(m)
            if e is not None and e.source == n:
                for i in need[m]:
                    sid = plan.sample_id(n, version, i, e.trajectory)
                    if i not in need[n] and (not store.has(n, sid)
                                             or "tokens" not in store.get(n, sid).payload):
                        need[n].append(i)
        need[n].sort()
    return need


def rollout_serial(plan: PipelinePlan, version: int, weights_version: int, weights: Weights,
                   todo: list[int], prompts: list[str], need: dict[str, list[int]]) -> float:
    """Agent-major on this thread: each agent in turn order rolls out its inputs of ``todo``
    (``rollout_batch`` per engine call; see :func:`_regenerate`), a downstream agent on the
    prompts its upstream outputs give. An agent's rows of the version are all stored before
    the next agent starts, so its trainer's last micro-batch and step overlap the later agents'
    rollouts, and under strict an agent waits only for its own weights (:class:`Weights`).
    Samples are those of an input-major order (per-row keys, see ``runtime``).
    ``need``: :func:`_regenerate` of ``todo``.
    ``plan.after_request(agent)`` (the inline driver's trainer of that agent) runs after each
    of the agent's requests is stored. Returns the seconds spent in engine calls."""
    cfg, busy, tokens = plan.config, 0.0, {}
    wf = cfg.workflow
    texts = {n: {i: prompts[i] for i in todo} for n in plan.names if wf.upstream(n) is None}
    for n in plan.names:
        rt, edge = cfg.runtimes[n], wf.upstream(n)
        g, tokens[n] = rt.spec.group_size, {}
        if edge is not None:
            src = cfg.runtimes[edge.source]

            def upstream_tokens(i, edge=edge):  # generated now, else stored (None: neither)
                if i in tokens[edge.source]:
                    return tokens[edge.source][i][edge.trajectory]
                sid = plan.sample_id(edge.source, version, i, edge.trajectory)
                if not plan.store.has(edge.source, sid):
                    return None
                return plan.store.get(edge.source, sid).payload.get("tokens")
            up = {i: upstream_tokens(i) for i in todo if i in texts[edge.source]}
            texts[n] = {i: rt.task.from_upstream(texts[edge.source][i],
                                                 completion_text(src.tokenizer, x))
                        for i, x in up.items() if x is not None}
        if not need[n]:
            continue
        params = weights(n)
        for chunk in chunks(need[n], cfg.rollout_batch):
            t0 = time.perf_counter()
            ids = [version * cfg.n_inputs + i for i in chunk]
            batch = rt.sampler.generate_rows(
                params, [texts[n][i] for i in chunk],
                request_row_keys(cfg.seed, version, ids, cfg.turns[n], g), g)
            busy += time.perf_counter() - t0
            for i, part in zip(chunk, split_batch(batch, g)):
                tokens[n][i] = part.tokens
                plan.put_rows(n, version, weights_version, i, part)
            if plan.after_request is not None:
                plan.after_request(n)
    return busy


class RequestQueues:
    """One version's rollout requests (``rollout_batch`` inputs each) per agent, the prompt
    texts known so far, which (agent, request) outputs are in and each agent's busy seconds
    (shared by the version's workers under ``lock``)."""

    def __init__(self, plan: PipelinePlan, todo: list[int], prompts: list[str]):
        self.plan, self.requests = plan, chunks(todo, plan.config.rollout_batch)
        wf = plan.config.workflow
        # downstream prompts are added as upstream outputs arrive
        self.text = {(n, i): prompts[i] for n in plan.names if wf.upstream(n) is None
                     for i in todo}
        self.ready = {(n, r): threading.Event() for n in plan.names
                      for r in range(len(self.requests))}
        self.queues = {n: list(range(len(self.requests))) for n in plan.names}
        self.agent_busy = dict.fromkeys(plan.names, 0.0)
        self.lock = threading.Lock()

    def next_request(self, name: str) -> int | None:
        """Agent ``name``'s next request: input order upstream (equal predicted cost);
        downstream, longest-first among the requests whose upstream output is in (longer
        prompts, the upstream answers, predict longer decodes here)."""
        edge = self.plan.config.workflow.upstream(name)
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

    def add_busy(self, name: str, seconds: float) -> None:
        with self.lock:
            self.agent_busy[name] += seconds


def rollout_worker(plan: PipelinePlan, rq: RequestQueues, name: str, version: int,
                   weights_version: int, weights: Weights) -> None:
    """Pulls agent ``name``'s requests until none is left; a downstream request waits for its
    upstream output, and each output extends the downstream agents' prompts."""
    cfg = plan.config
    rt, edge = cfg.runtimes[name], cfg.workflow.upstream(name)
    g, params = rt.spec.group_size, weights(name)
    while not plan.board.stop:
        r = rq.next_request(name)
        if r is None:
            return
        if edge is not None:
            while not rq.ready[edge.source, r].wait(0.5):
                if plan.board.stop:
                    return
        chunk = rq.requests[r]
        t0 = time.perf_counter()
        ids = [version * cfg.n_inputs + i for i in chunk]
        batch = rt.sampler.generate_rows(
            params, [rq.text[name, i] for i in chunk],
            request_row_keys(cfg.seed, version, ids, cfg.turns[name], g), g)
        rq.add_busy(name, time.perf_counter() - t0)
        parts = split_batch(batch, g)
        for i, part in zip(chunk, parts):
            plan.put_rows(name, version, weights_version, i, part)
        for m in plan.names:  # downstream prompts read this agent's trajectory
            e = cfg.workflow.upstream(m)
            if e is not None and e.source == name:
                for i, part in zip(chunk, parts):
                    done = completion_text(rt.tokenizer, part.tokens[e.trajectory])
                    rq.text[m, i] = cfg.runtimes[m].task.from_upstream(rq.text[name, i], done)
        rq.ready[name, r].set()


def rollout_parallel(plan: PipelinePlan, allocation: dict[str, int], version: int,
                     weights_version: int, weights: Weights, todo: list[int],
                     prompts: list[str]) -> tuple[float, dict[str, int]]:
    """Per-agent worker pools (``allocation[agent]`` threads) over the version's requests.
    Returns (the workers' busy seconds, the next version's allocation: the split following the
    measured per-agent rollout time, agent level). A worker's error halts the board and is
    raised here after every worker joined."""
    rq, errors = RequestQueues(plan, todo, prompts), []
    threads = [threading.Thread(target=guarded(rollout_worker, plan.board, errors),
                                args=(plan, rq, n, version, weights_version, weights),
                                daemon=True)
               for n in plan.names for _ in range(allocation[n])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if all(rq.agent_busy[n] > 0 for n in plan.names):
        allocation = allocate_workers(rq.agent_busy, plan.config.rollout_workers)
    return sum(rq.agent_busy.values()), allocation


def bounded_weights(plan: PipelinePlan, version: int) -> tuple[int, dict]:
    """(w, {agent: params}) for batch ``version``'s bounded rollouts: the newest complete
    version w >= version - eta. Across processes (always inline, see
    :attr:`~jaxflow.marl.pipeline.plan.PipelineConfig.inline`) exactly w = max(version - eta,
    first), the same on every process whatever the timing: the rollout does not wait for the
    newer versions its trainers are still computing; the board keeps every version >= w (its
    floor)."""
    lowest = version - plan.config.eta
    if not multi_process():
        return plan.board.get_at_least(lowest, plan.wait_s)
    w = max(lowest, plan.first)
    plan.board.raise_floor(w)
    return w, {n: plan.board.get_agent(w, n, plan.wait_s) for n in plan.names}


def rollout_thread(plan: PipelinePlan, allocation: dict[str, int]
                   ) -> tuple[float, dict[str, int]]:
    """Rolls out every version's missing inputs with the newest weights the mode allows
    (``allocation``: the first version's rollout workers per agent, with ``rollout_workers``
    > 1). Returns (busy seconds of the engine calls, summed over workers; the last allocation).
    """
    cfg, busy = plan.config, 0.0
    for v in range(plan.first, cfg.steps):
        need = _regenerate(plan, v, list(range(cfg.n_inputs)))
        todo = sorted(set().union(*need.values()))  # inputs some agent lacks rows of
        if not todo:
            continue
        if cfg.mode == "strict":  # each agent's own version v, when it needs it
            wver, weights = v, Weights(plan.board, v, plan.wait_s)
        else:  # the newest complete version the staleness bound allows, for every agent
            wver, published = bounded_weights(plan, v)
            weights = Weights(plan.board, wver, plan.wait_s, published)
        prompts = input_prompts(cfg.workflow, cfg.seed, v, cfg.n_inputs)
        if cfg.rollout_workers > 1:
            seconds, allocation = rollout_parallel(plan, allocation, v, wver, weights, todo,
                                                   prompts)
        else:
            seconds = rollout_serial(plan, v, wver, weights, todo, prompts, need=need)
        busy += seconds
    return busy, allocation


# ----------------------------------------------------------------------------- drivers


def trainer_thread(plan: PipelinePlan, trainer: AgentTrainer) -> None:
    """Thread driver: agent ``trainer.name``'s trainer on a thread of its own, waiting for each
    micro-batch's rows (see :mod:`~jaxflow.marl.pipeline.trainer`)."""
    while not trainer.done:
        if plan.board.stop:
            return
        trainer.advance(timeout=0.5)


def run_threads(plan: PipelinePlan, trainers: dict[str, AgentTrainer],
                allocation: dict[str, int]) -> tuple[float, dict[str, int]]:
    """The rollout thread (or worker pools) and one blocking trainer thread per agent; returns
    :func:`rollout_thread`'s (busy seconds, allocation). The first error of any thread is
    raised after all joined; past ``timeout_s`` the board halts and TimeoutError is raised."""
    errors: list[BaseException] = []
    rollout: dict[str, tuple[float, dict[str, int]]] = {}

    def rollouts():
        rollout["out"] = rollout_thread(plan, allocation)
    threads = [threading.Thread(target=guarded(rollouts, plan.board, errors), daemon=True)]
    threads += [threading.Thread(target=guarded(trainer_thread, plan.board, errors),
                                 args=(plan, t), daemon=True) for t in trainers.values()]
    for t in threads:
        t.start()
    timeout_s = plan.config.timeout_s
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        plan.board.halt()
        raise TimeoutError(f"run_pipeline did not finish in {timeout_s} s")
    if errors:
        raise errors[0]
    return rollout["out"]


def run_inline(plan: PipelinePlan, trainers: dict[str, AgentTrainer],
               allocation: dict[str, int]) -> tuple[float, dict[str, int]]:
    """Inline driver (strict, one rollout thread): the calling thread rolls out agent-major and,
    after each engine call, lets that agent's trainer consume the micro-batches now ready. The
    trainers do not wait for their programs (JAX dispatches them asynchronously), so a
    micro-batch's accumulate and a version's step and publish run while the rollout's next
    engine calls are issued, with no thread hand-offs and no second Python thread contending
    for the interpreter lock. A rollout that needs weights not yet published is a bug here
    (never waited for: the rollout's plan has ``wait_s`` 0): it raises at once. Returns
    :func:`rollout_thread`'s (busy seconds, allocation)."""
    def poll(name: str) -> None:
        while trainers[name].advance(timeout=0.0):
            pass
    for n in trainers:  # a resumed trainer's rows may all be stored already
        poll(n)
    out = rollout_thread(dataclasses.replace(plan, after_request=poll, wait_s=0.0), allocation)
    for n in trainers:
        poll(n)
    late = {n: (t.version, t.micro) for n, t in trainers.items() if not t.done}
    if late:
        raise RuntimeError(f"inline driver: trainers {late} (version, micro-batch) lack rows "
                           "after every rollout")
    return out


# ----------------------------------------------------------------------------- the run


def _restore(config: PipelineConfig, store: ExperienceStore, policies: dict[str, TrainState]
             ) -> dict:
    """The resumed trainers' accumulators (``config.resume``: from the store's consumer states)."""
    resumed = {}
    for n in config.names if config.resume else ():
        state = store.consumer_state(n)
        if state is not None:
            resumed[n] = unflatten_accumulator(state, policies[n], config.runtimes[n].shardings)
    return resumed


def check_processes(config: PipelineConfig) -> None:
    """Across processes every process must start the programs in the same order, so the run
    is inline (one thread) and has one rollout worker.

    Raises:
      ConfigError: ``rollout_workers`` > 1 across processes."""
    if multi_process() and config.rollout_workers > 1:
        raise ConfigError(f"rollout_workers={config.rollout_workers} across "
                         f"{jax.process_count()} processes: worker threads would start programs "
                         "in a timing-dependent order; valid: 1")


def run_pipeline(config: PipelineConfig, policies: dict[str, TrainState],
                 store: ExperienceStore | None = None) -> RunResult:
    """FlexMARL pipeline (see the package doc and :class:`PipelineConfig`).

    Args:
      config: the run's fixed inputs.
      policies: each agent's train state at version 0 (a resumed agent's comes from the
        store); they are donated, and the dict is updated in place with the final states.
      store: the experience store (default: a fresh in-memory one); with a path and
        ``config.persist_state`` not False, every commit also stores the trainer's state.
    """
    names, runtimes = config.names, config.runtimes
    store = ExperienceStore(names) if store is None else store
    check_processes(config)
    board = VersionBoard(names, floor=0 if multi_process() else None)
    stats0 = engine_snapshot(runtimes)
    resumed = _restore(config, store, policies)
    start_version = {n: resumed[n].version if n in resumed else 0 for n in names}
    for n in names:
        if n in resumed:
            policies[n] = resumed[n].policy
        board.put(start_version[n], n, runtimes[n].publish(policies[n]))
    plan = PipelinePlan(config, store, board,
                        persist=(store.path is not None) if config.persist_state is None
                        else config.persist_state,
                        resumed=resumed, first=min(start_version.values()),
                        wait_s=config.timeout_s)
    workers = config.rollout_workers
    allocation = (allocate_workers(agent_loads(config.workflow, runtimes), workers)
                  if workers > 1 else {"all": 1})
    trainers = {n: AgentTrainer(plan, a, n, policies[n], block=not config.inline)
                for a, n in enumerate(names)}
    start = time.perf_counter()
    rollout_s, allocation = (run_inline if config.inline else run_threads)(plan, trainers,
                                                                            allocation)
    policies.update({n: t.finish() for n, t in trainers.items()})
    wall = time.perf_counter() - start
    samples = (config.steps - plan.first) * config.n_inputs * sum(
        runtimes[n].spec.group_size for n in names)
    busy = {"rollout": rollout_s / workers}  # busy fraction of the pool
    busy |= {f"train/{n}": t.report.busy_s for n, t in trainers.items()}
    lags = [x for t in trainers.values() for x in t.report.lags]
    swapper = config.swapper
    swap = ({"seconds": swapper.swap_seconds, "swaps": swapper.swaps} if swapper is not None
            else {})
    return RunResult([{n: t.report.params[v] for n, t in trainers.items() if v in t.report.params}
                      for v in range(config.steps)],
                     [{n: t.report.rewards[v] for n, t in trainers.items() if v in t.report.rewards}
                      for v in range(config.steps)],
                     busy, wall, samples,
                     staleness={"max": float(max(lags, default=0)),
                                "mean": float(np.mean(lags)) if lags else 0.0},
                     engine=engine_stats_since(runtimes, stats0), workers=dict(allocation),
                     swap=swap)


def _run(workflow: Workflow, runtimes: dict[str, AgentRuntime],
         policies: dict[str, TrainState], store: ExperienceStore | None, **settings) -> RunResult:
    return run_pipeline(PipelineConfig(workflow, runtimes, **settings), policies, store)


def run_strict(workflow: Workflow, runtimes: dict[str, AgentRuntime],
               policies: dict[str, TrainState], *, store: ExperienceStore | None = None,
               **settings) -> RunResult:
    """FlexMARL strict mode: :func:`run_pipeline` of ``PipelineConfig(workflow, runtimes,
    mode="strict", **settings)``."""
    return _run(workflow, runtimes, policies, store, mode="strict", **settings)


def run_bounded(workflow: Workflow, runtimes: dict[str, AgentRuntime],
                policies: dict[str, TrainState], *, eta: int,
                store: ExperienceStore | None = None, **settings) -> RunResult:
    """FlexMARL bounded-staleness mode: :func:`run_pipeline` of ``PipelineConfig(workflow,
    runtimes, mode="bounded", eta=eta, **settings)``."""
    return _run(workflow, runtimes, policies, store, mode="bounded", eta=eta, **settings)
