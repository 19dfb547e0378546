"""The GRPO trainer's row names (verl's), response-length statistics and throughput.

A row of :meth:`jaxflow.rl.grpo.GRPOTrainer.step` groups its fields as verl's trainer does, so a
verl user finds them (and TensorBoard groups the tags at the "/"):

  ``actor/*``            the update's metrics, averaged over the rollout's mini-batches
                         (:data:`ACTOR_NAMES` renames the loss's own names to verl's:
                         ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``kl_loss``; the
                         others keep theirs: ``actor/accept_rate``, ``actor/d_sis``, ...), the
                         first mini-batch's ``accept_rate_first`` / ``max_abs_log_ratio_first``,
                         and ``actor/lr``, the learning rate of the rollout's first update.
  ``critic/rewards/mean`` the reward the advantages use (after overlong shaping);
  ``critic/score/mean``   the task's score before shaping (verl's names; there is no critic).
  ``response_length/*``  ``mean`` and ``max`` response tokens (EOS included), ``clip_ratio``:
                         the share of responses that hit ``max_new_tokens`` without an EOS.
  ``timing_s/*``         host seconds of the step's phases: ``generate`` (sampling, rewards
                         excluded), ``reward`` (scoring), ``update`` (pi_old statistics and the N
                         optimizer steps), ``sync`` (publishing the weights).
  ``perf/*``             ``step_s`` (the whole step), ``tokens_per_s`` (prompt + response tokens
                         of the rollout / step_s, verl's ``perf/throughput``) and ``mfu``
                         (:func:`perf_metrics`).
  ``version/*``          counters: the sampler's and trainer's weights versions.
  ``batch/*``            dynamic sampling: ``num_gen_batches``, ``kept_group_fraction``.
  ``sync/*``             weight sync: ``synced``, ``payload_bytes``, ``changed_fraction``,
                         ``bit_exact``.

Only the names changed from the flat rows of earlier versions (:data:`RENAMED` maps them);
``timing_s/*`` and ``perf/*`` are measurements, different in every run (:data:`TIMING_PREFIXES`:
leave them out when comparing rows for equality).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

#: The update's metric names (:func:`jaxflow.rl.grpo_step.grpo_loss`) that verl spells otherwise.
ACTOR_NAMES = {"policy_loss": "pg_loss", "clip_fraction": "pg_clipfrac",
               "dual_clip_fraction": "pg_clipfrac_lower", "kl": "kl_loss"}

#: Host fields of a step: earlier flat name -> row name.
HOST_NAMES = {
    "reward_mean": "critic/rewards/mean", "score_mean": "critic/score/mean",
    "response_length": "response_length/mean",
    "sampler_version": "version/sampler", "trainer_version": "version/trainer",
    "sampler_version_min": "version/sampler_min", "sampler_version_max": "version/sampler_max",
    "num_gen_batches": "batch/num_gen_batches", "kept_group_fraction": "batch/kept_group_fraction",
    "synced": "sync/synced", "sync_payload_bytes": "sync/payload_bytes",
    "sync_changed_fraction": "sync/changed_fraction", "sync_bit_exact": "sync/bit_exact",
}

#: Row fields that are measurements of time (never equal across runs).
TIMING_PREFIXES = ("timing_s/", "perf/")

#: Nominal f32 peak of the host CPU process, FLOP/s: 2 cores x 3 GHz x 16 f32 FLOP/cycle (AVX2,
#: two 8-wide FMA units, counted once); all XLA:CPU devices of a process share it. Accelerators
#: use their chip's dense bf16 peak (``pallas_kernels.targets.chip_for_device_kind``).
CPU_NOMINAL_PEAK_FLOPS = 1e11


def actor_name(key: str) -> str:
    """The row name of an update metric: ``actor/`` + verl's name (:data:`ACTOR_NAMES`) or its
    own."""
    return "actor/" + ACTOR_NAMES.get(key, key)


def renamed(key: str) -> str:
    """The current row name of a field of the earlier flat rows (:data:`RENAMED`; unknown
    names are update metrics, ``actor/<name>``)."""
    return RENAMED.get(key, key if "/" in key else actor_name(key))


#: Earlier flat name -> row name, for readers of old ``metrics.jsonl`` files.
RENAMED = {**HOST_NAMES, **{k: actor_name(k) for k in ACTOR_NAMES},
           **{k: actor_name(k) for k in ("loss", "grad_norm", "entropy", "accept_rate_first",
                                         "max_abs_log_ratio_first", "accept_rate_later")}}


def deterministic_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` without its timing fields (:data:`TIMING_PREFIXES`): what two runs of the same
    config and seed must log identically."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def update_rows(history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The update metrics of a rollout's mini-batches (device scalars) as host floats: each
    averaged over the mini-batches, named :func:`actor_name`; plus the first mini-batch's
    ``actor/accept_rate_first`` and ``actor/max_abs_log_ratio_first`` (it must be on-policy)
    and, with lag > 1, ``actor/accept_rate_later`` (mean of the others)."""
    rows = jax.device_get(list(history))
    out = {actor_name(k): float(np.mean([r[k] for r in rows])) for k in rows[0]}
    out["actor/accept_rate_first"] = float(rows[0]["accept_rate"])
    out["actor/max_abs_log_ratio_first"] = float(rows[0]["max_abs_log_ratio"])
    if len(rows) > 1:
        out["actor/accept_rate_later"] = float(np.mean([r["accept_rate"] for r in rows[1:]]))
    return out


def response_length_metrics(tokens: np.ndarray, mask: np.ndarray, max_new_tokens: int,
                            stop_ids: Sequence[int]) -> dict[str, float]:
    """``response_length/{mean,max,clip_ratio}`` of a rollout.

    Args:
      tokens: [B, N] response tokens; mask: [B, N] (nonzero up to and including the EOS).
      max_new_tokens: the response cap; stop_ids: every EOS id.
    Returns:
      mean and max response tokens per row (EOS included) and the share of rows that hit
      ``max_new_tokens`` without ending on a stop id (truncated).
    """
    lengths = np.asarray(mask).sum(axis=1)
    ends = np.asarray(tokens)[:, max_new_tokens - 1] if np.shape(tokens)[1] >= max_new_tokens \
        else np.full(len(lengths), -1)
    clipped = (lengths >= max_new_tokens) & ~np.isin(ends, np.asarray(stop_ids))
    return {"response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max(initial=0)),
            "response_length/clip_ratio": float(clipped.mean()) if len(lengths) else 0.0}


def peak_flops(devices: Sequence[Any]) -> float:
    """The peak FLOP/s of ``devices``: their chip's dense bf16 peak each (accelerators known to
    ``pallas_kernels.targets``), else :data:`CPU_NOMINAL_PEAK_FLOPS` for the CPU process."""
    from pallas_kernels.targets import chip_for_device_kind

    chips = [chip_for_device_kind(getattr(d, "device_kind", "")) for d in devices]
    if devices and all(c is not None for c in chips):
        return float(sum(c.peak_flops for c in chips))
    return CPU_NOMINAL_PEAK_FLOPS


def perf_metrics(*, tokens: int, n_params: int, step_s: float, peak: float) -> dict[str, float]:
    """``perf/{step_s,tokens_per_s,mfu}`` of one RL step.

    ``tokens``: prompt + response tokens of the rollout; ``n_params``: the policy's
    parameters; ``mfu`` = model FLOPs per token (6 x n_params: forward and backward of the
    weight matmuls, as :func:`jaxflow.compile_only.program.transformer_train_flops` counts
    without attention) x tokens / (step_s x ``peak``)."""
    step_s = max(float(step_s), 1e-9)
    return {"perf/step_s": step_s, "perf/tokens_per_s": tokens / step_s,
            "perf/mfu": 6.0 * n_params * tokens / (step_s * peak)}


def version_metrics(batch: Any) -> dict[str, int]:
    """``version/sampler_min`` / ``_max``: the oldest and newest weights version that sampled a
    response token of ``batch`` (its per-token ``versions`` over the mask; -1 when unknown)."""
    seen = np.asarray(batch.versions)[np.asarray(batch.mask) > 0]
    if seen.size == 0:
        return {"version/sampler_min": -1, "version/sampler_max": -1}
    return {"version/sampler_min": int(seen.min()), "version/sampler_max": int(seen.max())}


def rollout_row(window: Sequence[Mapping[str, Any]]) -> dict:
    """``summarize`` for :func:`jaxflow.train.loop.run_steps` in RL drivers that log every
    rollout (``log_every=1``): the one step's host metrics unchanged (ints stay ints, key order
    kept), so the rows are those of :meth:`GRPOTrainer.step`."""
    (metrics,) = window
    return dict(metrics)
