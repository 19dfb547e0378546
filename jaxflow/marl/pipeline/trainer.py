"""One agent's micro-batch trainer, shared by the pipeline's two drivers.

:class:`AgentTrainer` consumes agent n's rows of version v from the
:class:`~jaxflow.marl.store.ExperienceStore` in input order, ``micro_inputs`` inputs' G rows at a
time, into the gradient accumulator (committed with the rows), and once v's last micro-batch is
in, applies one optimizer step and publishes version v+1 on the board. Each call of
:meth:`AgentTrainer.advance` does at most one micro-batch; the thread driver calls it with a
timeout in a loop of its own (one thread per agent), the inline driver calls it without waiting
between the rollout's engine calls on the rollout's own thread.

``block``: wait for every program to finish before returning (the thread driver: its busy seconds
are device seconds). Without it, the accumulate / step / publish programs are only dispatched
(JAX runs them asynchronously, overlapping the rollout's next engine calls), busy seconds are the
host seconds spent in the trainer, and the host copy of version v's params for
:class:`~jaxflow.marl.pipeline.plan.RunResult` is taken when v+1 steps (or at the end), when v's
step has long finished. The two give bit-identical results: the same programs on the same
inputs in the same order.

The trainer's position and gradient sums are one immutable
:class:`~jaxflow.marl.pipeline.accumulate.Accumulator`, advanced by the pure
:func:`consume_micro_batch` (what the store commits); what the run reports accumulates in a
:class:`TrainerReport`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxflow.marl.pipeline.accumulate import Accumulator, flatten_accumulator, stack_rows
from jaxflow.marl.pipeline.plan import PipelinePlan
from jaxflow.marl.pipeline.runtime import AgentRuntime, loss_key
from jaxflow.marl.processes import host_tree
from jaxflow.rl.grpo import MiniBatch
from jaxflow.train.state import TrainState


class Interrupted(Exception):
    """Raised by a trainer when the ``interrupt`` hook of ``run_pipeline`` fires."""


def consume_micro_batch(rt: AgentRuntime, acc: Accumulator, mb: MiniBatch, *, key: jax.Array,
                        n_micro: int) -> Accumulator:
    """``acc`` after one more micro-batch ``mb`` (rows on the trainer mesh) of its version:
    the sums grow by it (:func:`~jaxflow.marl.pipeline.accumulate.accumulate`), or, when it
    is the version's ``n_micro``-th, the accumulate and the optimizer step run as one program
    and the result is the stepped policy at version + 1 with nothing accumulated. ``key``: the
    version's loss key. The gradient sums in ``acc`` are donated to the accumulation, and at
    the version's last micro-batch its policy to the step (the stepped state takes the old
    one's buffers: flexmarl full's solver on v5p:4x4x4 needed 113 GiB with both kept, over
    95); ``acc`` itself is not modified."""
    micro = acc.micro + 1
    if micro == n_micro:
        policy = rt.accumulate_apply(acc.policy, acc.grad_sum, acc.weight_sum, mb, key=key)
        return Accumulator(acc.version + 1, 0, None, None, policy)
    grad_sum, weight_sum = rt.accumulate(acc.grad_sum, acc.weight_sum, acc.policy.params, mb,
                                         key=key)
    return Accumulator(acc.version, micro, grad_sum, weight_sum, acc.policy)


@dataclasses.dataclass
class TrainerReport:
    """What a trainer reports: ``busy_s`` (seconds in the trainer), ``lags`` (version lag of
    every consumed row), ``params[v]`` (host params after version v's step) and ``rewards[v]``
    (v's reward mean)."""

    busy_s: float = 0.0
    lags: list[int] = dataclasses.field(default_factory=list)
    params: dict[int, Any] = dataclasses.field(default_factory=dict)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)


class AgentTrainer:
    """Agent ``name``'s consumer of the store (see module doc); starts from its resumed
    accumulator if the plan has one, else from ``policy`` at version 0.

    Its state is its own (one thread drives it): ``acc``, the position and sums (an immutable
    :class:`~jaxflow.marl.pipeline.accumulate.Accumulator`, replaced by each micro-batch), and
    ``report`` (:class:`TrainerReport`)."""

    def __init__(self, plan: PipelinePlan, agent_index: int, name: str, policy: TrainState, *,
                 block: bool):
        self.plan, self.agent_index, self.name, self.block = plan, agent_index, name, block
        self.acc: Accumulator = plan.resumed.get(name, Accumulator(0, 0, None, None, policy))
        self.report = TrainerReport()
        self._unfetched: tuple[int, Any] | None = None  # (version, device params) to copy
        self._key: tuple[int, jax.Array] | None = None

    @property
    def rt(self) -> AgentRuntime:
        """The agent's runtime."""
        return self.plan.config.runtimes[self.name]

    @property
    def n_micro(self) -> int:
        """Micro-batches per version."""
        return self.plan.config.n_inputs // self.plan.config.micro_inputs

    @property
    def version(self) -> int:
        """The version being trained (= versions stepped)."""
        return self.acc.version

    @property
    def micro(self) -> int:
        """Micro-batches of :attr:`version` consumed."""
        return self.acc.micro

    @property
    def done(self) -> bool:
        """Whether the trainer has taken all of the run's steps."""
        return self.version >= self.plan.config.steps

    def micro_batch_ids(self) -> list:
        """The sample ids of the next micro-batch (inputs in order, G rows each)."""
        plan, j, k = self.plan, self.micro, self.plan.config.micro_inputs
        return [plan.sample_id(self.name, self.version, i, t)
                for i in range(j * k, (j + 1) * k) for t in range(self.rt.spec.group_size)]

    def advance(self, timeout: float) -> bool:
        """Consumes the next micro-batch if its rows are all ready within ``timeout`` seconds
        (0: only if ready now); the version's last one also steps (one program: accumulate and
        apply) and publishes. Returns whether a micro-batch was consumed (False also when every
        version is done)."""
        if self.done:
            return False
        plan, cfg, name, v = self.plan, self.plan.config, self.name, self.version
        ids = self.micro_batch_ids()
        rows = plan.store.take_ids(name, ids, timeout=timeout)
        if rows is None:
            return False
        if cfg.swapper is not None and cfg.swapper.is_swapped(name):
            self.acc = self.acc._replace(policy=cfg.swapper.swap_in(name))
        t0 = time.perf_counter()
        row_lags = [v - r.version for r in rows]
        if max(row_lags) > cfg.eta or min(row_lags) < 0:
            raise RuntimeError(f"agent {name!r} step {v}: row version lag {row_lags} "
                               f"outside [0, eta={cfg.eta}]")
        mb = self.rt.place(stack_rows([r.payload for r in rows]))
        if self.micro + 1 == self.n_micro:
            self._fetch()  # the step donates the policy whose params wait to be fetched
        # the committed state after the last micro-batch is the stepped policy at version v+1
        self.acc = consume_micro_batch(self.rt, self.acc, mb, key=self._loss_key(v),
                                       n_micro=self.n_micro)
        last = self.acc.version > v
        if self.block:
            jax.block_until_ready((self.acc.grad_sum, self.acc.policy))
        self.report.busy_s += time.perf_counter() - t0
        plan.store.commit(name, ids, flatten_accumulator(self.acc) if plan.persist else None)
        self.report.lags.extend(row_lags)
        if last:
            self._publish(v)
        if cfg.interrupt is not None and cfg.interrupt(name, v, self.micro if not last
                                                       else self.n_micro):
            raise Interrupted(f"agent {name!r} stopped at version {v} after "
                              f"{self.n_micro if last else self.micro} micro-batches")
        return True

    def _loss_key(self, version: int) -> jax.Array:
        """The version's loss key (one for all its micro-batches), made once per version."""
        if self._key is None or self._key[0] != version:
            self._key = (version, loss_key(self.plan.config.seed, version, self.agent_index))
        return self._key[1]

    def _publish(self, v: int) -> None:
        """Version v is consumed and stepped: v's reward mean, publish v+1."""
        plan, cfg, name = self.plan, self.plan.config, self.name
        self._fetch()  # version v-1's copy: its step finished before this one started
        self.report.rewards[v] = float(np.mean([
            float(plan.store.get(name, plan.sample_id(name, v, i, t)).payload["reward"])
            for i in range(cfg.n_inputs) for t in range(self.rt.spec.group_size)]))
        policy = self.acc.policy
        plan.board.put(v + 1, name, self.rt.publish(policy))
        self._unfetched = (v, policy.params)
        if cfg.swapper is not None and v + 1 < cfg.steps:  # idle until v+1's rows arrive
            self._fetch()  # swapping out frees the device params
            cfg.swapper.swap_out(name, policy, version=v + 1)
            self.acc = self.acc._replace(policy=None)

    def _fetch(self) -> None:
        if self._unfetched is not None:
            v, params = self._unfetched
            self.report.params[v] = host_tree(params)
            self._unfetched = None

    def finish(self) -> TrainState:
        """The host copy of the last version's params taken; returns the final train state."""
        self._fetch()
        return self.acc.policy
