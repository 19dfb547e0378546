"""The FlexMARL pipeline's drivers over a shared :class:`PipelineRun` (see the package doc
for the modes).

* :func:`rollout_thread` walks the versions: per version it takes the weights the mode allows
  (:class:`Weights`: strict, each agent's own version v; bounded, the newest complete version
  >= v - eta from the :class:`~jaxflow.marl.pipeline.versions.VersionBoard`), rolls out batch
  v's missing inputs (:func:`rollout_serial`, agent-major, or :func:`rollout_parallel` with
  per-agent worker pools running :func:`rollout_worker`) and puts the rows into the
  :class:`~jaxflow.marl.store.ExperienceStore`.
* Each agent's :class:`~jaxflow.marl.pipeline.trainer.AgentTrainer` takes its micro-batches in
  input order, accumulates them, steps and publishes version v+1 to the board: on a blocking
  thread of its own (:func:`run_threads`), or on the rollout's thread between its engine calls,
  dispatching without waiting (:func:`run_inline`, strict with one rollout worker).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from jaxflow.marl.balance import allocate_workers
from jaxflow.marl.pipeline.accumulate import Accumulator, group_rows, unflatten_accumulator
from jaxflow.marl.pipeline.runtime import (AgentRuntime, agent_loads, chunks, input_prompts,
                                           request_row_keys, split_batch)
from jaxflow.marl.pipeline.sync import RunResult, engine_snapshot, engine_stats_since
from jaxflow.marl.pipeline.trainer import AgentTrainer
from jaxflow.marl.pipeline.versions import VersionBoard
from jaxflow.marl.store import ExperienceStore, SampleId
from jaxflow.marl.swap import AgentStateSwapper
from jaxflow.marl.workflow import Workflow
from jaxflow.rl.rollout import RolloutBatch
from jaxflow.rl.tasks import completion_text

MODES = ("strict", "bounded")
DRIVERS = ("auto", "inline", "threads")


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
    after_request: Callable[[str], None] | None = None  # inline driver: a trainer's turn

    def __post_init__(self):
        self._names = tuple(self.workflow.order())  # per-row lookups below: computed once
        self._turns = {n: self.workflow.turn(n) for n in self._names}

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def add_busy(self, role: str, seconds: float) -> None:
        with self.lock:
            self.busy[role] += seconds

    def sample_id(self, name: str, version: int, i: int, t: int) -> SampleId:
        return SampleId(version * self.n_inputs + i, self._turns[name], t)

    def put_rows(self, name: str, version: int, weights_version: int, i: int,
                 batch: RolloutBatch) -> None:
        """Input i's G rows of agent ``name`` into the store (rows already there are kept)."""
        for t, row in enumerate(group_rows(batch, self.runtimes[name].spec.group_size)):
            sid = self.sample_id(name, version, i, t)
            if not self.store.has(name, sid):
                self.store.put(name, sid, weights_version, row)

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


def _regenerate(run: PipelineRun, version: int, todo: list[int]) -> dict[str, list[int]]:
    """Per agent, the inputs of ``todo`` it rolls out: those it lacks rows of, and those a
    downstream agent rolls out whose upstream trajectory row is not in the store (a resumed
    run keeps every stored row and reads a downstream prompt from it)."""
    wf, need = run.workflow, {}
    for n in reversed(run.names):
        g = run.runtimes[n].spec.group_size
        need[n] = [i for i in todo if not all(run.store.has(n, run.sample_id(n, version, i, t))
                                              for t in range(g))]
        for m in run.names:
            e = wf.upstream(m)
            if e is not None and e.source == n:
                for i in need[m]:
                    sid = run.sample_id(n, version, i, e.trajectory)
                    if i not in need[n] and (not run.store.has(n, sid)
                                             or "tokens" not in run.store.get(n, sid).payload):
                        need[n].append(i)
        need[n].sort()
    return need


def rollout_serial(run: PipelineRun, version: int, weights_version: int, weights: Weights,
                   todo: list[int], prompts: list[str], need: dict[str, list[int]]) -> None:
    """Agent-major on this thread: each agent in turn order rolls out its inputs of ``todo``
    (``rollout_batch`` per engine call; see :func:`_regenerate`), a downstream agent on the
    prompts its upstream outputs give. An agent's rows of the version are all stored before
    the next agent starts, so its trainer's last micro-batch and step overlap the later agents'
    rollouts, and under strict an agent waits only for its own weights (:class:`Weights`).
    Samples are those of an input-major order (per-row keys, see ``runtime``).
    ``need``: :func:`_regenerate` of ``todo``.
    ``run.after_request(agent)`` (the inline driver's trainer of that agent) runs after each of
    the agent's requests is stored."""
    wf, tokens = run.workflow, {}
    texts = {n: {i: prompts[i] for i in todo} for n in run.names if wf.upstream(n) is None}
    for n in run.names:
        rt, edge = run.runtimes[n], wf.upstream(n)
        g, tokens[n] = rt.spec.group_size, {}
        if edge is not None:
            src = run.runtimes[edge.source]

            def upstream_tokens(i, edge=edge):  # generated now, else stored (None: neither)
                if i in tokens[edge.source]:
                    return tokens[edge.source][i][edge.trajectory]
                sid = run.sample_id(edge.source, version, i, edge.trajectory)
                if not run.store.has(edge.source, sid):
                    return None
                return run.store.get(edge.source, sid).payload.get("tokens")
            up = {i: upstream_tokens(i) for i in todo if i in texts[edge.source]}
            texts[n] = {i: rt.task.from_upstream(texts[edge.source][i],
                                                 completion_text(src.tokenizer, x))
                        for i, x in up.items() if x is not None}
        if not need[n]:
            continue
        params = weights(n)
        for chunk in chunks(need[n], run.rollout_batch):
            t0 = time.perf_counter()
            ids = [version * run.n_inputs + i for i in chunk]
            batch = rt.engine.generate_rows(
                params, [texts[n][i] for i in chunk],
                request_row_keys(run.seed, version, ids, wf.turn(n), g), g)
            run.add_busy("rollout", time.perf_counter() - t0)
            for i, part in zip(chunk, split_batch(batch, g)):
                tokens[n][i] = part.tokens
                run.put_rows(n, version, weights_version, i, part)
            if run.after_request is not None:
                run.after_request(n)


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
                   weights_version: int, weights: Weights) -> None:
    """Pulls agent ``name``'s requests until none is left; a downstream request waits for its
    upstream output, and each output extends the downstream agents' prompts."""
    rt, edge = run.runtimes[name], run.workflow.upstream(name)
    g, params = rt.spec.group_size, weights(name)
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
            params, [rq.text[name, i] for i in chunk],
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


def rollout_parallel(run: PipelineRun, version: int, weights_version: int, weights: Weights,
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
        need = _regenerate(run, v, list(range(run.n_inputs)))
        todo = sorted(set().union(*need.values()))  # inputs some agent lacks rows of
        if not todo:
            continue
        if run.mode == "strict":  # each agent's own version v, when it needs it
            wver, weights = v, Weights(run.board, v, run.timeout_s)
        else:  # the newest complete version the staleness bound allows, for every agent
            wver, published = run.board.get_at_least(v - run.eta, run.timeout_s)
            weights = Weights(run.board, wver, run.timeout_s, published)
        prompts = input_prompts(run.workflow, run.seed, v, run.n_inputs)
        if run.rollout_workers > 1:
            rollout_parallel(run, v, wver, weights, todo, prompts)
        else:
            rollout_serial(run, v, wver, weights, todo, prompts, need=need)


# ----------------------------------------------------------------------------- drivers


def trainer_thread(run: PipelineRun, trainer: AgentTrainer, policies: dict) -> None:
    """Thread driver: agent ``trainer.name``'s trainer on a thread of its own, waiting for each
    micro-batch's rows (see :mod:`~jaxflow.marl.pipeline.trainer`)."""
    while not trainer.done:
        if run.board.stop:
            return
        trainer.advance(timeout=0.5)
    policies[trainer.name] = trainer.finish()


def run_threads(run: PipelineRun, trainers: dict[str, AgentTrainer], policies: dict) -> None:
    """The rollout thread (or worker pools) and one blocking trainer thread per agent."""
    threads = [threading.Thread(target=run.guarded(rollout_thread), args=(run,), daemon=True)]
    threads += [threading.Thread(target=run.guarded(trainer_thread), args=(run, t, policies),
                                 daemon=True) for t in trainers.values()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + run.timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        run.board.halt()
        raise TimeoutError(f"run_pipeline did not finish in {run.timeout_s} s")
    if run.errors:
        raise run.errors[0]


def run_inline(run: PipelineRun, trainers: dict[str, AgentTrainer], policies: dict) -> None:
    """Inline driver (strict, one rollout thread): the calling thread rolls out agent-major and,
    after each engine call, lets that agent's trainer consume the micro-batches now ready. The
    trainers do not wait for their programs (JAX dispatches them asynchronously), so a
    micro-batch's accumulate and a version's step and publish run while the rollout's next
    engine calls are issued, with no thread hand-offs and no second Python thread contending
    for the interpreter lock. A rollout that needs weights not yet published is a bug here
    (never waited for): it raises at once."""
    def poll(name: str) -> None:
        while trainers[name].advance(timeout=0.0):
            pass
    run.after_request, run.timeout_s = poll, 0.0
    for n in trainers:  # a resumed trainer's rows may all be stored already
        poll(n)
    rollout_thread(run)
    for n in trainers:
        poll(n)
    late = {n: (t.version, t.micro) for n, t in trainers.items() if not t.done}
    if late:
        raise RuntimeError(f"inline driver: trainers {late} (version, micro-batch) lack rows "
                           "after every rollout")
    for n, t in trainers.items():
        policies[n] = t.finish()


# ----------------------------------------------------------------------------- the run


def _check_arguments(names, *, mode, eta, n_inputs, micro_inputs, rollout_workers,
                     driver) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: 'strict', 'bounded'")
    if driver not in DRIVERS:
        raise ValueError(f"unknown driver {driver!r}; valid: {', '.join(map(repr, DRIVERS))}")
    if driver == "inline" and (mode != "strict" or rollout_workers != 1):
        raise ValueError(f"driver='inline' with mode={mode!r}, rollout_workers="
                         f"{rollout_workers}: inline needs mode='strict' and rollout_workers=1")
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
                 timeout_s: float = 600.0, driver: str = "auto") -> RunResult:
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
      driver: "threads" (a rollout thread and a blocking trainer thread per agent),
        "inline" (strict with one rollout worker only: the trainers run on the rollout's
        thread between its engine calls and only dispatch their programs, see
        :func:`run_inline`) or "auto" (inline where it applies, else threads). Both give
        bit-identical results.
    """
    names = workflow.order()
    _check_arguments(names, mode=mode, eta=eta, n_inputs=n_inputs, micro_inputs=micro_inputs,
                     rollout_workers=rollout_workers, driver=driver)
    if driver == "auto":
        driver = "inline" if mode == "strict" and rollout_workers == 1 else "threads"
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

    trainers = {n: AgentTrainer(run, a, n, policies[n], block=driver == "threads")
                for a, n in enumerate(names)}
    start = time.perf_counter()
    (run_inline if driver == "inline" else run_threads)(run, trainers, policies)
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
