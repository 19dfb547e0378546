"""GRPO trainer with off-policy knobs: policy lag N, async staleness k, train/inference mismatch.

One RL step = one rollout then N optimizer steps on it:

1. The rollout sub-mesh samples G responses for each of ``prompts_per_rollout`` prompts with
   the weights published k rollouts ago (staleness k; k = 0 is synchronous) and the task
   scores them. The sampler's log-probs are the behaviour log-probs mu (TIS / MIS).
2. Group-normalised advantages over the whole rollout batch.
3. The batch is split into N mini-batches (policy lag N). Before the first update the trainer
   recomputes ``old_logp`` (and pi_old's top-K for SIS, and the frozen reference policy's
   log-probs for KL) with its *current* params, one mini-batch at a time through the same
   log-prob code as the loss, so mini-batch 1 is exactly on-policy (ratio == 1 bit for bit).
4. N optimizer steps, then ``publish_weights`` trainer -> rollout mesh.

Parameter versions: the trainer's version is its optimizer step count. Rollout r samples
with version ``max(0, r - k) * N``; its mini-batch j (0-based) is trained at version
``r * N + j`` against ``old_logp`` of version ``r * N``.

Everything the run needs to continue is one pytree (:meth:`GRPOTrainer.init_state`):
policy params + optimizer state + version, the frozen reference params (when KL is on), the
queue of the last k+1 published weights and their versions, the rollout counter and the RNG
key. Randomness is a pure function of (key, rollout index), so resuming is bit-exact.

Weight sync (``sync=SyncConfig(codec=..., every=E)``, ``--set sync.codec=entropy``; codec
"none" or ``sync=None`` is the plain dense f32 publish above): the trainer owns a
:class:`jaxflow.sync.WeightSync` whose first bf16 replica on the rollout sub-mesh serves the
rollouts. ``every`` counts rollouts: after rollouts E, 2E, ... the trainer publishes its params
through ``publish_weights(..., sync=...)`` as version = its optimizer step (sparse payloads of the
changed bf16 bit patterns); the rollouts in between keep sampling the previous synced version.
Every rollout first goes through the version check (``WeightSync.rollout_params``: a replica
that fell behind is caught up, or VersionMismatch with ``on_mismatch="error"``), and the
sampler gets the replica's bf16 values upcast to f32 (exact), so it samples bit-for-bit the
trainer's bf16 cast at that version whatever its ``mismatch`` knob (``"bf16"`` then computes
in bf16 as well). The queue holds one entry, the replica's bf16 params and version, so it is in
the checkpoint; a trainer given a state it did not produce (a restored checkpoint) rebuilds its
WeightSync from that entry by a dense resync, so resuming stays bit-exact. Async staleness
k > 0 is rejected with sync on (one replica holds one version); policy lag N is supported.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.advantages import grpo_advantages
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.policy_loss import PolicyLossConfig, policy_loss
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.rollout import RolloutBatch, RolloutSpec, RolloutWorker, batch_sharding
from jaxflow.rl.tasks import Task
from jaxflow.sync.replica import Link, VersionMismatch
from jaxflow.sync.weight_sync import SyncConfig, WeightSync
from jaxflow.train.lm_state import LMFunctions, OptimConfig, lm_functions, make_optimizer

KL_ESTIMATORS = ("k1", "k3")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """One RL run's algorithm and off-policy knobs.

    Attributes:
      algo, correction, agg: the :class:`jaxflow.rl.PolicyLossConfig` choices.
      prompts_per_rollout, group_size: a rollout has ``prompts_per_rollout * group_size`` rows.
      temperature: used by the sampler AND the trainer's log-probs (must be the same).
      max_new_tokens: response length cap.
      mismatch: sampler numerics, "none" | "bf16" | "noise<std>" (see jaxflow.rl.rollout).
      lag: N, mini-batches (= optimizer steps) per rollout; must divide the rollout size.
      staleness: k, rollouts sample with the weights published k rollouts earlier.
      kl_coef, kl_estimator: KL(pi_theta || pi_ref) to the frozen initial policy, "k1" or "k3"
        per-token estimator on the sampled tokens; 0 turns it off (no reference kept).
      entropy_coef: bonus on the exact per-token entropy (materialises [B, T, V]; the vocab
        here is tiny).
      sis_topk: K of pi_old's top-K kept for the SIS envelope (vocab size = exact envelope).
      normalize_std: GRPO advantages divided by the group std (False: Dr. GRPO).
      logprob_backend: :func:`jaxflow.rl.logprobs.fused_logprobs` backend.
    """

    algo: str = "grpo"
    correction: str = "none"
    agg: str | None = "token-mean"  # None: the algorithm's default (sa_gcpo: seq-mean-token-mean)
    prompts_per_rollout: int = 8
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 4
    mismatch: str = "none"
    lag: int = 1
    staleness: int = 0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    sis_topk: int = 8
    normalize_std: bool = True
    logprob_backend: str = "xla"

    def __post_init__(self):
        self.loss_config  # validates algo / correction / agg
        self.rollout_spec  # validates group_size / temperature / mismatch
        for name in ("prompts_per_rollout", "lag", "sis_topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: need an int >= 1")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness={self.staleness!r}: need an int >= 0")
        if self.rollout_size % self.lag:
            raise ValueError(f"lag={self.lag} must divide the rollout size prompts_per_rollout * "
                             f"group_size = {self.rollout_size}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}; valid: {KL_ESTIMATORS}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef!r} and entropy_coef={self.entropy_coef!r} "
                             "must be >= 0")

    @property
    def loss_config(self) -> PolicyLossConfig:
        return PolicyLossConfig(algo=self.algo, correction=self.correction, agg=self.agg)

    @property
    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(group_size=self.group_size, temperature=self.temperature,
                           max_new_tokens=self.max_new_tokens, mismatch=self.mismatch)

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_rollout * self.group_size

    @property
    def minibatch_size(self) -> int:
        return self.rollout_size // self.lag


def make_rl_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Constant-lr AdamW with clipping when ``cfg.warmup_steps == 0``; otherwise the
    pretraining warm-up + cosine schedule of :func:`jaxflow.train.lm_state.make_optimizer`."""
    if cfg.warmup_steps > 0:
        return make_optimizer(cfg, total_steps)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


# ----------------------------------------------------------------------------- pure functions


class MiniBatch(NamedTuple):
    """Trainer-side rows: prompts [b, P], prompt_lengths [b], tokens / mask / behaviour_logp
    [b, N], advantages [b]."""

    prompts: jax.Array
    prompt_lengths: jax.Array
    tokens: jax.Array
    mask: jax.Array
    behaviour_logp: jax.Array
    advantages: jax.Array


class OldStats(NamedTuple):
    """pi_old at the start of a rollout's updates: sampled-token log-probs [b, N], top-K
    log-probs and indices [b, N, K], and the reference policy's log-probs [b, N] (zeros when
    KL is off)."""

    logp: jax.Array
    topk_logp: jax.Array
    topk_indices: jax.Array
    ref_logp: jax.Array


def response_hidden(fns: LMFunctions, params: Any, prompts: jax.Array,
                    prompt_lengths: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Final hidden states that predict each response token, and the LM head.

    Row b is ``prompt[:len_b] ++ tokens`` (positions 0.., as the sampler saw it); the hidden
    state at position ``len_b + t - 1`` predicts response token t.

    Returns:
      (hidden [B, N, d], head [d, V]) in the model's compute dtype.
    """
    model = fns.model(params)
    b, p = prompts.shape
    n = tokens.shape[1]
    rows = jnp.arange(b)[:, None]
    slot = prompt_lengths[:, None].astype(jnp.int32) + jnp.arange(n, dtype=jnp.int32)[None]
    seq = jnp.pad(prompts, ((0, 0), (0, n))).at[rows, slot].set(tokens)
    hidden = model.hidden_states(seq[:, :-1])
    hidden = jnp.take_along_axis(hidden, (slot - 1)[..., None], axis=1)
    return hidden, model.head_weight().astype(hidden.dtype)


def old_stats(fns: LMFunctions, params: Any, ref_params: Any | None, mb: MiniBatch, *,
              config: GRPOConfig) -> OldStats:
    """pi_old's (and the reference's) log-probs for one mini-batch; no gradient."""
    hidden, head = response_hidden(fns, params, mb.prompts, mb.prompt_lengths, mb.tokens)
    out = fused_logprobs(hidden, head, mb.tokens, own_topk=min(config.sis_topk, head.shape[1]),
                         temperature=config.temperature, backend=config.logprob_backend)
    ref = jnp.zeros_like(out.target_logp)
    if ref_params is not None:
        rh, rw = response_hidden(fns, ref_params, mb.prompts, mb.prompt_lengths, mb.tokens)
        ref = fused_logprobs(rh, rw, mb.tokens, temperature=config.temperature,
                             backend=config.logprob_backend).target_logp
    return OldStats(out.target_logp, out.own_topk_logp, out.own_topk_indices, ref)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def grpo_loss(params: Any, mb: MiniBatch, old: OldStats, *, fns: LMFunctions,
              config: GRPOConfig, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy loss (+ KL to the reference, - entropy bonus) of one mini-batch, and metrics."""
    hidden, head = response_hidden(fns, params, mb.prompts, mb.prompt_lengths, mb.tokens)
    loss_cfg = config.loss_config
    out = fused_logprobs(hidden, head, mb.tokens,
                         old.topk_indices if loss_cfg.uses_sis else None,
                         temperature=config.temperature, backend=config.logprob_backend)
    logp = out.target_logp
    loss, metrics = policy_loss(
        logp, old.logp, mb.advantages, mb.mask, config=loss_cfg, key=key,
        old_topk_logp=old.topk_logp if loss_cfg.uses_sis else None,
        new_topk_logp=out.topk_logp, behaviour_logp=mb.behaviour_logp)
    metrics = dict(metrics)
    metrics["policy_loss"] = loss
    delta = jax.lax.stop_gradient(logp - old.logp)
    metrics["max_abs_log_ratio"] = jnp.max(jnp.where(mb.mask > 0, jnp.abs(delta), 0.0))
    metrics["behaviour_gap"] = _masked_mean(jnp.abs(old.logp - mb.behaviour_logp), mb.mask)
    if config.kl_coef > 0:
        log_r = old.ref_logp - logp  # log pi_ref / pi_theta on tokens sampled ~ pi
        per_token = -log_r if config.kl_estimator == "k1" else jnp.exp(log_r) - log_r - 1.0
        kl = _masked_mean(per_token, mb.mask)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl
    if config.entropy_coef > 0:
        logits = jnp.einsum("bnd,dv->bnv", hidden, head,
                            preferred_element_type=jnp.float32) / config.temperature
        logq = jax.nn.log_softmax(logits, axis=-1)
        entropy = _masked_mean(-jnp.sum(jnp.exp(logq) * logq, axis=-1), mb.mask)
        loss = loss - config.entropy_coef * entropy
        metrics["entropy"] = entropy
    metrics["loss"] = loss
    return loss, metrics


def update_step(policy: dict, mb: MiniBatch, old: OldStats, *, fns: LMFunctions,
                config: GRPOConfig, tx: optax.GradientTransformation,
                key: jax.Array) -> tuple[dict, dict[str, jax.Array]]:
    """One optimizer step: ``(policy, mini-batch, old stats, key) -> (policy, metrics)``."""
    grads, metrics = jax.grad(grpo_loss, has_aux=True)(policy["params"], mb, old, fns=fns,
                                                        config=config, key=key)
    updates, opt_state = tx.update(grads, policy["opt_state"], policy["params"])
    metrics["grad_norm"] = optax.tree.norm(grads)
    return {"params": optax.apply_updates(policy["params"], updates), "opt_state": opt_state,
            "step": policy["step"] + 1}, metrics


# ----------------------------------------------------------------------------- orchestration


@functools.lru_cache(maxsize=64)
def _compiled(model_cfg: TransformerConfig, mesh: Mesh, config: GRPOConfig, optim: OptimConfig,
              total_steps: int):
    """(fns, tx, policy shardings, jitted old_stats, jitted update) shared by equal configs,
    so the cells of a sweep reuse compilations."""
    fns = lm_functions(model_cfg, mesh)
    tx = make_rl_optimizer(optim, total_steps)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), fns_abstract_params(fns)))
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, fns.param_shardings,
                                          transform_non_params=lambda _: replicated)
    shardings = {"params": fns.param_shardings, "opt_state": opt_shardings, "step": replicated}
    old_fn = jax.jit(functools.partial(old_stats, fns, config=config))
    update = jax.jit(functools.partial(update_step, fns=fns, config=config, tx=tx),
                     out_shardings=(shardings, None), donate_argnums=(0,))
    return fns, tx, shardings, old_fn, update


def fns_abstract_params(fns: LMFunctions) -> Any:
    """Pure-dict ShapeDtypeStructs of the params (with their trainer shardings)."""
    pure = nnx.to_pure_dict(fns.abstract_state)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        pure, fns.param_shardings)


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
      sync: weight sync to bf16 rollout replicas (module doc); None or codec "none": the
        dense f32 publish.
      sync_links: extra links (e.g. TCP replica processes) that receive every sync too.
    """

    def __init__(self, model_cfg: TransformerConfig, config: GRPOConfig, optim: OptimConfig,
                 task: Task, tokenizer: CharTokenizer, meshes: dict[str, Mesh], *, seed: int,
                 total_rollouts: int = 100, sync: SyncConfig | None = None,
                 sync_links: Sequence[Link] = ()):
        self.model_cfg, self.config, self.optim, self.seed = model_cfg, config, optim, seed
        self.task, self.tokenizer = task, tokenizer
        self.sync_config = sync if sync is not None and sync.enabled else None
        if self.sync_config is not None and config.staleness:
            raise ValueError(
                f"sync.codec={sync.codec!r} with staleness={config.staleness}: the synced "
                "rollout replica holds one version, so async staleness k > 0 is not supported "
                f"with weight sync; use staleness=0 (sync.every={sync.every} already delays "
                "the sampler's weights by whole rollouts) or sync.codec='none'")
        if sync_links and self.sync_config is None:
            raise ValueError("sync_links given but weight sync is off (sync.codec='none')")
        self._sync_links = tuple(sync_links)
        self._weight_sync: WeightSync | None = None
        self._synced_leaves: list | None = None  # the published tree this trainer last handed out
        self.trainer_mesh, self.rollout_mesh = meshes["trainer"], meshes["rollout"]
        (self.fns, self.tx, self.shardings, self._old_stats,
         self._update) = _compiled(model_cfg, self.trainer_mesh, config, optim,
                                   total_rollouts * config.lag)
        self.worker = RolloutWorker(model_cfg, self.rollout_mesh, config.rollout_spec, task,
                                    tokenizer)

    @property
    def weight_sync(self) -> WeightSync | None:
        """The WeightSync serving the rollouts (None with sync off or before ``init_state``)."""
        return self._weight_sync

    # -- state ---------------------------------------------------------------------------

    def init_state(self, params: Any) -> dict:
        """The whole RL state, starting from ``params`` (trainer-mesh pure dict, e.g. a warm
        start). The reference policy (KL) is a frozen copy of ``params``."""
        params = jax.device_put(params, self.fns.param_shardings)
        opt_state = jax.jit(self.tx.init, out_shardings=self.shardings["opt_state"])(params)
        replicated = NamedSharding(self.trainer_mesh, PartitionSpec())
        policy = {"params": jax.tree.map(jnp.copy, params), "opt_state": opt_state,
                  "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
        k = self.config.staleness
        if self.sync_config is None:
            # the queue of the last k+1 published weights (oldest first), all version 0 now
            published = tuple(publish_weights(policy["params"], self.worker.param_shardings)
                              for _ in range(k + 1))
        else:  # the serving replica's bf16 params (k == 0)
            self._weight_sync = WeightSync(policy["params"], self.worker.param_shardings,
                                           self.sync_config, version=0, links=self._sync_links)
            if self._sync_links:  # extra links (replica processes) start fresh
                self._weight_sync.catch_up()
            published = (self._weight_sync.rollout_params(),)
            self._synced_leaves = jax.tree.leaves(published[0])
        state = {
            "policy": policy,
            "published": published,
            "published_version": jax.device_put(jnp.zeros((k + 1,), jnp.int32), replicated),
            "rollout": jax.device_put(jnp.zeros((), jnp.int32), replicated),
            "rng": jax.device_put(jax.random.key_data(jax.random.key(self.seed)), replicated),
        }
        if self.config.kl_coef > 0:
            state["ref_params"] = params
        return state

    # -- one RL step ---------------------------------------------------------------------

    def rollout_prompts(self, rollout: int) -> list[str]:
        """The prompts of rollout ``rollout``: a pure function of (seed, rollout)."""
        rng = np.random.default_rng([self.seed, rollout, 0x6A7F])
        return self.task.prompts(rng, self.config.prompts_per_rollout)

    def _keys(self, state: dict, rollout: int) -> tuple[jax.Array, jax.Array]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), rollout)
        sample_key, loss_key = jax.random.split(key)
        return sample_key, loss_key

    def _sync_for(self, state: dict) -> WeightSync:
        """This trainer's WeightSync at ``state``'s published version; rebuilt (a dense resync
        of fresh replicas from the state's bf16 rollout params) when ``state`` is not the one
        this trainer last published into, e.g. a restored checkpoint."""
        leaves = jax.tree.leaves(state["published"][0])
        known = self._synced_leaves
        if (known is None or len(known) != len(leaves)
                or any(a is not b for a, b in zip(known, leaves))):
            self._weight_sync = WeightSync.resume(
                state["published"][0], self.worker.param_shardings, self.sync_config,
                version=int(state["published_version"][0]), links=self._sync_links)
            self._synced_leaves = leaves
        return self._weight_sync

    def rollout_params(self, state: dict) -> Any:
        """The params this step's rollout samples with (on the rollout mesh): the oldest
        queued published weights; with weight sync, the serving replica's bf16 params after
        the version check, upcast to f32 (exact)."""
        if self.sync_config is None:
            return state["published"][0]
        ws = self._sync_for(state)
        bf16 = ws.rollout_params()  # the per-rollout version check (catch-up or error)
        expected = int(state["published_version"][0])
        if ws.replicas[0].version != expected:
            raise VersionMismatch(f"rollout replica is at version {ws.replicas[0].version}, "
                                  f"the state's published version is {expected}")
        return jax.tree.map(
            lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            bf16)

    def generate(self, state: dict) -> RolloutBatch:
        """This step's rollout, sampled with :meth:`rollout_params`."""
        rollout = int(state["rollout"])
        sample_key, _ = self._keys(state, rollout)
        return self.worker.generate(self.rollout_params(state), self.rollout_prompts(rollout),
                                    sample_key)

    def minibatches(self, batch: RolloutBatch) -> list[MiniBatch]:
        """Advantages over the whole rollout, then N contiguous mini-batches on the trainer."""
        adv = np.asarray(grpo_advantages(jnp.asarray(batch.rewards), self.config.group_size,
                                         normalize_std=self.config.normalize_std))
        size = self.config.minibatch_size
        sharding = batch_sharding(self.trainer_mesh, size)
        out = []
        for j in range(self.config.lag):
            rows = slice(j * size, (j + 1) * size)
            out.append(MiniBatch(*(jax.device_put(x[rows], sharding) for x in (
                batch.prompts, batch.prompt_lengths, batch.tokens, batch.mask,
                batch.behaviour_logp, adv.astype(np.float32)))))
        return out

    def train_on_rollout(self, state: dict, batch: RolloutBatch) -> tuple[dict, list[dict]]:
        """Old stats for every mini-batch at the current params, then N updates, then publish.

        Returns the new state and one metrics dict (device scalars) per mini-batch.
        """
        rollout = int(state["rollout"])
        _, loss_key = self._keys(state, rollout)
        mbs = self.minibatches(batch)
        policy = state["policy"]
        ref = state.get("ref_params")
        olds = [self._old_stats(policy["params"], ref, mb) for mb in mbs]
        keys = jax.random.split(loss_key, len(mbs))
        history = []
        for mb, old, key in zip(mbs, olds, keys):
            policy, metrics = self._update(policy, mb, old, key=key)
            history.append(metrics)
        new = dict(state)
        new["policy"] = policy
        if self.sync_config is None:
            published = publish_weights(policy["params"], self.worker.param_shardings)
            new["published"] = tuple(state["published"][1:]) + (published,)
            new["published_version"] = jnp.concatenate(
                [state["published_version"][1:], policy["step"][None]])
        else:
            ws = self._sync_for(state)
            if ws.due(rollout + 1):  # ``every`` counts rollouts
                published = publish_weights(policy["params"], self.worker.param_shardings,
                                            sync=ws, version=int(policy["step"]))
                new["published"] = (published,)
                new["published_version"] = policy["step"][None]
            self._synced_leaves = jax.tree.leaves(new["published"][0])
        new["rollout"] = state["rollout"] + 1
        return new, history

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        """One rollout + N updates + publish; host metrics of the step. With weight sync also
        ``synced`` (1.0 when this step synced) and, when it did, ``sync_payload_bytes``,
        ``sync_changed_fraction`` and ``sync_bit_exact``."""
        sampler_version = int(state["published_version"][0])
        trainer_version = int(state["policy"]["step"])
        batch = self.generate(state)
        ws = self._weight_sync  # the sync serving ``state`` (generate rebuilt it if needed)
        n_records = len(ws.records) if ws is not None else 0
        state, history = self.train_on_rollout(state, batch)
        metrics = summarize(history, batch, sampler_version, trainer_version)
        if self.sync_config is not None:  # did this step sync, and what did it send
            synced = len(ws.records) > n_records
            metrics["synced"] = float(synced)
            if synced:
                record = ws.records[-1]
                metrics["sync_payload_bytes"] = float(record.stats.payload_bytes)
                metrics["sync_changed_fraction"] = record.stats.changed_fraction
                metrics["sync_bit_exact"] = float(record.bit_exact)
        return state, metrics

    def heldout_accuracy(self, state: dict, n: int, *, samples: int = 0) -> float:
        """Held-out accuracy of the current trainer params (published fresh): greedy, or
        sampled pass@1 averaged over ``samples`` per prompt (see RolloutWorker)."""
        params = publish_weights(state["policy"]["params"], self.worker.param_shardings)
        return self.worker.heldout_accuracy(params, n, samples=samples)


def summarize(history: list[dict], batch: RolloutBatch, sampler_version: int,
              trainer_version: int) -> dict[str, float]:
    """Host floats: reward, lengths, per-step loss metrics averaged over mini-batches, and the
    first mini-batch's accept rate / max |log ratio| separately (it must be on-policy)."""
    rows = jax.device_get(history)
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    out["accept_rate_first"] = float(rows[0]["accept_rate"])
    out["max_abs_log_ratio_first"] = float(rows[0]["max_abs_log_ratio"])
    if len(rows) > 1:
        out["accept_rate_later"] = float(np.mean([r["accept_rate"] for r in rows[1:]]))
    out["reward_mean"] = float(batch.rewards.mean())
    out["response_length"] = float(batch.mask.sum(axis=1).mean())
    out["sampler_version"] = sampler_version
    out["trainer_version"] = trainer_version
    return out
