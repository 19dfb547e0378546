"""The GRPO trainer: rollout, pi_old statistics, N updates and publishing, with the off-policy
knobs policy lag N, async staleness k and train/inference mismatch.

The pure functions it composes are in :mod:`jaxflow.rl.grpo_step` (config, loss) and
:mod:`jaxflow.rl.update` (the update programs); :class:`jaxflow.rl.system.GRPOSystem` is
this trainer as a System (a typed frozen state, the step keyed per rollout), for the drivers.

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
   When nothing but the log-probs is needed and lag is 1 (``GRPOConfig.old_from_update``),
   there is no separate pass: the update uses the stop-gradient of its own forward.
4. N optimizer steps, then the trainer's :class:`jaxflow.rl.publish.Publisher` hands the
   weights to the rollout mesh. With ``rl.microbatches`` M > 1 each step accumulates the
   gradients of M micro-batches (one's activations at a time) in one program.

Rows (:meth:`GRPOTrainer.step`) are named as verl names them (``actor/*``, ``critic/*``,
``response_length/*``, ``timing_s/*``, ``perf/*``; :mod:`jaxflow.rl.step_metrics`).

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
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import Tokenizer, check_tokenizer
from jaxflow.distributed import put
from jaxflow.errors import UserError
from jaxflow.mesh import jit_on
from jaxflow.models import lora
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl import step_metrics
from jaxflow.rl.advantages import grpo_advantages
from jaxflow.rl.dynamic_sampling import fill_groups
from jaxflow.rl.grpo_step import (  # noqa: F401
    KL_ESTIMATORS,
    GRPOConfig,
    MiniBatch,
    OldStats,
    grpo_loss,
    make_rl_optimizer,
    old_stats,
    policy_config,
    response_hidden,
    rl_learning_rate,
    summarize,
)
from jaxflow.rl.publish import DensePublisher, Publisher, SyncPublisher, params_origin, publish_weights
from jaxflow.rl.reward_shaping import overlong_penalty
from jaxflow.rl.rollout import RolloutBatch, RolloutWorker, batch_sharding
from jaxflow.rl.step_metrics import rollout_row, version_metrics
from jaxflow.rl.tasks import Task, check_task, stop_ids
from jaxflow.rl.update import compiled_functions, update_step  # noqa: F401
from jaxflow.sync.replica import Link
from jaxflow.sync.weight_sync import SyncConfig, SyncRecord, WeightSync
from jaxflow.train.lm_state import OptimConfig, lm_functions
from jaxflow.train.state import TrainState

__all__ = ["GRPOTrainer", "GRPOConfig", "MiniBatch", "OldStats", "compiled_functions",
           "grpo_loss", "make_rl_optimizer", "old_stats", "response_hidden", "rollout_row",
           "summarize", "update_step", "version_metrics", "KL_ESTIMATORS", "MeshRoleError"]

ROLES = ("trainer", "rollout")


class MeshRoleError(UserError, KeyError):
    """``meshes`` lacks a role the trainer needs or maps one to something not a Mesh."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def check_meshes(meshes: Any) -> dict[str, Mesh]:
    """``meshes`` when it maps "trainer" and "rollout" to a ``jax.sharding.Mesh``; else a
    one-line :class:`MeshRoleError` naming the missing role or the bad value."""
    if not isinstance(meshes, Mapping):
        raise MeshRoleError(f"meshes={type(meshes).__name__}; valid: a dict {{'trainer': Mesh, "
                            "'rollout': Mesh}} (jaxflow.mesh.role_meshes, or one Mesh for both)")
    missing = [r for r in ROLES if r not in meshes]
    if missing:
        raise MeshRoleError(f"meshes has no {' or '.join(repr(r) for r in missing)} role (it has "
                            f"{sorted(meshes)}); valid: a dict {{'trainer': Mesh, 'rollout': Mesh}}"
                            " (disjoint sub-meshes, or the same mesh to colocate)")
    for role in ROLES:
        if not isinstance(meshes[role], Mesh):
            raise MeshRoleError(f"meshes[{role!r}] is a {type(meshes[role]).__name__}; valid: a "
                                "jax.sharding.Mesh")
    return dict(meshes)


class GRPOTrainer:
    """Composes rollout, old-stat recomputation, N updates and publishing (see module doc).

    Args:
      model_cfg: the policy architecture (f32 trainer).
      config: a :class:`GRPOConfig`.
      optim: optimizer settings (``warmup_steps=0`` gives a constant learning rate).
      task, tokenizer: the verifiable task (:class:`jaxflow.rl.tasks.Task`) and any
        :class:`jaxflow.data.tokenizer.Tokenizer` (a row stops at any of its ``eos_ids``).
      meshes: ``{"trainer": Mesh, "rollout": Mesh}`` (disjoint, or the same mesh to colocate).
      seed: seeds the RNG key and the prompt stream.
      total_rollouts: for the optimizer schedule (``total_rollouts * lag`` steps).
      sync: weight sync to bf16 rollout replicas (module doc); None: the dense f32 publish.
      sync_links: extra links (e.g. TCP replica processes) that receive every sync too.
      remote: the rollouts come from a separate rollout job (a
        :class:`jaxflow.rl.remote.RemoteRollout`: publisher and sampler in one, weights only
        as SparseRL-Sync payloads); ``meshes["rollout"]`` then only evaluates (held-out pass@1
        with the trainer's f32 params, as the in-process rollout mesh does).
      peak_flops: the trainer's peak FLOP/s for ``perf/mfu``; None: its chips' peak, or the
        nominal CPU peak (:func:`jaxflow.rl.step_metrics.peak_flops`).

    A wrong argument type (task, tokenizer, meshes) is one line naming what is expected,
    raised here before anything is compiled.
    """

    def __init__(self, model_cfg: TransformerConfig, config: GRPOConfig, optim: OptimConfig,
                 task: Task, tokenizer: Tokenizer, meshes: Mapping[str, Mesh], *, seed: int,
                 total_rollouts: int = 100, sync: SyncConfig | None = None,
                 sync_links: Sequence[Link] = (), remote: Any = None,
                 peak_flops: float | None = None):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config is a {type(config).__name__}; valid: a GRPOConfig")
        meshes = check_meshes(meshes)
        check_task(task)
        check_tokenizer(tokenizer)
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
        self.learning_rate = rl_learning_rate(optim, total_rollouts * config.lag)
        self.peak_flops = (peak_flops if peak_flops is not None
                           else step_metrics.peak_flops(list(self.trainer_mesh.devices.flat)))
        self._n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
            self.fns.abstract_params()))
        self._timing = {"generate": 0.0, "reward": 0.0}

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
    def old_stats_fn(self) -> Any:
        """The jitted pi_old statistics ``(params, ref_params, mb) -> OldStats`` (trainer mesh)."""
        return self._old_stats

    @property
    def update_fn(self) -> Any:
        """The jitted update ``(policy, mb, old, *, key) -> (policy, metrics)`` (trainer mesh;
        donates ``policy``)."""
        return self._update

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
        dynamic sampling): a pure function of (seed, rollout, gen_batch).

        A task with ``prompts_at`` (a seeded epoch-ordered stream) gives generation batch 0
        the positions ``[r * n, (r + 1) * n)`` of the stream seeded by ``seed`` (n =
        prompts per generation batch), so the position is the checkpointed rollout counter;
        batch g > 0 the same positions of the stream seeded by (seed, g)."""
        n = self.config.prompts_per_gen_batch
        if hasattr(self.task, "prompts_at"):
            seed = self.seed if gen_batch == 0 else int(
                np.random.SeedSequence([self.seed, gen_batch]).generate_state(1)[0])
            return list(self.task.prompts_at(rollout * n, n, seed))
        extra = [gen_batch] if gen_batch else []  # batch 0: the unfiltered rollout's prompts
        rng = np.random.default_rng([self.seed, rollout, 0x6A7F, *extra])
        return self.task.prompts(rng, self.config.prompts_per_gen_batch)

    def rollout_key(self, state: dict, rollout: int) -> jax.Array:
        """Rollout ``rollout``'s key: ``fold_in(key(seed), rollout)`` from the state's ``rng``,
        replicated on the trainer mesh."""
        return jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), rollout)

    def placed_key(self, key: jax.Array) -> jax.Array:
        """``key`` replicated on the trainer mesh (placed per process: the mesh may span
        processes), as :meth:`rollout_key` gives it."""
        data = np.asarray(jax.random.key_data(key))
        return jax.random.wrap_key_data(put(data, NamedSharding(self.trainer_mesh, PartitionSpec())))

    def _keys(self, state: dict, rollout: int, key: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
        key = self.rollout_key(state, rollout) if key is None else key
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
        start = time.perf_counter()
        batch = self.sampler.generate(params, self.rollout_prompts(rollout, gen_batch), key,
                                      version=version, replica=self._replica_to_follow())
        reward_s = float(getattr(self.sampler, "last_reward_s", 0.0))
        self._timing["generate"] += time.perf_counter() - start - reward_s
        self._timing["reward"] += reward_s
        scores = batch.rewards
        buffer = self.config.overlong_buffer
        if buffer is not None:
            penalty = np.asarray(overlong_penalty(batch.mask.sum(axis=1),
                                                  self.config.max_new_tokens, buffer.len,
                                                  buffer.penalty_factor))
            batch = batch._replace(rewards=(scores + penalty).astype(np.float32))
        return batch, scores

    def generate_with_stats(self, state: dict, *, key: jax.Array | None = None
                            ) -> tuple[RolloutBatch, dict[str, float]]:
        """This step's rollout, sampled with :meth:`rollout_params` (``key``: the rollout's
        key, default :meth:`rollout_key`), and host statistics:
        ``critic/score/mean`` (task score before shaping) and, with filter_groups,
        ``batch/num_gen_batches`` and ``batch/kept_group_fraction`` (groups with signal /
        generated)."""
        rollout = int(state["rollout"])
        sample_key, _ = self._keys(state, rollout, key)
        params = self.rollout_params(state)
        version = int(np.asarray(state["published_version"])[0])
        cfg = self.config
        if not cfg.filter_groups:
            batch, scores = self._generation_batch(params, rollout, 0, sample_key, version)
            return batch, {"critic/score/mean": float(np.mean(scores))}
        scores_of = {}

        def generate(i):
            batch, scores = self._generation_batch(params, rollout, i, sample_key, version)
            scores_of[i] = scores
            return batch, scores if cfg.filter_groups_metric == "acc" else batch.rewards

        batch, fill = fill_groups(generate, num_groups=cfg.prompts_per_rollout,
                                  group_size=cfg.group_size,
                                  max_num_gen_batches=cfg.max_num_gen_batches)
        all_scores = np.concatenate([scores_of[i] for i in sorted(scores_of)])
        return batch, {"critic/score/mean": float(np.mean(all_scores)),
                       "batch/num_gen_batches": float(fill["num_gen_batches"]),
                       "batch/kept_group_fraction": fill["groups_with_signal"]
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
        fields = dict(zip(MiniBatch._fields, (batch.prompts, batch.prompt_lengths, batch.tokens, batch.mask,
                                              batch.behaviour_logp, adv.astype(np.float32))))
        if self.config.loss.sis_proposal == "behaviour":  # sis_b: the sampler's top-K, sharded as the rows
            fields.update(zip(MiniBatch._fields[6:8], batch.behaviour_topk("correction 'sis_b'")))
        if self.config.routing_replay != "off":  # R3: the sampler's experts per position
            fields["routing"] = batch.routing_record(f"routing_replay={self.config.routing_replay!r}")
        return [MiniBatch(**{f: put(x[j * size:(j + 1) * size], sharding) for f, x in fields.items()})
                for j in range(self.config.lag)]

    def train_on_rollout(self, state: dict, batch: RolloutBatch, *, key: jax.Array | None = None
                         ) -> tuple[dict, list[dict], SyncRecord | None]:
        """Old stats for every mini-batch at the current params (none when
        ``config.old_from_update``: the update's own forward gives them), then N updates, then
        publish.

        Returns the new state, one metrics dict (device scalars) per mini-batch, and what the
        publish sent through the weight sync (its ``SyncRecord``; None with sync off or when
        this rollout was not due to sync). Host seconds of the updates and of the publish are
        in ``self._timing`` ("update", "sync").
        """
        start = time.perf_counter()
        rollout = int(state["rollout"])
        _, loss_key = self._keys(state, rollout, key)
        mbs = self.minibatches(batch)
        policy = state["policy"]
        ref = state.get("ref_params")
        olds = ([None] * len(mbs) if self.config.old_from_update
                else [self._old_stats(policy.params, ref, mb) for mb in mbs])
        keys = jax.random.split(loss_key, len(mbs))
        history = []
        for mb, old, key in zip(mbs, olds, keys):
            policy, metrics = self._update(policy, mb, old, key=key)
            history.append(metrics)
        jax.block_until_ready((policy, history))
        published = time.perf_counter()
        self._timing["update"] = published - start
        new = dict(state)
        new["policy"] = policy
        new["published"], new["published_version"], sent = self.publisher.publish(
            state["published"], state["published_version"], self.published_tree(policy.params),
            policy.step,
            rollout=rollout, origin=state["published_origin"])
        new["rollout"] = state["rollout"] + 1
        jax.block_until_ready(new["published"])
        self._timing["sync"] = time.perf_counter() - published
        return new, history, sent

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        """One rollout + N updates + publish; the step's row (names as verl's,
        :mod:`jaxflow.rl.step_metrics`): ``actor/*`` (the update, ``actor/lr``),
        ``critic/rewards/mean`` (the shaped rewards the advantages use) and
        ``critic/score/mean``, ``response_length/{mean,max,clip_ratio}``, ``version/*``,
        ``timing_s/{generate,reward,update,sync}``, ``perf/{step_s,tokens_per_s,mfu}``; with
        dynamic sampling ``batch/*``; with weight sync ``sync/synced`` (1.0 when this step
        synced) and, when it did, ``sync/payload_bytes``, ``sync/changed_fraction`` and
        ``sync/bit_exact``."""
        state, metrics, _ = self.step_with_sync(state)
        return state, metrics

    def step_with_sync(self, state: dict, *, key: jax.Array | None = None
                       ) -> tuple[dict, dict[str, float], SyncRecord | None]:
        """:meth:`step`, and the ``SyncRecord`` of what its publish sent through the weight sync
        (None with sync off or when this rollout was not due to sync). ``key``: the rollout's
        key (default :meth:`rollout_key`; the sampling and loss keys are split from it)."""
        start = time.perf_counter()
        self._timing = {"generate": 0.0, "reward": 0.0}
        sampler_version = int(state["published_version"][0])
        trainer_version = int(state["policy"].step)
        batch, generation = self.generate_with_stats(state, key=key)
        state, history, sent = self.train_on_rollout(state, batch, key=key)
        metrics = summarize(history, batch, sampler_version, trainer_version)
        metrics["actor/lr"] = float(self.learning_rate(trainer_version))
        metrics.update(version_metrics(batch))
        metrics.update(generation)
        metrics.update(step_metrics.response_length_metrics(
            batch.tokens, batch.mask, self.config.max_new_tokens, stop_ids(self.tokenizer)))
        if self.sync_config is not None:  # did this step sync, and what did it send
            metrics["sync/synced"] = float(sent is not None)
            if sent is not None:
                metrics["sync/payload_bytes"] = float(sent.stats.payload_bytes)
                metrics["sync/changed_fraction"] = sent.stats.changed_fraction
                metrics["sync/bit_exact"] = float(sent.bit_exact)
        metrics.update({f"timing_s/{k}": self._timing[k]
                        for k in ("generate", "reward", "update", "sync")})
        tokens = int(np.asarray(batch.prompt_lengths).sum() + np.asarray(batch.mask).sum())
        metrics.update(step_metrics.perf_metrics(tokens=tokens, n_params=self._n_params,
                                                 step_s=time.perf_counter() - start,
                                                 peak=self.peak_flops))
        return state, metrics, sent

    def heldout_accuracy(self, state: dict, n: int, *, samples: int = 0) -> float:
        """Held-out accuracy of the current trainer params (published fresh): greedy, or
        sampled pass@1 averaged over ``samples`` per prompt (see RolloutWorker)."""
        params = state["policy"].params
        if self.model_cfg.lora.enabled:
            params = lora.merge(params, self.model_cfg.lora)
        params = publish_weights(params, self.worker.param_shardings)
        return self.worker.heldout_accuracy(params, n, samples=samples)
