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
:class:`~jaxflow.marl.pipeline.sync.RunResult` is taken when v+1 steps (or at the end), when v's
step has long finished. The two give bit-identical results: the same programs on the same
inputs in the same order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxflow.marl.pipeline.accumulate import Accumulator, flatten_accumulator, stack_rows
from jaxflow.marl.pipeline.runtime import loss_key

if TYPE_CHECKING:  # the drivers' shared state (threads.py imports this module)
    from jaxflow.marl.pipeline.threads import PipelineRun


class Interrupted(Exception):
    """Raised by a trainer when the ``interrupt`` hook of ``run_pipeline`` fires."""


class AgentTrainer:
    """Agent ``name``'s consumer of the store (see module doc); starts from its resumed
    accumulator if the run has one, else from ``policy`` at version 0."""

    def __init__(self, run: PipelineRun, agent_index: int, name: str, policy: dict, *,
                 block: bool):
        self.run, self.agent_index, self.name, self.block = run, agent_index, name, block
        self.rt = run.runtimes[name]
        self.group_size = self.rt.spec.group_size
        self.n_micro = run.n_inputs // run.micro_inputs
        acc = run.resumed.get(name, Accumulator(0, 0, None, None, policy))
        self.version, self.micro = acc.version, acc.micro
        self.grad_sum, self.weight_sum, self.policy = acc.grad_sum, acc.weight_sum, acc.policy
        self._unfetched: tuple[int, Any] | None = None  # (version, device params) to copy
        self._key: tuple[int, jax.Array] | None = None

    @property
    def done(self) -> bool:
        return self.version >= self.run.steps

    def micro_batch_ids(self) -> list:
        """The sample ids of the next micro-batch (inputs in order, G rows each)."""
        run, j = self.run, self.micro
        return [run.sample_id(self.name, self.version, i, t)
                for i in range(j * run.micro_inputs, (j + 1) * run.micro_inputs)
                for t in range(self.group_size)]

    def advance(self, timeout: float) -> bool:
        """Consumes the next micro-batch if its rows are all ready within ``timeout`` seconds
        (0: only if ready now); the version's last one also steps (one program: accumulate and
        apply) and publishes. Returns whether a micro-batch was consumed (False also when every
        version is done)."""
        if self.done:
            return False
        run, rt, name, v = self.run, self.rt, self.name, self.version
        ids = self.micro_batch_ids()
        rows = run.store.take_ids(name, ids, timeout=timeout)
        if rows is None:
            return False
        if run.swapper is not None and run.swapper.is_swapped(name):
            self.policy = run.swapper.swap_in(name)
        t0 = time.perf_counter()
        row_lags = [v - r.version for r in rows]
        if max(row_lags) > run.eta or min(row_lags) < 0:
            raise RuntimeError(f"agent {name!r} step {v}: row version lag {row_lags} "
                               f"outside [0, eta={run.eta}]")
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
                self.grad_sum, self.weight_sum, self.policy["params"], mb,
                key=self._loss_key(v))
            done = Accumulator(v, self.micro, self.grad_sum, self.weight_sum, self.policy)
        if self.block:
            jax.block_until_ready((self.grad_sum, self.policy))
        run.add_busy(f"train/{name}", time.perf_counter() - t0)
        run.store.commit(name, ids, flatten_accumulator(done) if run.persist else None)
        with run.lock:
            run.lags.extend(row_lags)
        if last:
            self._publish(v)
        if run.interrupt is not None and run.interrupt(name, v, self.micro if not last
                                                       else self.n_micro):
            raise Interrupted(f"agent {name!r} stopped at version {v} after "
                              f"{self.n_micro if last else self.micro} micro-batches")
        return True

    def _loss_key(self, version: int) -> jax.Array:
        """The version's loss key (one for all its micro-batches), made once per version."""
        if self._key is None or self._key[0] != version:
            self._key = (version, loss_key(self.run.seed, version, self.agent_index))
        return self._key[1]

    def _publish(self, v: int) -> None:
        """Version v is consumed and stepped: v's reward mean, publish v+1, move on."""
        run, rt, name = self.run, self.rt, self.name
        self._fetch()  # version v-1's copy: its step finished before this one started
        run.out_rewards[v][name] = float(np.mean([
            float(run.store.get(name, run.sample_id(name, v, i, t)).payload["reward"])
            for i in range(run.n_inputs) for t in range(self.group_size)]))
        run.board.put(v + 1, name, rt.publish(self.policy))
        self._unfetched = (v, self.policy["params"])
        if run.swapper is not None and v + 1 < run.steps:  # idle until v+1's rows arrive
            self._fetch()  # swapping out frees the device params
            run.swapper.swap_out(name, self.policy, version=v + 1)
            self.policy = None
        self.version, self.micro = v + 1, 0

    def _fetch(self) -> None:
        if self._unfetched is not None:
            v, params = self._unfetched
            self.run.out_params[v][self.name] = jax.device_get(params)
            self._unfetched = None

    def finish(self) -> dict:
        """The host copy of the last version's params taken; returns the final train state."""
        self._fetch()
        return self.policy
