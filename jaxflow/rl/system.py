"""The GRPO trainer as a :class:`jaxflow.system.System`: a typed frozen state, ``init``, one
rollout + update iteration as ``step``, ``programs`` for ``--compile-only`` and ``evaluate``.

    system = GRPOSystem()
    setup = GRPOSetup(model_cfg, grpo_config, optim, task, tokenizer, seed=0, total_rollouts=50)
    state = system.init(setup, meshes, jax.random.key(0), params=warm_start_params)
    for r in range(50):
        state, metrics = system.step(state, None, key=jax.random.fold_in(jax.random.key(0), r))

What a run trains is a :class:`GRPOSetup` (the policy architecture, the GRPO and optimizer
settings, the task and tokenizer, the prompt seed, the weight sync); how the rollouts reach the
trainer (extra sync links, a remote rollout job, the peak FLOP/s) is the :class:`GRPOSystem`.
The state (:class:`GRPOState`) holds the policy's :class:`jaxflow.train.state.TrainState`, the
frozen reference params (KL), the published weights queue with its versions and origin, and the
rollout counter; its static ``trainer`` field is the run's :class:`jaxflow.rl.grpo.GRPOTrainer`
(jitted functions, rollout worker, publisher), which the step composes (rollout, pi_old
statistics, N updates, publish: :mod:`jaxflow.rl.grpo`).

Randomness: the step's ``key`` is the rollout's key (the sampling and loss keys are split from
it); ``fold_in(key(seed), rollout)`` is the stream :class:`GRPOTrainer` draws from its state's
``rng``, so both give the same rows. The prompts are a pure function of (seed, rollout counter)
(:meth:`jaxflow.rl.grpo.GRPOTrainer.rollout_prompts`), so a resumed run draws the same ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from jaxflow.data.tokenizer import Tokenizer
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import GRPOTrainer
from jaxflow.rl.grpo_step import GRPOConfig
from jaxflow.rl.tasks import Task
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.system import static_field, system_state
from jaxflow.train.lm_state import OptimConfig, init_params, lm_functions
from jaxflow.train.state import TrainState

__all__ = ["GRPOSetup", "GRPOState", "GRPOSystem"]


@dataclasses.dataclass(frozen=True)
class GRPOSetup:
    """What one GRPO run trains.

    Args:
      model: the policy architecture (f32 trainer; ``rl.lora`` adds adapters over it).
      rl: the :class:`jaxflow.rl.grpo_step.GRPOConfig`.
      optim: optimizer settings (``warmup_steps=0`` gives a constant learning rate).
      task, tokenizer: the verifiable task and its tokenizer.
      seed: the prompt stream's seed (prompts are a function of (seed, rollout)).
      total_rollouts: for the optimizer schedule (``total_rollouts * lag`` steps).
      sync: weight sync to bf16 rollout replicas; None: the dense f32 publish.
      eval_prompts, eval_samples: :meth:`GRPOSystem.evaluate`'s held-out prompts and samples
        per prompt (0 samples: greedy).
    """

    model: TransformerConfig
    rl: GRPOConfig
    optim: OptimConfig
    task: Task
    tokenizer: Tokenizer
    seed: int
    total_rollouts: int = 100
    sync: SyncConfig | None = None
    eval_prompts: int = 0
    eval_samples: int = 0


@system_state
class GRPOState:
    """One GRPO run's state (a pytree; ``trainer`` is static).

    Fields:
      policy: the policy's TrainState (params, optimizer state, ``step`` = its version).
      reference: the frozen reference params (KL to a reference), None with ``kl_coef == 0``.
      published: the queue of the last k+1 published weights (staleness k; with weight sync
        one entry, the replica's bf16 params).
      published_version: int32 [k+1], the queue's versions (oldest first).
      published_origin: the digest of the params the run started from.
      rollout: int32 [], rollouts done.
      setup: the :class:`GRPOSetup` it trains (static).
      trainer: the run's :class:`jaxflow.rl.grpo.GRPOTrainer` (static).
    """

    policy: TrainState
    reference: Any
    published: Any
    published_version: jax.Array
    published_origin: jax.Array
    rollout: jax.Array
    setup: GRPOSetup = static_field()
    trainer: GRPOTrainer = static_field()

    def as_dict(self) -> dict:
        """The state in :class:`jaxflow.rl.grpo.GRPOTrainer`'s dict form (no ``rng``: the
        system's step gets its key as an argument)."""
        out = {"policy": self.policy, "published": self.published,
               "published_version": self.published_version,
               "published_origin": self.published_origin, "rollout": self.rollout}
        if self.reference is not None:
            out["ref_params"] = self.reference
        return out

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], setup: GRPOSetup,
                  trainer: GRPOTrainer) -> "GRPOState":
        """A :class:`GRPOState` from the trainer's dict form (its ``rng`` dropped)."""
        return cls(policy=state["policy"], reference=state.get("ref_params"),
                   published=state["published"], published_version=state["published_version"],
                   published_origin=state["published_origin"], rollout=state["rollout"],
                   setup=setup, trainer=trainer)


@dataclasses.dataclass(frozen=True)
class GRPOSystem:
    """The GRPO trainer as a System (module doc).

    Args:
      sync_links: extra links (e.g. TCP replica processes) that receive every sync too.
      remote: the rollouts come from a separate rollout job (a
        :class:`jaxflow.rl.remote.RemoteRollout`); ``meshes["rollout"]`` then only evaluates.
      peak_flops: the trainer's peak FLOP/s for ``perf/mfu``; None: its chips' peak.
    """

    sync_links: tuple = ()
    remote: Any = None
    peak_flops: float | None = None

    def trainer(self, config: GRPOSetup, meshes: Mapping[str, Any]) -> GRPOTrainer:
        """The run's :class:`jaxflow.rl.grpo.GRPOTrainer` on ``meshes`` (``{"trainer": Mesh,
        "rollout": Mesh}``): its jitted functions and shardings, nothing allocated."""
        if not isinstance(config, GRPOSetup):
            raise TypeError(f"config is a {type(config).__name__}; valid: a GRPOSetup")
        return GRPOTrainer(config.model, config.rl, config.optim, config.task, config.tokenizer,
                           meshes, seed=config.seed, total_rollouts=config.total_rollouts,
                           sync=config.sync, sync_links=self.sync_links, remote=self.remote,
                           peak_flops=self.peak_flops)

    def init(self, config: GRPOSetup, meshes: Mapping[str, Any], key: jax.Array, *,
             params: Any = None) -> GRPOState:
        """The state starting from ``params`` (trainer-mesh pure dict, e.g. a warm start; None:
        ``config.model`` initialised from ``key``); the reference (KL) is a frozen copy."""
        trainer = self.trainer(config, meshes)
        if params is None:
            params = init_params(lm_functions(config.model, trainer.trainer_mesh), config.model, key)
        return GRPOState.from_dict(trainer.init_state(params), config, trainer)

    def step(self, state: GRPOState, batch: None = None, *, key: jax.Array
             ) -> tuple[GRPOState, dict[str, Any]]:
        """One rollout (prompts of ``state.rollout``, sampled with ``key``'s first half) + N
        updates (the loss keys from its second half) + publish; ``batch`` must be None. The
        row is :meth:`jaxflow.rl.grpo.GRPOTrainer.step`'s, plus ``sync/dense_bytes`` when this
        step synced (the dense bf16 bytes of what the publish replaced)."""
        if batch is not None:
            raise ValueError(f"GRPOSystem.step draws its own rollouts: batch must be None, got a "
                             f"{type(batch).__name__}")
        trainer = state.trainer
        new, metrics, sent = trainer.step_with_sync(state.as_dict(), key=trainer.placed_key(key))
        if sent is not None:
            metrics["sync/dense_bytes"] = float(sent.stats.dense_bytes)
        return GRPOState.from_dict(new, state.setup, trainer), metrics

    def programs(self, config: GRPOSetup, meshes: Mapping[str, Any]) -> list:
        """Every jitted program one RL step runs, with abstract arguments
        (:func:`jaxflow.rl.programs.grpo_programs`)."""
        from jaxflow.rl.programs import grpo_programs

        return grpo_programs(self.trainer(config, meshes))

    def heldout_accuracy(self, state: GRPOState, n: int, *, samples: int = 0) -> float:
        """Held-out accuracy of the current policy on ``n`` prompts: greedy, or pass@1 over
        ``samples`` samples per prompt at the RL temperature (fixed key)."""
        return state.trainer.heldout_accuracy(state.as_dict(), n, samples=samples)

    def evaluate(self, state: GRPOState) -> dict[str, float]:
        """``{"heldout_pass_at_1": ...}`` over the setup's ``eval_prompts`` x ``eval_samples``."""
        setup = state.setup
        return {"heldout_pass_at_1": self.heldout_accuracy(state, setup.eval_prompts,
                                                           samples=setup.eval_samples)}
