"""The off-policy correction menu of the RL frameworks (2025-26) as plug-ins of the policy loss.

Every entry corrects for the gap between the sampler (``behaviour_logp``, mu) and the trainer's
recomputation at the start of the rollout's updates (``old_logp``, pi_old) through the ratio
``rho = pi_old / mu`` (from the +-20-clipped log ratio, as the TIS / MIS / RS corrections of
:mod:`jaxflow.rl.corrections`). Each returns what :func:`jaxflow.rl.policy_loss` needs:

* ``keep`` [B, T] bool: the tokens that stay in the loss's mask (a token outside it leaves the
  aggregation's denominator too, as verl's ``modified_response_mask``);
* ``weights`` [B, T]: detached per-token weights on the kept tokens (0 = masked from the
  numerator but still counted in the denominator, as NeMo-RL's and AReaL's masks);
* ``masked`` [B, T] bool: the given tokens the correction removed or zeroed (for the
  ``mismatch/masked_fraction/<correction>`` diagnostics).

The entries, each with its reference's published defaults (:class:`CorrectionMenuConfig`):

* ``icepop`` (NeMo-RL ``truncated_importance_sampling_type: icepop``,
  ``nemo_rl/algorithms/loss/loss_functions.py``; bounds 0.5-5 of ``docs/guides/prorlv2.md``):
  ``weight = rho`` inside ``[icepop_low, icepop_high]``, else 0; denominator unchanged. The
  same function as ``mis`` (:func:`jaxflow.rl.corrections.mis_weights`) with NeMo-RL's bounds.
* ``seq-mask-tis`` (NeMo-RL, same file; bounds 0.999-1.002 of
  ``examples/configs/prorlv2_1_moe.v2.yaml``): a row whose geometric-mean ``rho`` (the exp of
  its token mean of ``log rho``) lies outside the bounds gets weight 0; the other rows keep the
  raw token ``rho`` as weight; denominator unchanged.
* ``geo-rs`` (verl ``rollout_rs="seq_mean_k1"``, preset ``decoupled_geo_rs``,
  ``verl/trainer/ppo/rollout_corr_helper.py``; threshold ``"0.999_1.001"``): a row whose mean
  k1 estimate ``mean_t(-log rho)`` lies outside ``[log geo_rs_low, log geo_rs_high]`` leaves the
  mask (and the denominator); kept tokens weigh 1. ``geo-rs+tis``: verl's
  ``decoupled_geo_rs_token_tis`` -- the same mask with token TIS weights ``min(rho, tis_cap)``;
  ``geo-rs+seq-tis``: ``decoupled_geo_rs_seq_tis`` -- sequence TIS weights
  ``min(exp(clip(sum_t log rho, +-20)), tis_cap)``, one per row.
* ``geo-rs+token-mis``: AReaL's two-stage mode (areal-project/AReaL PR #1218, built from the
  merged ``apply_rejection_sampling`` of ``areal/utils/functional/functional.py`` run twice,
  ``metric="ratio"``, ``action="mask"``): stage 1 drops rows whose geometric-mean ``rho`` is
  outside ``[areal_low, areal_high]``, stage 2 drops tokens whose ``rho`` is outside it; kept
  tokens weigh ``rho``; the denominator stays the given mask's count (AReaL's
  ``ppo_actor_loss_fn`` counts it before rejection). ``areal_low = 0`` is AReaL's ``lower=None``.
  The PR is unmerged; its description asks for token-level weights (as here), while its diff at
  review kept stage 1's geometric mean as the kept tokens' weight (flagged in review).
* ``m2po`` (AReaL ``_apply_m2po_masking``, ``areal/trainer/ppo/actor.py``; ``m2_threshold``
  0.04 of ``examples/math/gsm8k_m2po.yaml``): over the whole batch, the tokens with the
  largest second moment ``(log mu - log pi_old)^2`` leave the mask until the mean over the rest
  is below the threshold (all but one when it never is); kept tokens weigh 1. ``m2po+mis``: that
  recipe's combination -- the M2PO mask, then AReaL's token rejection (``upper`` 5, no lower
  bound): ``weight = rho`` where ``rho <= m2po_mis_high``, else 0, in the M2PO-kept denominator.
* ``prime-masks`` (prime-rl ``default_loss_fn``, ``src/prime_rl/trainer/rl/loss.py``): a token
  is masked when its ``rho`` is outside ``[prime_token_low, prime_token_high]`` (0.125-8), when
  its row's geometric-mean ``rho`` is outside ``[prime_geo_low, prime_geo_high]`` (0.1-10), or
  when its row's min ``rho`` is below ``prime_seq_low`` (0: off) or max above ``prime_seq_high``
  (100); kept tokens weigh ``rho``, the denominator is the given mask's count.

:func:`correction_mask` is the one mask every term of the loss takes (RS's or a menu entry's).

No adaptive-bound variant: no reference code for the adaptive IcePop regions could be found.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxflow.config_domains import NON_NEGATIVE, POSITIVE, domains
from jaxflow.rl import corrections
from jaxflow.rl.sis import LOG_RATIO_CLIP

MENU = ("icepop", "seq-mask-tis", "geo-rs", "geo-rs+tis", "geo-rs+seq-tis", "geo-rs+token-mis", "m2po",
        "m2po+mis", "prime-masks")


@domains(icepop_low=NON_NEGATIVE, icepop_high=POSITIVE, seq_mask_tis_low=NON_NEGATIVE,
         seq_mask_tis_high=POSITIVE, geo_rs_low=POSITIVE, geo_rs_high=POSITIVE, areal_low=NON_NEGATIVE,
         areal_high=POSITIVE, m2po_threshold=POSITIVE, m2po_mis_high=POSITIVE, prime_token_low=NON_NEGATIVE,
         prime_token_high=POSITIVE, prime_geo_low=NON_NEGATIVE, prime_geo_high=POSITIVE,
         prime_seq_low=NON_NEGATIVE, prime_seq_high=POSITIVE)
@dataclasses.dataclass(frozen=True)
class CorrectionMenuConfig:
    """The bounds of the :data:`MENU` corrections (``rho = pi_old / mu``), each defaulting to its
    reference's published value. Frozen and hashable (part of the static
    :class:`jaxflow.rl.PolicyLossConfig`, set as ``--set rl.loss.menu.X=...``).

    Attributes:
      icepop_low, icepop_high: ``icepop``'s token band. 0.5 / 5.0 (NeMo-RL ProRLv2).
      seq_mask_tis_low, seq_mask_tis_high: ``seq-mask-tis``'s geometric-mean band.
        0.999 / 1.002 (NeMo-RL ProRLv2 MoE recipe).
      geo_rs_low, geo_rs_high: ``geo-rs``'s band on ``exp(mean k1)`` = 1 / geometric-mean rho.
        0.999 / 1.001 (verl ``decoupled_geo_rs``).
      areal_low, areal_high: the two stages of ``geo-rs+token-mis``. 0 (no lower bound) / 5.0
        (AReaL ``RejectionSamplingConfig``).
      m2po_threshold: M2PO's second-moment threshold. 0.04 (AReaL gsm8k_m2po recipe).
      m2po_mis_high: ``m2po+mis``'s token rejection bound. 5.0 (the same recipe).
      prime_token_low, prime_token_high: prime-rl's token band. 0.125 / 8.0.
      prime_geo_low, prime_geo_high: prime-rl's geometric-mean band. 0.1 / 10.0.
      prime_seq_low, prime_seq_high: prime-rl's row min / max bounds. 0.0 (off) / 100.0.
    """

    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mask_tis_low: float = 0.999
    seq_mask_tis_high: float = 1.002
    geo_rs_low: float = 0.999
    geo_rs_high: float = 1.001
    areal_low: float = 0.0
    areal_high: float = 5.0
    m2po_threshold: float = 0.04
    m2po_mis_high: float = 5.0
    prime_token_low: float = 0.125
    prime_token_high: float = 8.0
    prime_geo_low: float = 0.1
    prime_geo_high: float = 10.0
    prime_seq_low: float = 0.0
    prime_seq_high: float = 100.0

    def __post_init__(self):
        for name in ("icepop", "seq_mask_tis", "geo_rs", "areal", "prime_token", "prime_geo", "prime_seq"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not low < high:
                raise ValueError(f"need {name}_low < {name}_high, got {name}_low={low!r}, "
                                 f"{name}_high={high!r}")


class MenuCorrection(NamedTuple):
    """What one menu correction does to a batch (all [B, T], see the module docstring)."""

    keep: jax.Array
    weights: jax.Array
    masked: jax.Array


def behaviour_log_ratio(old_logp: jax.Array, behaviour_logp: jax.Array) -> jax.Array:
    """[B, T] ``log(pi_old / mu)`` clipped to +-20 (verl's ``SAFETY_BOUND``), detached."""
    return jax.lax.stop_gradient(jnp.clip(old_logp - behaviour_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


def _row_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, 1] each row's mean of ``x`` over ``mask`` (0 for an empty row)."""
    count = jnp.sum(mask, axis=-1, keepdims=True)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=-1, keepdims=True) / jnp.maximum(count, 1).astype(x.dtype)


def _inside(x: jax.Array, low: float, high: float) -> jax.Array:
    return jnp.logical_and(x >= low, x <= high)


def m2po_keep_mask(old_logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array,
                   threshold: float) -> jax.Array:
    """[B, T] bool: the tokens M2PO keeps (AReaL ``_apply_m2po_masking``).

    Over all of ``mask``'s tokens of the batch, ``m2 = (log mu - log pi_old)^2`` sorted in
    descending order; the first ``k`` leave, ``k`` the smallest index whose suffix mean is below
    ``threshold`` (``n - 1`` when none is, so one token always stays). Ties are broken by
    position (row-major). ``old_logp``, ``behaviour_logp``: [B, T]; ``mask``: [B, T] bool."""
    delta = jax.lax.stop_gradient(behaviour_logp - old_logp)
    m2 = jnp.where(mask, delta * delta, -jnp.inf).reshape(-1)
    n = jnp.sum(mask)
    order = jnp.argsort(-m2, stable=True)  # valid tokens first, largest m2 first
    ordered = jnp.where(jnp.arange(m2.shape[0]) < n, m2[order], 0.0)
    suffix_sum = jnp.sum(ordered) - jnp.cumsum(ordered) + ordered
    suffix_count = jnp.maximum(n - jnp.arange(m2.shape[0]), 1).astype(m2.dtype)
    below = jnp.logical_and(suffix_sum / suffix_count < threshold, jnp.arange(m2.shape[0]) < n)
    n_drop = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
    rank = jnp.zeros(m2.shape[0], jnp.int32).at[order].set(jnp.arange(m2.shape[0], dtype=jnp.int32))
    return jnp.logical_and(mask, (rank >= n_drop).reshape(mask.shape))


def menu_correction(name: str, menu: CorrectionMenuConfig, old_logp: jax.Array, behaviour_logp: jax.Array,
                    mask: jax.Array, *, tis_cap: float) -> MenuCorrection:
    """The menu correction ``name`` (one of :data:`MENU`) on one batch.

    Args:
      name: the correction.
      menu: its bounds.
      old_logp, behaviour_logp: [B, T] pi_old's and the sampler's log-probs of the sampled tokens
        (masked entries already zeroed by the caller).
      mask: [B, T] bool, the tokens the loss would use without the correction.
      tis_cap: ``geo-rs+tis``'s token / ``geo-rs+seq-tis``'s sequence TIS cap
        (:attr:`jaxflow.rl.PolicyLossConfig.tis_cap`).

    Returns:
      a :class:`MenuCorrection` (keep, weights, masked), each [B, T].

    Raises:
      ValueError: ``name`` is not in :data:`MENU`.
    """
    log_rho = behaviour_log_ratio(old_logp, behaviour_logp)
    rho = jnp.exp(log_rho)
    ones = jnp.ones_like(rho)
    keep, weights = mask, ones
    if name == "icepop":
        weights = corrections.mis_weights(old_logp, behaviour_logp, menu.icepop_low, menu.icepop_high)
    elif name == "seq-mask-tis":
        geo = jnp.exp(_row_mean(log_rho, mask))
        weights = jnp.where(_inside(geo, menu.seq_mask_tis_low, menu.seq_mask_tis_high), rho, 0.0)
    elif name.startswith("geo-rs") and name != "geo-rs+token-mis":
        k1 = _row_mean(-log_rho, mask)
        keep = jnp.logical_and(mask, _inside(k1, math.log(menu.geo_rs_low), math.log(menu.geo_rs_high)))
        if name == "geo-rs+tis":
            weights = jnp.minimum(rho, tis_cap)
        elif name == "geo-rs+seq-tis":
            seq_log = jnp.sum(jnp.where(mask, log_rho, 0.0), axis=-1, keepdims=True)
            weights = jnp.broadcast_to(jnp.minimum(jnp.exp(jnp.clip(seq_log, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)),
                                                   tis_cap), rho.shape)
    elif name == "geo-rs+token-mis":
        geo = jnp.exp(_row_mean(log_rho, mask))
        passed = jnp.logical_and(_inside(geo, menu.areal_low, menu.areal_high),
                                 _inside(rho, menu.areal_low, menu.areal_high))
        weights = jnp.where(passed, rho, 0.0)
    elif name in ("m2po", "m2po+mis"):
        keep = m2po_keep_mask(old_logp, behaviour_logp, mask, menu.m2po_threshold)
        if name == "m2po+mis":
            weights = jnp.where(rho <= menu.m2po_mis_high, rho, 0.0)
    elif name == "prime-masks":
        geo = jnp.exp(_row_mean(log_rho, mask))
        row_min = jnp.min(jnp.where(mask, rho, jnp.inf), axis=-1, keepdims=True)
        row_max = jnp.max(jnp.where(mask, rho, -jnp.inf), axis=-1, keepdims=True)
        masked = (~_inside(rho, menu.prime_token_low, menu.prime_token_high)
                  | ~_inside(geo, menu.prime_geo_low, menu.prime_geo_high)
                  | (row_min < menu.prime_seq_low) | (row_max > menu.prime_seq_high))
        weights = jnp.where(masked, 0.0, rho)
    else:
        raise ValueError(f"unknown menu correction {name!r}; valid choices: {MENU}")
    weights = jax.lax.stop_gradient(jnp.where(keep, weights, 0.0).astype(rho.dtype))
    masked = jnp.logical_and(mask, jnp.logical_or(~keep, weights == 0))
    return MenuCorrection(keep, weights, masked)


def rs_token_mask(config, old_logp: jax.Array, behaviour_logp: jax.Array | None,
                  given: jax.Array) -> jax.Array:
    """[B, T] bool: the tokens of ``given`` that RS keeps (verl's token rejection sampling:
    ``rs_threshold_lower <= pi_old / mu <= rs_threshold``, :attr:`jaxflow.rl.PolicyLossConfig.rs_bounds`);
    ``given`` itself when ``config`` uses no RS. Shapes and cleaning as :func:`correction_mask`."""
    if not config.uses_rs:
        return given
    low, high = config.rs_bounds
    return jnp.logical_and(given, corrections.rs_keep_mask(_clean(old_logp, given), _clean(behaviour_logp, given),
                                                           low, high))


def _clean(x: jax.Array, given: jax.Array) -> jax.Array:
    """``x`` in (at least) f32, zero outside ``given`` (so inf / nan padding reaches nothing)."""
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    return jnp.where(given, x.astype(dtype), jnp.zeros((), dtype))


def correction_mask(config, old_logp: jax.Array, behaviour_logp: jax.Array | None,
                    given: jax.Array) -> tuple[jax.Array, MenuCorrection | None]:
    """The tokens the loss uses after the behaviour correction's mask, and the menu correction.

    The one place the correction's mask is computed: :func:`jaxflow.rl.policy_loss` and the GRPO step's KL /
    entropy terms (``jaxflow.rl.grpo_step``) both take it, so RS- and menu-removed tokens leave
    every term, as verl's ``response_mask``.

    Args:
      config: the :class:`jaxflow.rl.PolicyLossConfig`; its ``correction`` decides the mask.
      old_logp, behaviour_logp: [B, T] pi_old's and the sampler's log-probs of the sampled tokens;
        entries outside ``given`` may hold anything (even inf): they are zeroed first.
        ``behaviour_logp`` may be None when the correction needs none.
      given: [B, T] bool response mask.

    Returns:
      ``(keep [B, T] bool, menu)``: ``keep`` is ``given`` less RS's out-of-range tokens
      (:func:`rs_token_mask`) or a menu correction's removed tokens; ``menu`` the
      :class:`MenuCorrection` (its weights too) for a menu correction, else None.
    """
    if config.correction in MENU:  # a menu correction: its mask, then its weights
        menu = menu_correction(config.correction, config.menu, _clean(old_logp, given),
                               _clean(behaviour_logp, given), given, tis_cap=config.tis_cap)
        return menu.keep, menu
    return rs_token_mask(config, old_logp, behaviour_logp, given), None
