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
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from jaxflow.marl.pipeline.accumulate import Accumulator, flatten_accumulator, stack_rows
from jaxflow.marl.pipeline.plan import PipelinePlan
from jaxflow.marl.pipeline.runtime import loss_key
from jaxflow.marl.processes import host_tree
from jaxflow.train.state import TrainState


class Interrupted(Exception):
    """Raised by a trainer when the ``interrupt`` hook of ``run_pipeline`` fires."""


class AgentTrainer:
    """Agent ``name``'s consumer of the store (see module doc); starts from its resumed
    accumulator if the plan has one, else from ``policy`` at version 0.

    Its state is its own (one thread drives it): the position (``version``, ``micro``), the
    accumulator and the policy, and what the run reports: ``busy_s`` (seconds in the trainer),
    ``lags`` (version lag of every consumed row), ``params[v]`` (host params after version v's
    step) and ``rewards[v]`` (v's reward mean)."""

    def __init__(self, plan: PipelinePlan, agent_index: int, name: str, policy: TrainState, *,
                 block: bool):
        self.plan, self.agent_index, self.name, self.block = plan, agent_index, name, block
        cfg = plan.config
        self.rt = cfg.runtimes[name]
        self.group_size = self.rt.spec.group_size
        self.n_micro = cfg.n_inputs // cfg.micro_inputs
        acc = plan.resumed.get(name, Accumulator(0, 0, None, None, policy))
        self.version, self.micro = acc.version, acc.micro
        self.grad_sum, self.weight_sum, self.policy = acc.grad_sum, acc.weight_sum, acc.policy
        self.busy_s = 0.0
        self.lags: list[int] = []
        self.params: dict[int, Any] = {}
        self.rewards: dict[int, float] = {}
        self._unfetched: tuple[int, Any] | None = None  # (version, device params) to copy
        self._key: tuple[int, jax.Array] | None = None

    @property
    def done(self) -> bool:
        """Whether the trainer has taken all of the run's steps."""
        return self.version >= self.plan.config.steps

    def micro_batch_ids(self) -> list:
        """The sample ids of the next micro-batch (inputs in order, G rows each)."""
        plan, j, k = self.plan, self.micro, self.plan.config.micro_inputs
        return [plan.sample_id(self.name, self.version, i, t)
                for i in range(j * k, (j + 1) * k) for t in range(self.group_size)]

    def advance(self, timeout: float) -> bool:
        """Consumes the next micro-batch if its rows are all ready within ``timeout`` seconds
        (0: only if ready now); the version's last one also steps (one program: accumulate and
        apply) and publishes. Returns whether a micro-batch was consumed (False also when every
        version is done)."""
        if self.done:
            return False
        plan, cfg, rt, name, v = self.plan, self.plan.config, self.rt, self.name, self.version
        ids = self.micro_batch_ids()
        rows = plan.store.take_ids(name, ids, timeout=timeout)
        if rows is None:
            return False
        if cfg.swapper is not None and cfg.swapper.is_swapped(name):
            self.policy = cfg.swapper.swap_in(name)
        t0 = time.perf_counter()
        row_lags = [v - r.version for r in rows]
        if max(row_lags) > cfg.eta or min(row_lags) < 0:
            raise RuntimeError(f"agent {name!r} step {v}: row version lag {row_lags} "
                               f"outside [0, eta={cfg.eta}]")
        mb = rt.place(stack_rows([r.payload for r in rows]))
        self.micro += 1
        last = self.micro == self.n_micro
        if last:  # the committed state is the stepped policy at version v+1
            self.policy = rt.accumulate_apply(self.policy, self.grad_sum, self.weight_sum, mb,
                                              key=self._loss_key(v))
            self.grad_sum, self.weight_sum = None, None
            done = Accumulator(v + 1, 0, None, None, self.policy)
        else:
            self.grad_sum, self.weight_sum = rt.accumulate(
                self.grad_sum, self.weight_sum, self.policy.params, mb, key=self._loss_key(v))
            done = Accumulator(v, self.micro, self.grad_sum, self.weight_sum, self.policy)
        if self.block:
            jax.block_until_ready((self.grad_sum, self.policy))
        self.busy_s += time.perf_counter() - t0
        plan.store.commit(name, ids, flatten_accumulator(done) if plan.persist else None)
        self.lags.extend(row_lags)
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
        """Version v is consumed and stepped: v's reward mean, publish v+1, move on."""
        plan, cfg, rt, name = self.plan, self.plan.config, self.rt, self.name
        self._fetch()  # version v-1's copy: its step finished before this one started
        self.rewards[v] = float(np.mean([
            float(plan.store.get(name, plan.sample_id(name, v, i, t)).payload["reward"])
            for i in range(cfg.n_inputs) for t in range(self.group_size)]))
        plan.board.put(v + 1, name, rt.publish(self.policy))
        self._unfetched = (v, self.policy.params)
        if cfg.swapper is not None and v + 1 < cfg.steps:  # idle until v+1's rows arrive
            self._fetch()  # swapping out frees the device params
            cfg.swapper.swap_out(name, self.policy, version=v + 1)
            self.policy = None
        self.version, self.micro = v + 1, 0

    def _fetch(self) -> None:
        if self._unfetched is not None:
            v, params = self._unfetched
            self.params[v] = host_tree(params)
            self._unfetched = None

    def finish(self) -> TrainState:
        """The host copy of the last version's params taken; returns the final train state."""
        self._fetch()
        return self.policy
