"""One agent's runtime (compiled GRPO functions, optimizer, sampler) and the pure
functions that key and batch rollouts.

Samples are a pure function of (seed, version v, input, turn, row): input i's G rows of agent
``name`` at version v are keyed ``fold_in(sample_key(seed, v, i, turn), t)``, so they do not
depend on which inputs share an engine call. :func:`version_keys` gives a version's two streams
(samples, losses) as one key array, the ``key`` of the lockstep step
(:func:`~jaxflow.marl.pipeline.barrier.lockstep_step`); the keys it derives equal
:func:`sample_key` / :func:`loss_key`'s bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import put
from jaxflow.marl.pipeline.accumulate import accumulate, accumulate_apply, weighted_grad
from jaxflow.marl.processes import host_tree, multi_process
from jaxflow.marl.sampling import AgentSampler, row_keys
from jaxflow.marl.workflow import AgentSpec, Workflow
from jaxflow.mesh import jit_on
from jaxflow.rl.grpo import GRPOConfig, MiniBatch, compiled_functions
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.rollout import EngineSettings, RolloutBatch, batch_sharding
from jaxflow.rl.tasks import completion_text
from jaxflow.train.lm_state import OptimConfig
from jaxflow.train.state import TrainState


class AgentRuntime:
    """One agent's compiled functions, optimizer and sampler (shared GRPO code).

    ``sampler``: the agent's :class:`~jaxflow.marl.sampling.AgentSampler` on ``meshes["rollout"]``
    (the paged engine, ``engine`` its shapes: :class:`jaxflow.rl.rollout.EngineSettings`).
    ``shardings``: the train state's, a ``TrainState`` of ``NamedSharding``; ``update``: the
    single-agent GRPO step ``(policy, mb, old, key=) -> (policy, metrics)`` (the barrier's);
    ``accumulate`` / ``accumulate_apply``: :mod:`~jaxflow.marl.pipeline.accumulate`'s, jitted."""

    def __init__(self, spec: AgentSpec, workflow: Workflow, meshes: dict[str, Mesh],
                 optim: OptimConfig, *, n_inputs: int, total_steps: int,
                 engine: EngineSettings = EngineSettings(), **grpo_overrides):
        self.spec = spec
        self.config = GRPOConfig(prompts_per_rollout=n_inputs, group_size=spec.group_size,
                                 max_new_tokens=spec.max_new_tokens, lag=1,
                                 **{"sis_topk": 4} | grpo_overrides)
        self.mesh = meshes["trainer"]
        (self.fns, self.tx, self.shardings, self.old_stats,
         self.update) = compiled_functions(spec.model, self.mesh, self.config, optim, total_steps)
        self.tokenizer = CharTokenizer()
        self.task = workflow.task(spec.name)
        self.sampler = AgentSampler(spec.model, meshes["rollout"],
                                    max_new_tokens=spec.max_new_tokens,
                                    temperature=self.config.temperature, task=self.task,
                                    tokenizer=self.tokenizer, settings=engine)
        self.weighted_grad = jit_on(self.mesh, functools.partial(weighted_grad, fns=self.fns,
                                                                 config=self.config))
        # the sums laid out as the params (on v6e:16x16 at model 8 XLA otherwise chose a
        # nearly replicated gradient sum: 13.5 GiB per device for the 1.9 GiB of the verifier)
        self.accumulate = jit_on(self.mesh, functools.partial(accumulate, fns=self.fns,
                                                              config=self.config),
                                 out_shardings=(self.fns.param_shardings,
                                                NamedSharding(self.mesh, PartitionSpec())),
                                 donate_argnums=0)
        self.accumulate_apply = jit_on(
            self.mesh, functools.partial(accumulate_apply, fns=self.fns, config=self.config),
            out_shardings=self.shardings, donate_argnums=0)

    def init_policy(self, params: Any) -> TrainState:
        """A fresh train state (step 0) around ``params`` (host or device pytree), on the
        trainer mesh in its own buffers (the updates donate them)."""
        params = put(host_tree(params), self.fns.param_shardings)
        return TrainState.create(self.tx, jax.tree.map(jnp.copy, params),
                                 self.fns.param_shardings)

    def place(self, mb: MiniBatch) -> MiniBatch:
        """A host micro-batch [rows, ...] onto the trainer mesh (rows sharded)."""
        sharding = batch_sharding(self.mesh, mb.tokens.shape[0])
        return MiniBatch(*put(tuple(mb), sharding))

    def publish(self, policy: TrainState) -> Any:
        """A copy of ``policy.params`` laid out for the sampler's engine; across processes, when
        the trainer and engine meshes differ, through the host (JAX reshards across processes
        only within one device set; :mod:`jaxflow.marl.processes`)."""
        if multi_process() and (set(self.mesh.devices.flat)
                                != set(self.sampler.mesh.devices.flat)):
            return put(host_tree(policy.params), self.sampler.param_shardings)
        return publish_weights(policy.params, self.sampler.param_shardings)


def agent_loads(workflow: Workflow, runtimes: dict[str, AgentRuntime]) -> dict[str, float]:
    """Estimated rollout load per agent: G * max_new_tokens * parameter count."""
    out = {}
    for n in workflow.order():
        rt = runtimes[n]
        n_params = sum(int(np.prod(x.shape))
                       for x in jax.tree.leaves(rt.fns.abstract_params()))
        out[n] = float(rt.spec.group_size * rt.spec.max_new_tokens * n_params)
    return out


def input_prompts(workflow: Workflow, seed: int, version: int, n_inputs: int) -> list[str]:
    """The turn-0 prompts of version ``version``: a pure function of (seed, version)."""
    first = workflow.order()[0]
    return workflow.task(first).prompts(np.random.default_rng([seed, version, 0x3A71]), n_inputs)


def sample_key(seed: int, version: int, input_id: int, turn: int) -> jax.Array:
    """The key of input ``input_id``'s group at (version, turn)."""
    key = jax.random.fold_in(jax.random.key(seed), version)
    return jax.random.fold_in(jax.random.fold_in(key, input_id), turn)


def loss_key(seed: int, version: int, agent_index: int) -> jax.Array:
    """The GRPO loss key of agent ``agent_index``'s step at ``version``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), version), agent_index)


def version_keys(seed: int, version: int) -> jax.Array:
    """Version ``version``'s keys [2]: ``[0]`` the sample stream (``fold_in(key[0], i)`` then
    the turn give :func:`sample_key`), ``[1]`` the loss stream (``fold_in(key[1], a)`` is
    :func:`loss_key` of agent a)."""
    return jnp.stack([jax.random.fold_in(jax.random.key(seed), version),
                      jax.random.fold_in(jax.random.key(seed + 1), version)])


@functools.partial(jax.jit, static_argnums=3)
def _group_row_keys(sample_stream, input_ids, turn, group_size):
    def one(i):
        return row_keys(jax.random.fold_in(jax.random.fold_in(sample_stream, i), turn), group_size)
    return jax.vmap(one)(input_ids).reshape(-1)


def group_row_keys(sample_stream: jax.Array, input_ids: list[int], turn: int,
                   group_size: int) -> jax.Array:
    """Row keys [len(input_ids) * G] from a version's sample stream (``version_keys(...)[0]``):
    row t of input i is ``fold_in(fold_in(fold_in(sample_stream, i), turn), t)``, the same keys
    as :func:`request_row_keys` of that seed and version."""
    return _group_row_keys(sample_stream, np.asarray(input_ids, np.uint32), np.uint32(turn),
                           group_size)


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
                   prompts: list[str], *, key: jax.Array, input_ids: list[int]
                   ) -> dict[str, RolloutBatch]:
    """Runs every agent on a batch of inputs in turn order (one engine call per agent; rows
    ``k*G .. k*G+G-1`` belong to ``input_ids[k]``); a target's prompt comes from its source.
    ``key``: the version's sample stream (``version_keys(seed, v)[0]``). Samples do not depend
    on how inputs are batched (per-row keys, :func:`group_row_keys`)."""
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
        keys = group_row_keys(key, input_ids, workflow.turn(name), rt.spec.group_size)
        out[name] = rt.sampler.generate_rows(published[name], texts[name], keys,
                                            rt.spec.group_size)
    return out


def rollout_input(workflow: Workflow, runtimes: dict[str, AgentRuntime], published: dict,
                  prompt: str, *, seed: int, version: int, input_id: int
                  ) -> dict[str, RolloutBatch]:
    """:func:`rollout_inputs` on one input, keyed by ``(seed, version)``'s sample stream."""
    return rollout_inputs(workflow, runtimes, published, [prompt],
                          key=version_keys(seed, version)[0], input_ids=[input_id])


def chunks(items: list, size: int) -> list[list]:
    """``items`` in consecutive pieces of ``size`` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"rollout_batch={size}: need >= 1")
    return [items[k:k + size] for k in range(0, len(items), size)]


def split_batch(batch: RolloutBatch, group_size: int) -> list[RolloutBatch]:
    """A multi-input rollout -> one RolloutBatch per input (its G rows)."""
    n = batch.tokens.shape[0] // group_size
    return [RolloutBatch(*(x[k * group_size:(k + 1) * group_size] for x in batch))
            for k in range(n)]
