"""The pure half of GRPO: config, mini-batches, pi_old statistics, the loss and one update.

Everything here is a function of arrays and pytrees (``(policy, mini-batch, old stats, key) ->
(policy, metrics)``, the policy a :class:`jaxflow.train.state.TrainState`);
:class:`jaxflow.rl.grpo.GRPOTrainer` composes it with rollouts and publishing, and the
multi-agent pipeline (``jaxflow.marl``) reuses it per agent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxflow.config_domains import COUNT, COUNT0, INT32_MAX, NON_NEGATIVE, POSITIVE, Int, domains
from jaxflow.models.lora import LoraConfig
from jaxflow.models.moe import routing_disagreement
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl import sis
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.masks import as_bool_mask
from jaxflow.rl.mismatch_metrics import mismatch_metrics
from jaxflow.rl.policy_loss import PolicyLossConfig, correction_mask, policy_loss
from jaxflow.rl.reward_shaping import OverlongBufferConfig
from jaxflow.rl.rollout import EngineSettings, RolloutBatch, RolloutSpec
from jaxflow.rl.step_metrics import update_rows
from jaxflow.train.lm_state import LMFunctions, OptimConfig, make_optimizer

KL_ESTIMATORS = ("k1", "k3")
ROUTING_REPLAY = ("off", "record", "replay")
FILTER_METRICS = ("acc", "seq_reward")


@domains(prompts_per_rollout=COUNT, group_size=COUNT, temperature=POSITIVE, max_new_tokens=COUNT, lag=COUNT,
         staleness=COUNT0, kl_coef=NON_NEGATIVE, entropy_coef=NON_NEGATIVE, sis_topk=COUNT,
         gen_batch_size=COUNT, microbatches=COUNT,
         max_num_gen_batches=Int(-INT32_MAX))  # <= 0: no limit
@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """One RL run's algorithm and off-policy knobs.

    Attributes:
      loss: the :class:`jaxflow.rl.PolicyLossConfig` (algorithm, correction, aggregation, clip
        ranges, dual clip, TIS / MIS bounds): every knob settable as ``--set rl.loss.X=...``.
      prompts_per_rollout, group_size: a rollout has ``prompts_per_rollout * group_size`` rows.
      temperature: used by the sampler AND the trainer's log-probs (must be the same).
      max_new_tokens: response length cap.
      mismatch: sampler numerics, "none" | "bf16" | "noise<std>" (see jaxflow.rl.rollout).
      sampler: "static" | "static_per_row" | "engine" (:data:`jaxflow.rl.rollout.SAMPLERS`;
        "engine" samples through :class:`jaxflow.rollout.RolloutEngine`, ``engine`` its shapes).
      lag: N, mini-batches (= optimizer steps) per rollout; must divide the rollout size.
      microbatches: M, gradient accumulation inside each update (``--set rl.microbatches=M``):
        the mini-batch's rows go through the loss in M micro-batches (one ``lax.scan``: the
        activations of one micro-batch at a time), each gradient weighted by its share of the
        loss normaliser, and one optimizer step (:func:`jaxflow.rl.update.accumulated_update_step`). Must divide
        the mini-batch rows. 1 (default): :func:`jaxflow.rl.update.update_step`, the whole mini-batch at once.
        M > 1 refuses what cannot be split exactly: a correction whose mask is a statistic of
        the whole batch (M2PO) and a ``seq-mean-*`` aggregation with a KL or entropy term
        (their token means have another normaliser than the sequence mean). The gradient is
        exact; of the metrics, token means are exact and quantiles (``ratio_p99`` and the
        like) and ``moe/router_disagreement`` are the weighted means of the micro-batches'
        values, not the whole mini-batch's.
      staleness: k, rollouts sample with the weights published k rollouts earlier.
      kl_coef, kl_estimator: KL(pi_theta || pi_ref) to the frozen initial policy, "k1" or "k3"
        per-token estimator on the sampled tokens; 0 turns it off (no reference kept).
      entropy_coef: bonus on the exact per-token entropy (materialises [B, T, V]; the vocab
        here is tiny).
      sis_topk: K of pi_old's top-K kept for the SIS envelope (vocab size = exact envelope);
        with ``loss.correction="sis_b"`` the K of the behaviour policy's top-K the sampler
        records (capped at the vocab size).
      sis_diagnostics: also log ``sis_accept_expected``, the probability SIS would accept a
        token, min(1, w / M) (1 where log_w == 0), averaged over the response tokens, whatever
        the correction (an uncorrected run reports the accept rate SIS would have had). Costs
        one more top-K gather per mini-batch; training is unchanged.
      normalize_std: GRPO advantages divided by the group std (False: Dr. GRPO).
      logprob_backend: :func:`jaxflow.rl.logprobs.fused_logprobs` backend.
      filter_groups: DAPO's dynamic sampling (:mod:`jaxflow.rl.dynamic_sampling`, verl's
        ``algorithm.filter_groups.enable``): groups whose ``filter_groups_metric`` is equal
        for all G responses are dropped and further generation batches refill the rollout.
      filter_groups_metric: "acc" (the task score, before overlong shaping; verl's DAPO
        recipe) or "seq_reward" (the reward the advantages use, after shaping).
      max_num_gen_batches: generation batches per rollout before dynamic sampling gives up
        with an error; <= 0 means no limit (verl's default 0; here 10, the DAPO recipe's
        value, so a task with no signal fails instead of looping forever).
      gen_batch_size: prompts per generation batch with filter_groups (verl's
        ``data.gen_batch_size``); None = prompts_per_rollout.
      overlong_buffer: DAPO's overlong reward shaping (:mod:`jaxflow.rl.reward_shaping`,
        verl's ``reward_model.overlong_buffer``) against ``max_new_tokens``; None = off.
        ``--set rl.overlong_buffer.len=2`` switches it on.
      truncated_reward: "zero" (a response that hit ``max_new_tokens`` without an EOS scores 0)
        or "score" (it is decoded and scored like the others, as verl does);
        :func:`jaxflow.rl.tasks.score_with_truncation`.
      reuse_forward: when pi_old is the current policy and nothing else needs pi_old
        (:attr:`old_from_update`: lag 1, no SIS top-K, no SIS diagnostics, no KL reference),
        the old log-probs are the stop-gradient of the update's own forward (ratio == 1
        exactly) instead of a separate pi_old forward; False always runs that forward.
      routing_replay: R3 for MoE models (:mod:`jaxflow.models.moe`): "off"; "record" (the
        sampler records each MoE layer's experts per position, the trainer routes anew and logs
        ``moe/router_disagreement``: the share of (position, layer) whose top-k set differs from
        the sampler's); "replay" (the trainer's forwards, pi_old's and the update's, replay the
        sampler's experts, gates from the trainer's router; the metric is then its own routers'
        disagreement with the replayed choice).
      lora: low-rank adapters trained over the frozen policy (``--set rl.lora.rank=8``;
        :mod:`jaxflow.models.lora`): the warm start's weights stay frozen, fresh adapters
        (B = 0: step 0 is the warm start) are the only trainable params, and the sampler gets
        the merged weights (``lora.publish``: adapters merged on the rollout side, or merged
        on the trainer). Rank 0 (default): full fine-tuning, or the model config's own LoRA.
    """

    loss: PolicyLossConfig = PolicyLossConfig()
    prompts_per_rollout: int = 8
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 4
    mismatch: str = "none"
    sampler: str = "static"
    engine: EngineSettings = EngineSettings()
    lag: int = 1
    staleness: int = 0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    sis_topk: int = 8
    sis_diagnostics: bool = False
    normalize_std: bool = True
    logprob_backend: str = "auto"
    filter_groups: bool = False
    filter_groups_metric: str = "acc"
    max_num_gen_batches: int = 10
    gen_batch_size: int | None = None
    overlong_buffer: OverlongBufferConfig | None = None
    truncated_reward: str = "zero"
    reuse_forward: bool = True
    routing_replay: str = "off"
    lora: LoraConfig = LoraConfig()
    microbatches: int = 1

    def __post_init__(self):
        if not isinstance(self.loss, PolicyLossConfig):
            raise ValueError(f"loss={self.loss!r}: need a PolicyLossConfig")
        _ = self.rollout_spec  # validates group_size / temperature / mismatch
        for name in ("prompts_per_rollout", "lag", "sis_topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: need an int >= 1")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness={self.staleness!r}: need an int >= 0")
        if self.rollout_size % self.lag:
            raise ValueError(f"lag={self.lag} must divide the rollout size prompts_per_rollout * "
                             f"group_size = {self.rollout_size}")
        self._check_microbatches()
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"routing_replay={self.routing_replay!r}; valid: {ROUTING_REPLAY}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}; valid: {KL_ESTIMATORS}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef!r} and entropy_coef={self.entropy_coef!r} "
                             "must be >= 0")
        if self.filter_groups_metric not in FILTER_METRICS:
            raise ValueError(f"filter_groups_metric={self.filter_groups_metric!r}; valid: "
                             f"{FILTER_METRICS}")
        if not isinstance(self.max_num_gen_batches, int):
            raise ValueError(f"max_num_gen_batches={self.max_num_gen_batches!r}: need an int "
                             "(<= 0 for no limit)")
        if self.gen_batch_size is not None:
            if not self.filter_groups:
                raise ValueError(f"gen_batch_size={self.gen_batch_size!r} applies with "
                                 "filter_groups=True (dynamic sampling) only")
            if not isinstance(self.gen_batch_size, int) or self.gen_batch_size < 1:
                raise ValueError(f"gen_batch_size={self.gen_batch_size!r}: need an int >= 1 "
                                 "or None")
        if self.overlong_buffer is not None:
            if not isinstance(self.overlong_buffer, OverlongBufferConfig):
                raise ValueError(f"overlong_buffer={self.overlong_buffer!r}: need an "
                                 "OverlongBufferConfig or None")
            if self.overlong_buffer.len > self.max_new_tokens:
                raise ValueError(f"overlong_buffer.len={self.overlong_buffer.len} exceeds "
                                 f"max_new_tokens={self.max_new_tokens} (the response cap)")

    def _check_microbatches(self) -> None:
        m = self.microbatches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1 or self.minibatch_size % m:
            valid = [k for k in range(1, self.minibatch_size + 1) if self.minibatch_size % k == 0]
            raise ValueError(f"microbatches={m!r}: need an int >= 1 dividing the mini-batch's "
                             f"{self.minibatch_size} rows (prompts_per_rollout * group_size / lag); "
                             f"valid: {valid}")
        if m == 1:
            return
        if self.loss.batch_statistic is not None:
            raise ValueError(f"microbatches={m} with loss.correction={self.loss.correction!r}: its "
                             "mask is a statistic of the whole mini-batch, which micro-batches cannot "
                             "split exactly; use microbatches=1 or another correction")
        if self.loss.aggregation != "token-mean" and (self.kl_coef > 0 or self.entropy_coef > 0):
            raise ValueError(f"microbatches={m} with loss.agg={self.loss.aggregation!r} and kl_coef="
                             f"{self.kl_coef!r} / entropy_coef={self.entropy_coef!r}: the KL / "
                             "entropy token means and the sequence-mean loss have different "
                             "normalisers, so one weight per micro-batch is not exact; use "
                             "microbatches=1, agg='token-mean' or no KL / entropy term")

    @property
    def rollout_spec(self) -> RolloutSpec:
        """The rollout settings of this config (group size, temperature, max new tokens, mismatch)."""
        return RolloutSpec(group_size=self.group_size, temperature=self.temperature,
                           max_new_tokens=self.max_new_tokens, mismatch=self.mismatch,
                           sampler=self.sampler, engine=self.engine,
                           truncated_reward=self.truncated_reward,
                           behaviour_topk=self.sis_topk if self.loss.sis_proposal == "behaviour" else 0,
                           record_routing=self.routing_replay != "off")

    @property
    def old_from_update(self) -> bool:
        """True when the update takes pi_old's log-probs from its own forward
        (``reuse_forward`` and pi_old needed for nothing else: lag 1, no SIS correction or
        diagnostics, no KL reference)."""
        return (self.reuse_forward and self.lag == 1 and not self.loss.uses_sis
                and not self.sis_diagnostics and self.kl_coef == 0)

    @property
    def rollout_size(self) -> int:
        """Responses per rollout: prompts x group size."""
        return self.prompts_per_rollout * self.group_size

    @property
    def minibatch_size(self) -> int:
        """Responses per update: the rollout split into ``lag`` minibatches."""
        return self.rollout_size // self.lag

    @property
    def prompts_per_gen_batch(self) -> int:
        """Prompts per generation batch (dynamic sampling may draw several per rollout)."""
        return self.gen_batch_size or self.prompts_per_rollout


def policy_config(model_cfg: TransformerConfig, config: GRPOConfig) -> TransformerConfig:
    """The trained policy's architecture: ``model_cfg`` with ``config.lora`` when that is on
    (ValueError when both set different adapters)."""
    if not config.lora.enabled:
        return model_cfg
    if model_cfg.lora.enabled and model_cfg.lora != config.lora:
        raise ValueError(f"rl.lora={config.lora!r} and the model's own lora={model_cfg.lora!r} "
                         "differ; set one of them")
    return dataclasses.replace(model_cfg, lora=config.lora)


def rl_learning_rate(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate of :func:`make_rl_optimizer` at each optimizer step: ``cfg.lr`` when
    ``cfg.warmup_steps == 0``, else the warm-up + cosine schedule of
    :func:`jaxflow.train.lm_state.make_optimizer` (the same arguments)."""
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(cfg.lr)
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup_steps, 1), max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.final_lr_fraction)


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
    [b, N], advantages [b]; with ``sis_b`` the behaviour policy's top-K log-probs and ids
    [b, N, K] (:class:`jaxflow.rl.rollout.RolloutBatch`), None otherwise; with routing replay
    the sampler's expert ids [b, P + N - 1, L, k] (``routing``), None otherwise."""

    prompts: jax.Array
    prompt_lengths: jax.Array
    tokens: jax.Array
    mask: jax.Array
    behaviour_logp: jax.Array
    advantages: jax.Array
    behaviour_topk_logp: jax.Array | None = None
    behaviour_topk_ids: jax.Array | None = None
    routing: jax.Array | None = None


class OldStats(NamedTuple):
    """pi_old at the start of a rollout's updates: sampled-token log-probs [b, N], top-K
    log-probs and indices [b, N, K], and the reference policy's log-probs [b, N] (zeros when
    KL is off)."""

    logp: jax.Array
    topk_logp: jax.Array
    topk_indices: jax.Array
    ref_logp: jax.Array


def response_hidden(fns: LMFunctions, params: Any, prompts: jax.Array,
                    prompt_lengths: jax.Array, tokens: jax.Array, routing: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """Final hidden states that predict each response token, and the LM head.

    Row b is ``prompt[:len_b] ++ tokens`` (positions 0.., as the sampler saw it); the hidden
    state at position ``len_b + t - 1`` predicts response token t. ``routing`` [B, P + N - 1,
    L, k]: the MoE layers replay these experts (R3, :func:`routed_response_hidden`).

    Returns:
      (hidden [B, N, d], head [d, V]) in the model's compute dtype.
    """
    return routed_response_hidden(fns, params, prompts, prompt_lengths, tokens, routing)[:2]


def routed_response_hidden(fns: LMFunctions, params: Any, prompts: jax.Array, prompt_lengths: jax.Array,
                           tokens: jax.Array, routing: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """:func:`response_hidden` and the forward's own top-k experts [B, P + N - 1, L, k] int32
    (its routers' choice, whatever it replayed; None for a dense model)."""
    model = fns.model(params)
    b, p = prompts.shape
    n = tokens.shape[1]
    rows = jnp.arange(b)[:, None]
    slot = prompt_lengths[:, None].astype(jnp.int32) + jnp.arange(n, dtype=jnp.int32)[None]
    seq = jnp.pad(prompts, ((0, 0), (0, n))).at[rows, slot].set(tokens)
    hidden, stats = model.hidden_states_with_aux(seq[:, :-1], routing=routing)
    hidden = jnp.take_along_axis(hidden, (slot - 1)[..., None], axis=1)
    k = model.config.n_experts_per_token
    own = (jnp.stack([jax.lax.top_k(s.router_logits, k)[1].reshape(b, p + n - 1, k) for s in stats], axis=2)
           if stats else None)
    return hidden, model.head_weight().astype(hidden.dtype), own


def router_disagreement(own: jax.Array, recorded: jax.Array, prompt_lengths: jax.Array,
                        mask: jax.Array) -> jax.Array:
    """Share of (position, MoE layer) whose top-k expert set differs between the trainer's
    routers (``own``) and the sampler's record, over the positions the forward feeds real
    tokens (``< len_b + response_len_b - 1``). own, recorded: [B, S, L, k]; mask [B, N]."""
    end = prompt_lengths.astype(jnp.int32) + jnp.sum(as_bool_mask(mask), axis=1).astype(jnp.int32) - 1
    valid = jnp.arange(own.shape[1])[None] < end[:, None]
    return routing_disagreement(own, recorded, valid[..., None])


def old_stats(fns: LMFunctions, params: Any, ref_params: Any | None, mb: MiniBatch, *,
              config: GRPOConfig) -> OldStats:
    """pi_old's (and the reference's) log-probs for one mini-batch; no gradient (replaying the
    sampler's routing with ``routing_replay="replay"``)."""
    hidden, head = response_hidden(fns, params, mb.prompts, mb.prompt_lengths, mb.tokens,
                                   mb.routing if config.routing_replay == "replay" else None)
    out = fused_logprobs(hidden, head, mb.tokens, own_topk=min(config.sis_topk, head.shape[1]),
                         temperature=config.temperature, backend=config.logprob_backend)
    ref = jnp.zeros_like(out.target_logp)
    if ref_params is not None:
        rh, rw = response_hidden(fns, ref_params, mb.prompts, mb.prompt_lengths, mb.tokens)
        ref = fused_logprobs(rh, rw, mb.tokens, temperature=config.temperature,
                             backend=config.logprob_backend).target_logp
    return OldStats(out.target_logp, out.own_topk_logp, out.own_topk_indices, ref)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    keep = as_bool_mask(mask)
    return jnp.sum(jnp.where(keep, x, 0.0)) / jnp.maximum(jnp.sum(keep), 1.0)


def _expected_sis_accept(hidden: jax.Array, head: jax.Array, mb: MiniBatch, old: OldStats,
                         config: GRPOConfig, given: jax.Array) -> jax.Array:
    """Token mean of min(1, w / M) (1 where log_w == 0): the probability that SIS accepts each
    response token, from the current policy's log-probs at pi_old's top-K (no gradient)."""
    hidden, head = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(head)
    out = fused_logprobs(hidden, head, mb.tokens, old.topk_indices,
                         temperature=config.temperature, backend=config.logprob_backend)
    clip = config.loss.log_ratio_clip
    log_w = sis.clipped_log_ratio(jnp.where(given, out.target_logp, 0.0),
                                  jnp.where(given, old.logp, 0.0), clip)
    log_m = sis.sis_log_envelope(log_w, jnp.where(given[..., None], out.topk_logp, 0.0),
                                 jnp.where(given[..., None], old.topk_logp, 0.0), clip)
    prob = jnp.where(log_w == 0, 1.0, jnp.exp(jnp.minimum(log_w - log_m, 0.0)))
    return _masked_mean(prob, given)


def grpo_loss(params: Any, mb: MiniBatch, old: OldStats | None, *, fns: LMFunctions,
              config: GRPOConfig, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy loss (+ KL to the reference, - entropy bonus) of one mini-batch, and metrics.

    ``old=None`` (only where ``config.old_from_update``): pi_old is ``params`` itself, its
    log-probs the stop-gradient of this forward's (no separate pi_old forward)."""
    loss, (metrics, _) = _grpo_loss(params, mb, old, fns=fns, config=config, key=key)
    return loss, metrics


def _grpo_loss(params: Any, mb: MiniBatch, old: OldStats | None, *, fns: LMFunctions,
               config: GRPOConfig, key: jax.Array, uniforms: jax.Array | None = None
               ) -> tuple[jax.Array, tuple[dict[str, jax.Array], jax.Array]]:
    """:func:`grpo_loss`, and the [b, N] bool mask every loss term aggregates over (the
    response mask after the correction's); ``uniforms`` [b, N]: SIS's, instead of drawing them
    from ``key`` (a micro-batch's slice of the mini-batch's draw)."""
    if old is None and not config.old_from_update:
        raise ValueError("grpo_loss(old=None) needs config.old_from_update (lag 1, no SIS, no "
                         "SIS diagnostics, no KL); pass old_stats(...) otherwise")
    replay = config.routing_replay == "replay"
    if config.routing_replay != "off" and mb.routing is None:
        raise ValueError(f"routing_replay={config.routing_replay!r} needs the mini-batch's routing "
                         "[b, P + N - 1, L, k] (a rollout sampled with RolloutSpec.record_routing); got None")
    hidden, head, own = routed_response_hidden(fns, params, mb.prompts, mb.prompt_lengths, mb.tokens,
                                               mb.routing if replay else None)
    if config.routing_replay != "off" and own is None:
        raise ValueError(f"routing_replay={config.routing_replay!r} needs an MoE model (n_experts > 0, "
                         "scan_layers off); this one has no MoE layer")
    loss_cfg = config.loss
    by_behaviour = loss_cfg.sis_proposal == "behaviour"  # sis_b: pi_theta at mu's top-K
    if by_behaviour and mb.behaviour_topk_ids is None:
        raise ValueError("correction 'sis_b' needs the mini-batch's behaviour_topk_logp / _ids "
                         "[b, N, K] (a rollout sampled with RolloutSpec.behaviour_topk = K > 0); got None")
    proposal_ids = (mb.behaviour_topk_ids if by_behaviour
                    else old.topk_indices if old is not None and loss_cfg.uses_sis else None)
    out = fused_logprobs(hidden, head, mb.tokens, proposal_ids,
                         temperature=config.temperature, backend=config.logprob_backend)
    logp = out.target_logp
    if old is None:
        old = OldStats(jax.lax.stop_gradient(logp), None, None, None)
    loss, metrics = policy_loss(
        logp, old.logp, mb.advantages, mb.mask, config=loss_cfg, key=key,
        old_topk_logp=old.topk_logp if loss_cfg.sis_proposal == "old" else None,
        new_topk_logp=out.topk_logp, behaviour_logp=mb.behaviour_logp, uniforms=uniforms,
        behaviour_topk_logp=mb.behaviour_topk_logp if by_behaviour else None)
    metrics = dict(metrics)
    metrics["policy_loss"] = loss
    if config.routing_replay != "off":
        metrics["moe/router_disagreement"] = router_disagreement(own, mb.routing, mb.prompt_lengths, mb.mask)
    given = as_bool_mask(mb.mask)
    if config.sis_diagnostics:
        metrics["sis_accept_expected"] = _expected_sis_accept(hidden, head, mb, old, config, given)
    # RS tokens leave the mask of every term, as verl's response_mask
    mask = correction_mask(loss_cfg, old.logp, mb.behaviour_logp, given)[0]  # so do a menu correction's
    delta = jax.lax.stop_gradient(logp - old.logp)
    metrics["max_abs_log_ratio"] = jnp.max(jnp.where(given, jnp.abs(delta), 0.0))
    metrics["behaviour_gap"] = _masked_mean(jnp.abs(old.logp - mb.behaviour_logp), given)
    metrics.update(mismatch_metrics(old.logp, mb.behaviour_logp, given, config=loss_cfg))
    if config.kl_coef > 0:
        log_r = old.ref_logp - logp  # log pi_ref / pi_theta on tokens sampled ~ pi
        per_token = -log_r if config.kl_estimator == "k1" else jnp.exp(log_r) - log_r - 1.0
        kl = _masked_mean(per_token, mask)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl
    if config.entropy_coef > 0:
        logits = jnp.einsum("bnd,dv->bnv", hidden, head,
                            preferred_element_type=jnp.float32) / config.temperature
        logq = jax.nn.log_softmax(logits, axis=-1)
        entropy = _masked_mean(-jnp.sum(jnp.exp(logq) * logq, axis=-1), mask)
        loss = loss - config.entropy_coef * entropy
        metrics["entropy"] = entropy
    metrics["loss"] = loss
    return loss, (metrics, mask)


def summarize(history: list[dict], batch: RolloutBatch, sampler_version: int,
              trainer_version: int) -> dict[str, float]:
    """Host floats named as verl does (:mod:`jaxflow.rl.step_metrics`): the update metrics
    averaged over mini-batches (``actor/*``, the first mini-batch's accept rate / max |log
    ratio| separately: it must be on-policy), ``critic/rewards/mean``,
    ``response_length/mean`` and the versions (``version/sampler``, ``version/trainer``)."""
    out = update_rows(history)
    out["critic/rewards/mean"] = float(batch.rewards.mean())
    out["response_length/mean"] = float(batch.mask.sum(axis=1).mean())
    out["version/sampler"] = sampler_version
    out["version/trainer"] = trainer_version
    return out
