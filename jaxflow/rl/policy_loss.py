"""The policy loss: GRPO / DAPO / GSPO / CISPO / SA-GCPO with SIS, TIS, MIS and RS as plug-in corrections.

Everything is a pure function of arrays; ``config`` is a frozen, hashable dataclass, so
``jax.jit(policy_loss, static_argnames="config")`` works, as does closing over it.

Per token (``log_w = clip(logp - old_logp, -20, 20)``, ``r = exp(log_w)``, A the advantage):

* ``grpo`` / ``dapo``: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; with the dual
  clip (``dual_clip_c``, default c = 3 as verl's ``clip_ratio_c``; None turns it off; Ye et
  al. 2020, arXiv 1912.09729) the loss of a negative-advantage token is further capped at
  ``-A c``. ``dapo`` is the same loss with clip-higher defaults (0.2 / 0.28).
* ``gspo``: the GSPO-token form: ``r_t = sg(s) * exp(log_w_t - sg(log_w_t))`` with ``s`` the
  length-normalised sequence ratio ``exp(mean_t log_w_t)``, its log capped at
  ``seq_log_ratio_cap`` (10, as verl), then the PPO clip with GSPO's tiny eps (3e-4 / 4e-4).
  Default aggregation ``seq-mean-token-mean`` (GSPO's own, arXiv 2507.18071); under it the
  gradient is GSPO's sequence one.
* ``cispo``: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp`` (gradient always flows).
* ``sa_gcpo``: OxygenREC's SA-GCPO (arXiv 2512.22386): the hard clip is replaced by the SAPO
  soft gate ``-A * f(r)``, ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau`` with ``tau =
  gate_tau_pos`` (2) for A > 0 and ``gate_tau_neg`` (5) for A < 0; ``f'(1) = 1``, so at
  ``r = 1`` the gradient is the on-policy one, and it decays smoothly (never to exactly 0) as
  ``r`` leaves 1. Advantages are the caller's group-normalised ones
  (:func:`jaxflow.rl.advantages.grpo_advantages`); given ``rewards`` and ``target_reward`` (per
  row), positive advantages of rows whose reward is below the row's target are set to 0
  (:func:`jaxflow.rl.advantages.zero_positive_below_target`). Default aggregation
  ``seq-mean-token-mean`` (mean over sequences of the token mean, as the paper). No hard clip:
  its ``clip_fraction`` is 0.

SIS (``correction`` contains ``sis``) replaces ``log_w`` by ``log_w - sg(accept * log_w)``
(see :mod:`jaxflow.rl.sis`): an accepted token has ratio value exactly 1, is never clipped
(nor dual-clipped, nor truncated by CISPO) and gets the on-policy gradient ``-A grad logp``
-- also when ``|logp - old_logp|`` exceeds ``log_ratio_clip`` (the clip only guards ``exp``
of a rejected token's ratio; an accepted token's value is 1, so its gradient is taken through
the unclipped difference, see :func:`jaxflow.rl.sis.sis_log_ratio`).
A rejected token goes through the base algorithm unchanged, except that for GSPO the sequence
ratio is the mean of ``log_w`` over the sequence's *rejected* tokens only (1 when none are).
``sis_b`` is SIS with the behaviour policy mu as its proposal: the same accept / reject
handling, but the rejection test is on ``pi_theta / mu`` (``clip(logp - behaviour_logp)``)
with the envelope over mu's top-K (``behaviour_topk_logp``, recorded by the sampler, and
``new_topk_logp`` at those ids); with ``mu == pi_old`` (and mu's top-K = pi_old's) it is
``sis`` exactly.

Behaviour-policy corrections (:mod:`jaxflow.rl.corrections`, rho = pi_old / mu):
TIS / MIS weights multiply every unmasked token's loss (a token MIS zeroes stays in the
aggregation's denominator); RS (verl's token rejection sampling) removes tokens with rho
outside ``[rs_threshold_lower, rs_threshold]`` from the mask itself, so they leave the
denominator (and every metric), before anything else -- SIS, GSPO's sequence ratio, the
aggregation -- sees the mask. The menu corrections (IcePop, seq-mask-TIS, Geo-RS, AReaL's
two-stage Geo-RS + token MIS, M2PO, prime-rl's masks: :mod:`jaxflow.rl.correction_menu`) act
the same way: their mask first, their detached weights on the token losses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.config_domains import ABOVE_ONE, CAP_OR_OFF, NON_NEGATIVE, POSITIVE, WIDTH_OR_OFF, domains
from jaxflow.rl import advantages as advantages_lib
from jaxflow.rl import correction_menu, corrections, sis
from jaxflow.rl.correction_menu import correction_mask, rs_token_mask  # noqa: F401  (API: re-export)
from jaxflow.rl.loss_checks import validate_loss_inputs
from jaxflow.rl.masks import as_bool_mask
from jaxflow.rl.metrics import loss_metrics, masked_percentile  # noqa: F401  (API: re-export)

ALGOS = ("grpo", "dapo", "gspo", "cispo", "sa_gcpo")
CORRECTIONS = ("none", "sis", "sis_b", "tis", "mis", "rs", "tis+rs", "sis+tis", "sis+mis", "sis+rs",
               *correction_menu.MENU)
# Algorithms with a dual clip (``dual_clip_c``); the others have none.
DUAL_CLIP_ALGOS = ("grpo", "dapo")
DEFAULT_DUAL_CLIP_C = 3.0  # verl's clip_ratio_c default
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# Corrections whose mask depends on every token of the batch (M2PO's second-moment cut).
BATCH_STATISTIC_CORRECTIONS = ("m2po", "m2po+mis")

# (eps_low, eps_high) per algorithm; the clip range of the ratio is [1 - low, 1 + high].
# CISPO has no lower truncation by default (1 - 1.0 = 0), as in MiniMax-M1. SA-GCPO has no clip
# (a soft gate instead), so its range is unbounded.
DEFAULT_CLIP_EPS = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
    "sa_gcpo": (float("inf"), float("inf")),
}

# Aggregation when ``PolicyLossConfig.agg`` is None.
DEFAULT_AGG = {"gspo": "seq-mean-token-mean", "sa_gcpo": "seq-mean-token-mean"}


@domains(clip_eps_low=WIDTH_OR_OFF, clip_eps_high=WIDTH_OR_OFF, dual_clip_c=ABOVE_ONE, log_ratio_clip=POSITIVE,
         seq_log_ratio_cap=CAP_OR_OFF, tis_cap=POSITIVE, mis_low=NON_NEGATIVE, mis_high=POSITIVE, rs_threshold=POSITIVE,
         rs_threshold_lower=NON_NEGATIVE, gate_tau_pos=POSITIVE, gate_tau_neg=POSITIVE)
@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """What :func:`policy_loss` computes. Frozen and hashable (a valid static jit argument).

    Attributes:
      algo: one of ``ALGOS`` ("grpo", "dapo", "gspo", "cispo", "sa_gcpo"). Default "grpo".
      correction: one of ``CORRECTIONS``. Default "none". "sis" needs ``key`` and both top-K
        arrays; "sis_b" (SIS with the behaviour policy as proposal) needs ``key``,
        ``behaviour_logp``, ``behaviour_topk_logp`` and ``new_topk_logp`` at the behaviour
        top-K; "tis" / "mis" / "rs" need ``behaviour_logp``. "tis+rs" is verl's token TIS
        weights on top of its token rejection mask. The menu of :mod:`jaxflow.rl.correction_menu`
        ("icepop", "seq-mask-tis", "geo-rs", ...) needs ``behaviour_logp``; its bounds are ``menu``.
      agg: one of ``AGGS``, or None (the default) for the algorithm's default: "token-mean"
        (mean over all unmasked tokens), except "seq-mean-token-mean" for gspo and sa_gcpo.
        None stays None, so ``dataclasses.replace(cfg, algo=...)`` picks the new algorithm's
        default; :attr:`aggregation` is the resolved name.
        "seq-mean-token-mean" / "seq-mean-token-sum" average, over sequences with at least one
        unmasked token, the per-sequence token mean / sum.
      clip_eps_low, clip_eps_high: clip range [1 - low, 1 + high]; None takes the algorithm's
        default from ``DEFAULT_CLIP_EPS`` (grpo 0.2/0.2, dapo 0.2/0.28, gspo 3e-4/4e-4,
        cispo 1.0/0.28). ``float("inf")`` disables a side.
      dual_clip_c: the dual clip of grpo/dapo: the loss of a negative-advantage token is capped
        at ``-A * c`` (c > 1). Default 3.0 (verl's ``clip_ratio_c``); None turns it off. The
        other algorithms have no dual clip: with them only the default (unused) or None is
        accepted, so ``dataclasses.replace(cfg, algo="gspo")`` works and an explicit other
        value is an error rather than silently ignored.
      log_ratio_clip: every log ratio is clipped to [-this, this]. Default 20.0.
      seq_log_ratio_cap: gspo only: the log of its token ratio ``sg(s) * r_t / sg(r_t)`` is
        capped at this (the value of a capped token is ``exp(cap)`` and its gradient 0), as
        verl's ``clamp(max=10.0)``. Default 10.0; ``float("inf")`` disables it.
      tis_cap: TIS weight ``min(pi_old / mu, tis_cap)``. Default 2.0.
      mis_low, mis_high: MIS keeps ``pi_old / mu`` inside [low, high], zero outside.
        Defaults 0.5 and 2.0.
      rs_threshold, rs_threshold_lower: RS keeps a token when ``rs_threshold_lower <= pi_old /
        mu <= rs_threshold`` and removes it from the mask otherwise (verl's
        ``rollout_rs="token"`` with ``rollout_rs_threshold`` / ``rollout_rs_threshold_lower``).
        Defaults 2.0 and None (= 1 / rs_threshold, as verl), so ``rs`` and ``mis`` keep the
        same tokens by default.
      gate_tau_pos, gate_tau_neg: sa_gcpo's soft-gate temperatures for positive / negative
        advantages. Defaults 2.0 and 5.0 (OxygenREC, after SAPO).
      menu: the bounds of the menu corrections (:class:`jaxflow.rl.correction_menu.CorrectionMenuConfig`).
    """

    algo: str = "grpo"
    correction: str = "none"
    agg: str | None = None
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip_c: float | None = DEFAULT_DUAL_CLIP_C
    log_ratio_clip: float = sis.LOG_RATIO_CLIP
    seq_log_ratio_cap: float = 10.0
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    rs_threshold: float = 2.0
    rs_threshold_lower: float | None = None
    gate_tau_pos: float = 2.0
    gate_tau_neg: float = 5.0
    menu: correction_menu.CorrectionMenuConfig = correction_menu.CorrectionMenuConfig()

    def __post_init__(self):
        for field, choices in (("algo", ALGOS), ("correction", CORRECTIONS), ("agg", AGGS)):
            value = getattr(self, field)
            if value not in choices and not (field == "agg" and value is None):
                raise ValueError(f"unknown {field} {value!r}; valid choices: {choices}")
        if self.dual_clip_c is not None:
            if self.algo not in DUAL_CLIP_ALGOS and self.dual_clip_c != DEFAULT_DUAL_CLIP_C:
                raise ValueError(
                    f"dual_clip_c={self.dual_clip_c!r} applies to algo 'grpo' or 'dapo'; "
                    f"{self.algo!r} has no dual clip (leave dual_clip_c at its default "
                    f"{DEFAULT_DUAL_CLIP_C} or set None)")
            if not self.dual_clip_c > 1:
                raise ValueError(f"dual_clip_c must be > 1 (or None for off), got "
                                 f"{self.dual_clip_c!r}")
        for field in ("log_ratio_clip", "seq_log_ratio_cap", "tis_cap", "rs_threshold",
                      "gate_tau_pos", "gate_tau_neg"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"{field} must be > 0, got {value!r}")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError(
                f"need 0 <= mis_low < mis_high, got mis_low={self.mis_low!r}, "
                f"mis_high={self.mis_high!r}")
        low, high = self.rs_bounds
        if not 0 <= low <= high:
            raise ValueError(
                f"need 0 <= rs_threshold_lower <= rs_threshold, got rs_threshold_lower="
                f"{self.rs_threshold_lower!r} (None means 1 / rs_threshold = {1 / high:g}), "
                f"rs_threshold={high!r}")

    @property
    def aggregation(self) -> str:
        """``agg``, or the algorithm's default aggregation when ``agg`` is None."""
        return self.agg if self.agg is not None else DEFAULT_AGG.get(self.algo, "token-mean")

    @property
    def eps(self) -> tuple[float, float]:
        """The resolved (eps_low, eps_high)."""
        low, high = DEFAULT_CLIP_EPS[self.algo]
        return (low if self.clip_eps_low is None else self.clip_eps_low,
                high if self.clip_eps_high is None else self.clip_eps_high)

    @property
    def dual_clip(self) -> float | None:
        """The dual-clip c the loss applies: ``dual_clip_c`` for grpo/dapo, else None."""
        return self.dual_clip_c if self.algo in DUAL_CLIP_ALGOS else None

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """The resolved RS keep range (lower, upper) of ``pi_old / mu``."""
        lower = (1.0 / self.rs_threshold if self.rs_threshold_lower is None
                 else self.rs_threshold_lower)
        return lower, self.rs_threshold

    @property
    def uses_sis(self) -> bool:
        """Whether the correction is one of the SIS variants."""
        return self.correction.startswith("sis")

    @property
    def sis_proposal(self) -> str | None:
        """SIS's proposal: "old" (pi_old, the authors' SIS), "behaviour" (mu, ``sis_b``) or None."""
        if not self.uses_sis:
            return None
        return "behaviour" if self.correction == "sis_b" else "old"

    @property
    def behaviour_correction(self) -> str | None:
        """The behaviour-policy weights: "tis", "mis" or None (RS alone weighs nothing)."""
        parts = () if self.correction in correction_menu.MENU else self.correction.split("+")
        return next((p for p in parts if p in ("tis", "mis")), None)

    @property
    def uses_rs(self) -> bool:
        """Whether RS removes tokens from the mask (needs ``behaviour_logp``)."""
        return "rs" in self.correction.split("+") and self.correction not in correction_menu.MENU

    @property
    def batch_statistic(self) -> str | None:
        """The correction whose mask is a statistic of the whole batch (M2PO's second-moment
        cut over every token: :data:`BATCH_STATISTIC_CORRECTIONS`), else None. Such a loss
        cannot be split into micro-batches exactly; every other correction acts per token or
        per row."""
        return self.correction if self.correction in BATCH_STATISTIC_CORRECTIONS else None

    @property
    def needs_behaviour_logp(self) -> bool:
        """Whether the loss needs the sampler's (behaviour policy's) log-probs."""
        return (self.behaviour_correction is not None or self.uses_rs or self.correction in correction_menu.MENU
                or self.sis_proposal == "behaviour")


# ----------------------------------------------------------------------------- base losses


def _ppo_clip(ratio, adv, accept, eps, dual_clip_c):
    """PPO clip (+ optional dual clip); accepted tokens take the unclipped branch.

    Returns (token loss, clip-or-dual-clip active, dual clip active), the masks excluding
    accepted tokens."""
    low, high = eps
    unclipped = -adv * ratio
    clipped_loss = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    clip_active = clipped_loss > unclipped
    loss = jnp.where(clip_active, clipped_loss, unclipped)
    dual_active = jnp.zeros(ratio.shape, bool)
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        dual_active = jnp.logical_and(adv < 0, loss > bound)
        loss = jnp.where(dual_active, bound, loss)
        clip_active = jnp.logical_or(clip_active, dual_active)
    loss = jnp.where(accept, unclipped, loss)
    return loss, jnp.logical_and(clip_active, ~accept), jnp.logical_and(dual_active, ~accept)


def _gspo_token_log_ratio(log_w, sis_log_w, accept, mask, cap):
    """Accepted: ``sis_log_w`` (value 0). Rejected: ``sg(seq) + log_w - sg(log_w)`` where
    ``seq`` is the mean of ``log_w`` over the sequence's rejected unmasked tokens, capped at
    ``cap`` (above it: value ``cap``, no gradient, as torch's ``clamp(max=cap)``)."""
    rejected = jnp.logical_and(mask, ~accept)
    count = jnp.sum(rejected, axis=-1, keepdims=True)
    seq = jnp.sum(jnp.where(rejected, log_w, 0.0), axis=-1, keepdims=True)
    seq = seq / jnp.maximum(count, 1).astype(log_w.dtype)
    rejected_log_ratio = jax.lax.stop_gradient(seq) + (log_w - jax.lax.stop_gradient(log_w))
    rejected_log_ratio = jnp.where(rejected_log_ratio > cap,
                                   jnp.asarray(cap, rejected_log_ratio.dtype), rejected_log_ratio)
    return jnp.where(accept, sis_log_w, rejected_log_ratio)


def sapo_gate(ratio: jax.Array, tau: jax.Array | float) -> jax.Array:
    """The SAPO / SA-GCPO soft gate ``sigmoid(tau * (ratio - 1)) * 4 / tau`` (elementwise).

    Its derivative in ``ratio`` is ``4 s (1 - s)`` with ``s`` the sigmoid: exactly 1 at
    ``ratio = 1`` and positive everywhere, decaying as ``ratio`` leaves 1 (faster for larger
    ``tau``) where a hard clip would be flat.
    """
    return jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def _sa_gcpo(ratio, adv, tau_pos, tau_neg):
    tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(ratio.dtype)
    none = jnp.zeros(ratio.shape, bool)
    return -adv * sapo_gate(ratio, tau), none, none


def _cispo(ratio, logp, adv, accept, eps):
    low, high = eps
    truncated = jnp.clip(ratio, 1.0 - low, 1.0 + high)
    weight = jax.lax.stop_gradient(jnp.where(accept, ratio, truncated))
    clip_active = jnp.logical_and(truncated != ratio, ~accept)
    return -adv * weight * logp, clip_active, jnp.zeros(ratio.shape, bool)


# ----------------------------------------------------------------------------- aggregation, metrics


def aggregate(token_loss: jax.Array, mask: jax.Array, agg: str) -> jax.Array:
    """Reduces [B, T] token losses (already zero where masked) with ``agg`` (see AGGS).

    ``mask`` [B, T]: bool or any numeric dtype, nonzero = the token counts (not a weight)."""
    maskf = as_bool_mask(mask).astype(token_loss.dtype)
    if agg == "token-mean":
        return jnp.sum(token_loss * maskf) / jnp.maximum(jnp.sum(maskf), 1.0)
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; valid choices: {AGGS}")
    count = jnp.sum(maskf, axis=-1)
    per_seq = jnp.sum(token_loss * maskf, axis=-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / jnp.maximum(count, 1.0)
    nonempty = count > 0
    return jnp.sum(jnp.where(nonempty, per_seq, 0.0)) / jnp.maximum(jnp.sum(nonempty), 1)


def aggregation_weight(mask: jax.Array, agg: str) -> jax.Array:
    """The normaliser :func:`aggregate` divides by (before its floor of 1), a f32 scalar: the
    unmasked tokens of ``mask`` [B, T] for "token-mean", the rows with at least one for the
    "seq-mean-*" aggregations. A micro-batch's loss times this is its share of the batch's
    unnormalised sum, so gradients weighted by it and divided by their total are the batch's
    gradient (gradient accumulation, :func:`jaxflow.rl.update.accumulated_update_step`)."""
    keep = as_bool_mask(mask)
    if agg == "token-mean":
        return jnp.sum(keep).astype(jnp.float32)
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; valid choices: {AGGS}")
    return jnp.sum(jnp.any(keep, axis=-1)).astype(jnp.float32)


# ----------------------------------------------------------------------------- the loss


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    config: PolicyLossConfig,
    key: jax.Array | None = None,
    old_topk_logp: jax.Array | None = None,
    new_topk_logp: jax.Array | None = None,
    behaviour_logp: jax.Array | None = None,
    uniforms: jax.Array | None = None,
    rewards: jax.Array | None = None,
    target_reward: jax.Array | None = None,
    behaviour_topk_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The policy-gradient loss (to minimise) and its diagnostics.

    Args:
      logp: [B, T] current policy log-prob of the sampled tokens (differentiated).
      old_logp: [B, T] pi_old's log-prob of the same tokens: the trainer's own recomputation at
        the start of the rollout's updates (treated as data: no gradient).
      advantages: [B] per sequence or [B, T] per token.
      mask: [B, T] response mask, bool or any numeric dtype (e.g. the sampler's float32
        ``out.mask``): nonzero = the token counts, never a weight (0.5 counts as 1;
        :func:`jaxflow.rl.masks.as_bool_mask`); masked entries may hold anything (even inf).
      config: a :class:`PolicyLossConfig` (static).
      key: PRNG key for the SIS uniforms (needed when ``config.correction`` has "sis"); the
        uniforms are ``sis.sis_uniforms(key, logp.shape)``.
      old_topk_logp, new_topk_logp: [B, T, K] pi_old's / the current policy's log-probs at
        pi_old's top-K tokens (needed for SIS). K = |V| gives the exact envelope. With ``sis_b``
        ``new_topk_logp`` is the current policy at the behaviour policy's top-K tokens.
      behaviour_logp: [B, T] the sampler's log-probs (needed for TIS / MIS / RS).
      uniforms: optional [B, T] SIS uniforms in [0, 1] used instead of drawing them from
        ``key`` (an extension beyond the SIS paper for replays and for exact expectations over the
        accept coin: 0 forces acceptance, 1 forces rejection unless log_w == 0).
      rewards, target_reward: optional [B] each, sa_gcpo only (both or neither): positive
        advantages of rows with ``rewards < target_reward`` are set to 0 before the gate.
      behaviour_topk_logp: [B, T, K] the behaviour policy's top-K log-probs (``sis_b`` only).

    Returns:
      ``(loss, metrics)``: a scalar in f32 (or wider, matching logp) and a dict of scalars,
      all over the tokens the loss uses (the mask after RS):
      accept_rate (fraction SIS accepted; 0 without SIS), clip_fraction (fraction whose loss
      the clip / dual clip / CISPO truncation changed), dual_clip_fraction (the dual clip alone:
      verl's ``pg_clipfrac_lower``), rs_masked_fraction (fraction of the *given* mask's tokens
      RS removed; 0 without RS), the cumulative-deviation diagnostics with log_w clipped to
      +-log_ratio_clip -- d_original (token mean of |log_w|), d_sis (the same with accepted
      tokens counted as 0), d_original_seq / d_sis_seq (the SIS authors' logged form: log_w
      clipped to the PPO range, mean over all B rows of each row's token mean, an empty row
      counting as 0), d_original_seq_nonempty / d_sis_seq_nonempty (+-log_ratio_clip only,
      mean over the rows that have a token; :mod:`jaxflow.rl.metrics`) --, ratio_max and
      ratio_p99 (of exp(log_w), the ratio before SIS), ess ((sum v)^2 / (n sum v^2), v = the
      ratio value the loss uses after SIS -- the sequence ratio for GSPO, before clipping --
      times the TIS/MIS weight; 0 when every token is masked). With every token masked the
      loss is 0 and its gradient is finite (zero).

    Raises:
      ValueError: bad shapes / dtypes, an unknown name in the config, or an input the chosen
        correction needs is missing.
    """
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    validate_loss_inputs(logp, old_logp, advantages, mask, config, key, old_topk_logp, new_topk_logp,
                         behaviour_logp, uniforms, rewards, target_reward, behaviour_topk_logp)
    dtype = jnp.promote_types(logp.dtype, jnp.float32)
    given = as_bool_mask(mask)

    def clean(x, m):  # masked entries -> 0 so inf/nan padding can't reach the loss or grad
        return jnp.where(m, x.astype(dtype), jnp.zeros((), dtype))

    keep, menu = correction_mask(config, old_logp, behaviour_logp, given)  # removed tokens leave it
    logp_c = clean(logp, keep)
    old_c = jax.lax.stop_gradient(clean(old_logp, keep))
    if target_reward is not None:
        advantages = advantages_lib.zero_positive_below_target(advantages, rewards,
                                                               target_reward)
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    adv = jax.lax.stop_gradient(clean(jnp.broadcast_to(adv, logp.shape), keep))
    log_w = sis.clipped_log_ratio(logp_c, old_c, config.log_ratio_clip)

    if config.uses_sis:
        keep_k = keep[..., None]
        test_log_w, proposal_topk = log_w, old_topk_logp  # the authors' SIS: pi_theta / pi_old
        if config.sis_proposal == "behaviour":  # sis_b: the test on pi_theta / mu
            test_log_w = sis.clipped_log_ratio(logp_c, jax.lax.stop_gradient(clean(behaviour_logp, keep)),
                                               config.log_ratio_clip)
            proposal_topk = behaviour_topk_logp
        log_m = sis.sis_log_envelope(test_log_w, clean(new_topk_logp, keep_k),
                                     clean(proposal_topk, keep_k), config.log_ratio_clip)
        if uniforms is None:
            uniforms = sis.sis_uniforms(key, logp.shape)
        accept = jnp.logical_and(sis.sis_accept(test_log_w, log_m, uniforms), keep)
    else:
        accept = jnp.zeros(logp.shape, bool)
    sis_log_w = sis.sis_log_ratio(log_w, accept, logp_c - old_c)

    eps = config.eps
    if config.algo in ("grpo", "dapo"):
        ratio = jnp.exp(sis_log_w)
        token_loss, clip_active, dual_active = _ppo_clip(ratio, adv, accept, eps,
                                                         config.dual_clip)
    elif config.algo == "gspo":
        ratio = jnp.exp(_gspo_token_log_ratio(log_w, sis_log_w, accept, keep,
                                              config.seq_log_ratio_cap))
        token_loss, clip_active, dual_active = _ppo_clip(ratio, adv, accept, eps, None)
    elif config.algo == "sa_gcpo":
        ratio = jnp.exp(sis_log_w)
        token_loss, clip_active, dual_active = _sa_gcpo(ratio, adv, config.gate_tau_pos,
                                                        config.gate_tau_neg)
    else:  # cispo
        ratio = jnp.exp(sis_log_w)
        token_loss, clip_active, dual_active = _cispo(ratio, logp_c, adv, accept, eps)

    weights = jnp.ones(logp.shape, dtype)
    if config.behaviour_correction is not None:
        behaviour_c = clean(behaviour_logp, keep)
        if config.behaviour_correction == "tis":
            weights = corrections.tis_weights(old_c, behaviour_c, config.tis_cap)
        else:
            weights = corrections.mis_weights(old_c, behaviour_c, config.mis_low,
                                              config.mis_high)
        token_loss = token_loss * weights
    if menu is not None:
        weights = menu.weights.astype(dtype)
        token_loss = token_loss * weights

    token_loss = jnp.where(keep, token_loss, jnp.zeros((), dtype))
    loss = aggregate(token_loss, keep, config.aggregation)
    metrics = loss_metrics(log_w, accept, clip_active, dual_active,
                           jax.lax.stop_gradient(ratio) * weights, keep, eps)
    n_given = jnp.sum(given)
    metrics["rs_masked_fraction"] = ((n_given - jnp.sum(keep)) / jnp.maximum(n_given, 1)
                                     ).astype(dtype)
    return loss, metrics
