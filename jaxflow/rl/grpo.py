"""The GRPO trainer: rollout, pi_old statistics, N updates and publishing, with the off-policy
knobs policy lag N, async staleness k and train/inference mismatch.

The pure functions it composes (config, loss, update) are in :mod:`jaxflow.rl.grpo_step`.

One RL step = one rollout then N optimizer steps on it:

1. The rollout sub-mesh samples G responses for each of ``prompts_per_rollout`` prompts with
   the weights published k rollouts ago (staleness k; k = 0 is synchronous) and the task
   scores them. The sampler's log-probs are the behaviour log-probs mu (TIS / MIS / RS).
   DAPO options: ``overlong_buffer`` adds the overlong penalty to each score
   (:mod:`jaxflow.rl.reward_shaping`); ``filter_groups`` drops groups whose G rewards are all
   equal and samples further generation batches (prompts and keys a pure function of
   (seed, rollout, generation batch); batch 0 is exactly the unfiltered rollout) until the
   rollout is full again (:mod:`jaxflow.rl.dynamic_sampling`).
   ``rl.sampler`` picks the sampler (:mod:`jaxflow.rl.rollout`); with "engine" the G
   responses of a prompt share its prefill and, with weight sync, the engine follows the
   serving bf16 replica in place. Every token's sampling version is in the batch
   (``versions``) and the step's ``sampler_version_min`` / ``_max`` metrics.
2. Group-normalised advantages over the whole rollout batch.
3. The batch is split into N mini-batches (policy lag N). Before the first update the trainer
   recomputes ``old_logp`` (and pi_old's top-K for SIS, and the frozen reference policy's
   log-probs for KL) with its *current* params, one mini-batch at a time through the same
   log-prob code as the loss, so mini-batch 1 is exactly on-policy (ratio == 1 bit for bit).
4. N optimizer steps, then the trainer's :class:`jaxflow.rl.publish.Publisher` hands the
   weights to the rollout mesh.

Parameter versions: the trainer's version is its optimizer step count. Rollout r samples
with version ``max(0, r - k) * N``; its mini-batch j (0-based) is trained at version
``r * N + j`` against ``old_logp`` of version ``r * N``.

Everything the run needs to continue is one pytree (:meth:`GRPOTrainer.init_state`):
the policy's :class:`jaxflow.train.state.TrainState` (params, optimizer state, step = its
version), the frozen reference params (when KL is on), the
queue of the last k+1 published weights, their versions and their origin (the digest of the
params the run started from), the rollout counter and the RNG
key. Randomness is a pure function of (key, rollout index), so resuming is bit-exact.

Weight sync (``sync=SyncConfig(codec=..., every=E)``, ``--set sync.codec=entropy``;
``sync=None`` is the plain dense f32 publish above): the trainer's
:class:`jaxflow.rl.publish.SyncPublisher` owns a :class:`jaxflow.sync.WeightSync` whose first
bf16 replica on the rollout sub-mesh serves the rollouts. ``every`` counts rollouts: after
rollouts E, 2E, ... the trainer publishes its params through ``WeightSync.publish`` as
version = its optimizer step (sparse payloads of the changed bf16 bit patterns); the rollouts
in between keep sampling the previous synced version. The publish returns its ``SyncRecord``
(``train_on_rollout`` and ``step_with_sync`` hand it back; ``step`` reports it as ``synced`` /
``sync_*`` metrics).
Every rollout first goes through the version check (``WeightSync.rollout_params``: a replica
that fell behind is caught up, or VersionMismatch with ``on_mismatch="error"``), and the
sampler gets the replica's bf16 values upcast to f32 (exact), so it samples bit-for-bit the
trainer's bf16 cast at that version whatever its ``mismatch`` knob (``"bf16"`` then computes
in bf16 as well). The queue holds one entry, the replica's bf16 params and version, so it is in
the checkpoint; a state whose published version is not the replica's (a restored checkpoint,
a fresh trainer) is served after a dense resync from that entry, so resuming stays
bit-exact. Async staleness k > 0 is rejected with sync on (one replica holds one version);
policy lag N is supported.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import put
from jaxflow.mesh import jit_on
from jaxflow.models import lora
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.advantages import grpo_advantages
from jaxflow.rl.dynamic_sampling import fill_groups
from jaxflow.rl.grpo_step import (  # noqa: F401
    KL_ESTIMATORS,
    GRPOConfig,
    MiniBatch,
    OldStats,
    compiled_functions,
    grpo_loss,
    make_rl_optimizer,
    old_stats,
    policy_config,
    response_hidden,
    summarize,
    update_step,
)
from jaxflow.rl.publish import DensePublisher, Publisher, SyncPublisher, params_origin, publish_weights
from jaxflow.rl.reward_shaping import overlong_penalty
from jaxflow.rl.rollout import RolloutBatch, RolloutWorker, batch_sharding
from jaxflow.rl.tasks import Task
from jaxflow.sync.replica import Link
from jaxflow.sync.weight_sync import SyncConfig, SyncRecord, WeightSync
from jaxflow.train.lm_state import OptimConfig, lm_functions
from jaxflow.train.state import TrainState

__all__ = ["GRPOTrainer", "GRPOConfig", "MiniBatch", "OldStats", "compiled_functions",
           "grpo_loss", "make_rl_optimizer", "old_stats", "response_hidden", "rollout_row",
           "summarize", "update_step", "version_metrics", "KL_ESTIMATORS"]


class GRPOTrainer:
    """Composes rollout, old-stat recomputation, N updates and publishing (see module doc).

    Args:
      model_cfg: the policy architecture (f32 trainer).
      config: a :class:`GRPOConfig`.
      optim: optimizer settings (``warmup_steps=0`` gives a constant learning rate).
      task, tokenizer: the verifiable task and its tokenizer.
      meshes: ``{"trainer": Mesh, "rollout": Mesh}`` (disjoint, or the same mesh to colocate).
      seed: seeds the RNG key and the prompt stream.
      total_rollouts: for the optimizer schedule (``total_rollouts * lag`` steps).
      sync: weight sync to bf16 rollout replicas (module doc); None: the dense f32 publish.
      sync_links: extra links (e.g. TCP replica processes) that receive every sync too.
      remote: the rollouts come from a separate rollout job (a
        :class:`jaxflow.rl.remote.RemoteRollout`: publisher and sampler in one, weights only
        as SparseRL-Sync payloads); ``meshes["rollout"]`` then only evaluates (held-out pass@1
        with the trainer's f32 params, as the in-process rollout mesh does).
    """

    def __init__(self, model_cfg: TransformerConfig, config: GRPOConfig, optim: OptimConfig,
                 task: Task, tokenizer: CharTokenizer, meshes: dict[str, Mesh], *, seed: int,
                 total_rollouts: int = 100, sync: SyncConfig | None = None,
                 sync_links: Sequence[Link] = (), remote: Any = None):
        model_cfg = policy_config(model_cfg, config)  # with rl.lora: the adapters' model
        self.model_cfg, self.config, self.optim, self.seed = model_cfg, config, optim, seed
        self.task, self.tokenizer = task, tokenizer
        self.sync_config = sync
        if sync is not None and config.staleness:
            raise ValueError(
                f"sync.codec={sync.codec!r} with staleness={config.staleness}: the synced "
                "rollout replica holds one version, so async staleness k > 0 is not supported "
                f"with weight sync; use staleness=0 (sync.every={sync.every} already delays "
                "the sampler's weights by whole rollouts) or sync=None")
        if remote is not None and (sync is None or sync_links):
            raise ValueError("a remote rollout job is reached only through SparseRL-Sync: it needs "
                             "sync (not none) and no extra sync_links")
        if remote is not None and model_cfg.lora.rank:
            raise ValueError(f"rl.lora.rank={model_cfg.lora.rank} with a remote rollout job: the "
                             "rollout job samples base-shaped bf16 replicas; LoRA runs use the "
                             "one-job roles (remote.role=local) for now")
        if sync_links and sync is None:
            raise ValueError("sync_links given but weight sync is off (sync=None)")
        self.trainer_mesh, self.rollout_mesh = meshes["trainer"], meshes["rollout"]
        (self.fns, self.tx, self.shardings, self._old_stats,
         self._update) = compiled_functions(model_cfg, self.trainer_mesh, config, optim,
                                            total_rollouts * config.lag)
        self.worker = RolloutWorker(dataclasses.replace(model_cfg, lora=lora.LoraConfig()),
                                    self.rollout_mesh, config.rollout_spec, task, tokenizer)
        self._lora_setup(model_cfg.lora)
        self.publisher: Publisher = (
            remote if remote is not None
            else DensePublisher(self.published_shardings, staleness=config.staleness)
            if sync is None else SyncPublisher(self.published_shardings, sync,
                                               links=sync_links))
        self.sampler = remote if remote is not None else self.worker  # who generates rollouts

    def _lora_setup(self, cfg: lora.LoraConfig) -> None:
        """What the publisher carries with LoRA (``cfg.publish``): base + adapters, merged on
        the rollout mesh before sampling ("adapters"), or the trainer's merge ("merged")."""
        self.published_shardings = self.worker.param_shardings  # base-shaped, the sampler's
        self._merge_trainer = self._merge_rollout = None
        if not cfg.enabled:
            return
        merge = functools.partial(lora.merge, lora=cfg)
        if cfg.publish == "adapters":
            self.published_shardings = lm_functions(self.model_cfg, self.rollout_mesh).param_shardings
            self._merge_rollout = jit_on(self.rollout_mesh, merge,
                                         out_shardings=self.worker.param_shardings)
        else:
            base = dataclasses.replace(self.model_cfg, lora=lora.LoraConfig())
            self._merge_trainer = jit_on(self.trainer_mesh, merge, out_shardings=lm_functions(
                base, self.trainer_mesh).param_shardings)

    def published_tree(self, params: Any) -> Any:
        """What the publisher sends for the trainer's ``params``: themselves, or with LoRA
        publish="merged" the merged base-shaped params."""
        return params if self._merge_trainer is None else self._merge_trainer(params)

    def sampler_params(self, published: Any) -> Any:
        """The base-shaped params the sampler uses for a published tree (LoRA "adapters":
        merged on the rollout mesh)."""
        return published if self._merge_rollout is None else self._merge_rollout(published)

    @property
    def weight_sync(self) -> WeightSync | None:
        """The WeightSync serving the rollouts (None with sync off or before ``init_state``)."""
        return getattr(self.publisher, "weight_sync", None)

    # -- state ---------------------------------------------------------------------------

    def init_state(self, params: Any) -> dict:
        """The whole RL state, starting from ``params`` (trainer-mesh pure dict, e.g. a warm
        start): ``{"policy": TrainState, "published", "published_version",
        "published_origin", "rollout": int32 [], "rng": key data [2]}`` (+ ``"ref_params"``
        with KL). The reference policy (KL) is a frozen copy of ``params``."""
        if self.model_cfg.lora.enabled and not lora.has_adapters(params):
            params = lora.add_adapters(params, self.model_cfg)  # B = 0: exactly the warm start
        params = jax.device_put(params, self.fns.param_shardings)
        # the policy gets its own buffers: its updates donate them, the reference keeps these
        policy = TrainState.create(self.tx, jax.tree.map(jnp.copy, params),
                                   self.fns.param_shardings)
        replicated = NamedSharding(self.trainer_mesh, PartitionSpec())
        origin = params_origin(params)
        published, versions = self.publisher.init(self.published_tree(policy.params), origin)
        state = {
            "policy": policy,
            "published": published,
            "published_version": versions,
            "published_origin": origin,
            # host values placed per process (distributed.put): the trainer mesh may span processes
            "rollout": put(np.zeros((), np.int32), replicated),
            "rng": put(np.asarray(jax.random.key_data(jax.random.key(self.seed))), replicated),
        }
        if self.config.kl_coef > 0:
            state["ref_params"] = params
        return state

    # -- one RL step ---------------------------------------------------------------------

    def rollout_prompts(self, rollout: int, gen_batch: int = 0) -> list[str]:
        """The prompts of rollout ``rollout`` (its generation batch ``gen_batch`` with
        dynamic sampling): a pure function of (seed, rollout, gen_batch)."""
        extra = [gen_batch] if gen_batch else []  # batch 0: the unfiltered rollout's prompts
        rng = np.random.default_rng([self.seed, rollout, 0x6A7F, *extra])
        return self.task.prompts(rng, self.config.prompts_per_gen_batch)

    def _keys(self, state: dict, rollout: int) -> tuple[jax.Array, jax.Array]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), rollout)
        sample_key, loss_key = jax.random.split(key)
        return sample_key, loss_key

    def rollout_params(self, state: dict) -> Any:
        """The params this step's rollout samples with (on the rollout mesh): the oldest
        queued published weights; with weight sync, the serving replica's bf16 params after
        the version check, upcast to f32 (exact)."""
        return self.sampler_params(self.publisher.rollout_params(
            state["published"], state["published_version"], state["published_origin"]))

    def _replica_to_follow(self) -> Any:
        """The in-process SparseRL-Sync replica the engine samples from in place (sampler
        "engine" with weight sync, in one job, without LoRA's rollout-side merge); else None."""
        if (self.config.sampler != "engine" or self.sampler is not self.worker
                or self._merge_rollout is not None or self.weight_sync is None):
            return None
        return self.weight_sync.replicas[0]

    def _generation_batch(self, params: Any, rollout: int, gen_batch: int,
                          sample_key: jax.Array, version: int
                          ) -> tuple[RolloutBatch, np.ndarray]:
        """One generation batch, rewards shaped; returns it and the task scores [B]."""
        key = sample_key if gen_batch == 0 else jax.random.fold_in(sample_key, gen_batch)
        batch = self.sampler.generate(params, self.rollout_prompts(rollout, gen_batch), key,
                                      version=version, replica=self._replica_to_follow())
        scores = batch.rewards
        buffer = self.config.overlong_buffer
        if buffer is not None:
            penalty = np.asarray(overlong_penalty(batch.mask.sum(axis=1),
                                                  self.config.max_new_tokens, buffer.len,
                                                  buffer.penalty_factor))
            batch = batch._replace(rewards=(scores + penalty).astype(np.float32))
        return batch, scores

    def generate_with_stats(self, state: dict) -> tuple[RolloutBatch, dict[str, float]]:
        """This step's rollout, sampled with :meth:`rollout_params`, and host statistics:
        ``score_mean`` (task score before shaping) and, with filter_groups,
        ``num_gen_batches`` and ``kept_group_fraction`` (groups with signal / generated)."""
        rollout = int(state["rollout"])
        sample_key, _ = self._keys(state, rollout)
        params = self.rollout_params(state)
        version = int(np.asarray(state["published_version"])[0])
        cfg = self.config
        if not cfg.filter_groups:
            batch, scores = self._generation_batch(params, rollout, 0, sample_key, version)
            return batch, {"score_mean": float(np.mean(scores))}
        scores_of = {}

        def generate(i):
            batch, scores = self._generation_batch(params, rollout, i, sample_key, version)
            scores_of[i] = scores
            return batch, scores if cfg.filter_groups_metric == "acc" else batch.rewards

        batch, fill = fill_groups(generate, num_groups=cfg.prompts_per_rollout,
                                  group_size=cfg.group_size,
                                  max_num_gen_batches=cfg.max_num_gen_batches)
        all_scores = np.concatenate([scores_of[i] for i in sorted(scores_of)])
        return batch, {"score_mean": float(np.mean(all_scores)),
                       "num_gen_batches": float(fill["num_gen_batches"]),
                       "kept_group_fraction": fill["groups_with_signal"]
                       / fill["groups_generated"]}

    def generate(self, state: dict) -> RolloutBatch:
        """This step's rollout, sampled with :meth:`rollout_params` (see
        :meth:`generate_with_stats`)."""
        return self.generate_with_stats(state)[0]

    def minibatches(self, batch: RolloutBatch) -> list[MiniBatch]:
        """Advantages over the whole rollout, then N contiguous mini-batches on the trainer."""
        adv = np.asarray(grpo_advantages(jnp.asarray(batch.rewards), self.config.group_size,
                                         normalize_std=self.config.normalize_std))
        size = self.config.minibatch_size
        sharding = batch_sharding(self.trainer_mesh, size)
        out = []
        for j in range(self.config.lag):
            rows = slice(j * size, (j + 1) * size)
            out.append(MiniBatch(*(put(x[rows], sharding) for x in (
                batch.prompts, batch.prompt_lengths, batch.tokens, batch.mask,
                batch.behaviour_logp, adv.astype(np.float32)))))
        return out

    def train_on_rollout(self, state: dict, batch: RolloutBatch
                         ) -> tuple[dict, list[dict], SyncRecord | None]:
        """Old stats for every mini-batch at the current params, then N updates, then publish.

        Returns the new state, one metrics dict (device scalars) per mini-batch, and what the
        publish sent through the weight sync (its ``SyncRecord``; None with sync off or when
        this rollout was not due to sync).
        """
        rollout = int(state["rollout"])
        _, loss_key = self._keys(state, rollout)
        mbs = self.minibatches(batch)
        policy = state["policy"]
        ref = state.get("ref_params")
        olds = [self._old_stats(policy.params, ref, mb) for mb in mbs]
        keys = jax.random.split(loss_key, len(mbs))
        history = []
        for mb, old, key in zip(mbs, olds, keys):
            policy, metrics = self._update(policy, mb, old, key=key)
            history.append(metrics)
        new = dict(state)
        new["policy"] = policy
        new["published"], new["published_version"], sent = self.publisher.publish(
            state["published"], state["published_version"], self.published_tree(policy.params),
            policy.step,
            rollout=rollout, origin=state["published_origin"])
        new["rollout"] = state["rollout"] + 1
        return new, history, sent

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        """One rollout + N updates + publish; host metrics of the step (``reward_mean`` is of
        the shaped rewards the advantages use; with overlong shaping or dynamic sampling also
        the statistics of :meth:`generate_with_stats`). With weight sync also
        ``synced`` (1.0 when this step synced) and, when it did, ``sync_payload_bytes``,
        ``sync_changed_fraction`` and ``sync_bit_exact``."""
        state, metrics, _ = self.step_with_sync(state)
        return state, metrics

    def step_with_sync(self, state: dict) -> tuple[dict, dict[str, float], SyncRecord | None]:
        """:meth:`step`, and the ``SyncRecord`` of what its publish sent through the weight sync
        (None with sync off or when this rollout was not due to sync)."""
        sampler_version = int(state["published_version"][0])
        trainer_version = int(state["policy"].step)
        batch, generation = self.generate_with_stats(state)
        state, history, sent = self.train_on_rollout(state, batch)
        metrics = summarize(history, batch, sampler_version, trainer_version)
        metrics.update(version_metrics(batch))
        if self.config.filter_groups or self.config.overlong_buffer is not None:
            metrics.update(generation)
        if self.sync_config is not None:  # did this step sync, and what did it send
            metrics["synced"] = float(sent is not None)
            if sent is not None:
                metrics["sync_payload_bytes"] = float(sent.stats.payload_bytes)
                metrics["sync_changed_fraction"] = sent.stats.changed_fraction
                metrics["sync_bit_exact"] = float(sent.bit_exact)
        return state, metrics, sent

    def heldout_accuracy(self, state: dict, n: int, *, samples: int = 0) -> float:
        """Held-out accuracy of the current trainer params (published fresh): greedy, or
        sampled pass@1 averaged over ``samples`` per prompt (see RolloutWorker)."""
        params = state["policy"].params
        if self.model_cfg.lora.enabled:
            params = lora.merge(params, self.model_cfg.lora)
        params = publish_weights(params, self.worker.param_shardings)
        return self.worker.heldout_accuracy(params, n, samples=samples)


def version_metrics(batch: RolloutBatch) -> dict[str, int]:
    """``sampler_version_min`` / ``_max``: the oldest and newest weights version that sampled a
    response token of ``batch`` (its per-token ``versions`` over the mask; -1 when unknown)."""
    seen = np.asarray(batch.versions)[np.asarray(batch.mask) > 0]
    if seen.size == 0:
        return {"sampler_version_min": -1, "sampler_version_max": -1}
    return {"sampler_version_min": int(seen.min()), "sampler_version_max": int(seen.max())}


def rollout_row(window: Sequence[Mapping[str, Any]]) -> dict:
    """``summarize`` for :func:`jaxflow.train.loop.run_steps` in RL drivers that log every
    rollout (``log_every=1``): the one step's host metrics unchanged (ints stay ints, key order
    kept), so the rows are those of :meth:`GRPOTrainer.step`."""
    (metrics,) = window
    return dict(metrics)
