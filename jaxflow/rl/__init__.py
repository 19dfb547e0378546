"""RL policy losses: GRPO / DAPO / GSPO / CISPO / SA-GCPO with SIS, TIS, MIS and RS plug-in corrections.

Modules (one idea each):
  policy_loss   PolicyLossConfig and policy_loss (base algorithms, aggregation, metrics)
  sis           Selective Importance Sampling: envelope, acceptance test, ratio rewrite
  corrections   behaviour-policy corrections: TIS (truncated), MIS (masked), RS (rejection)
  advantages    GRPO group normalisation (with / without std), RLOO, SA-GCPO's target gate
  reward_mapping  unified reward: several business rewards -> one scalar, per-scenario weights
  logprobs      fused log-probs from hidden states + LM head, never holding [B, T, V] logits
  masks         as_bool_mask: response masks of any bool / numeric dtype as bool (nonzero = True)
  exact_gradient  exact moments of the gradient estimators on an enumerable toy policy
  tasks         verifiable tasks (prompt source + score): addition, countdown
  rewards       batched rewards from a spec (math_verify, reasoning_gym, exact_match, regex, your
                own function) and their validation (score_rewards)
  dataset_task  DatasetTask: a task over your own data rows, scored by a batched reward
  rollout       G responses per prompt on the rollout sub-mesh; train/inference mismatch knobs
  publish       publish_weights: trainer -> rollout sub-mesh
  grpo          the GRPO trainer: policy lag N, async staleness k, KL to a reference, entropy
  system        GRPOSystem: the GRPO trainer as a System (typed frozen GRPOState, pure step)
  programs      the GRPO step's jitted programs with abstract arguments (--compile-only)
  flagship_study  the flagship study: per-seed warm starts, per-run and over-seed summaries, plot
  step_metrics  the trainer's rows named as verl's (actor/*, perf/*, timing_s/*, response_length/*)
  warm_start    an lm_pretrain checkpoint (trained on the fly, cached) as the RL starting point

The SIS studies' library (their drivers, ``sis_offpolicy`` / ``sis_study``, ``sis_regime``, ``corrections_study``,
``sis_exact_gradient`` and ``bench_policy_loss``, live in ``jaxflow/main/``):
  offpolicy_cells       one GRPO run per off-policy setting and seed, the sis_offpolicy grid
  offpolicy_report      seed means, paired correction-minus-control intervals, tables, curves
  sis_regime            the regime map's settings, the in-regime test, the phase-2 choice
  sis_regime_report     the regime study's tables and plots/sis_regime_map.png
  corrections_study     every correction in each degraded regime: the cells, ranking, R3 rows
  corrections_study_report  the corrections study's tables (``python -m`` it on a run directory:
                        read-only, partial studies' missing cells shown)
  correction_overhead   each correction's loss-step overhead (alternated pairs)
  exact_gradient_study  the toy problem, sampled estimator moments, bias / variance rows
  policy_loss_bench     the SIS loss step's overhead and memory, the GRPO iteration arm

Usage::

    from jaxflow.rl import policy_loss, PolicyLossConfig
    cfg = PolicyLossConfig(algo="dapo", correction="sis")
    loss, metrics = policy_loss(logp, old_logp, adv, mask, config=cfg, key=key,
                                old_topk_logp=old_k, new_topk_logp=new_k)
"""

from jaxflow.rl.advantages import grpo_advantages, rloo_advantages, sa_gcpo_advantages, zero_positive_below_target
from jaxflow.rl.corrections import mis_weights, rs_keep_mask, tis_weights
from jaxflow.rl.dataset_task import DatasetTask
from jaxflow.rl.grpo import (
    GRPOConfig,
    GRPOTrainer,
    MiniBatch,
    OldStats,
    grpo_loss,
    make_rl_optimizer,
    old_stats,
    response_hidden,
    update_step,
)
from jaxflow.rl.logprobs import FusedLogprobsOutput, LogprobBackend, fused_logprobs
from jaxflow.rl.masks import as_bool_mask
from jaxflow.rl.policy_loss import AGGS, ALGOS, CORRECTIONS, DEFAULT_CLIP_EPS, PolicyLossConfig, policy_loss, sapo_gate
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.reward_mapping import unified_reward
from jaxflow.rl.rewards import RewardError, make_reward, score_rewards
from jaxflow.rl.rollout import RolloutBatch, RolloutSpec, RolloutWorker, make_noisy_sampler, parse_mismatch
from jaxflow.rl.sis import sis_accept, sis_log_envelope, sis_log_ratio, sis_uniforms
from jaxflow.rl.system import GRPOSetup, GRPOState, GRPOSystem
from jaxflow.rl.tasks import (
    TASKS,
    AdditionRLTask,
    CountdownTask,
    Task,
    encode_prompts,
    evaluate_expression,
    make_task,
    score_completions,
)
from jaxflow.rl.warm_start import load_pretrained_params

__all__ = [
    "AGGS", "ALGOS", "CORRECTIONS", "DEFAULT_CLIP_EPS",
    "PolicyLossConfig", "policy_loss", "sapo_gate", "as_bool_mask",
    "sis_accept", "sis_log_envelope", "sis_log_ratio", "sis_uniforms",
    "tis_weights", "mis_weights", "rs_keep_mask",
    "grpo_advantages", "rloo_advantages", "sa_gcpo_advantages", "zero_positive_below_target",
    "unified_reward",
    "fused_logprobs", "FusedLogprobsOutput", "LogprobBackend",
    "TASKS", "AdditionRLTask", "CountdownTask", "Task", "encode_prompts", "evaluate_expression",
    "make_task", "score_completions",
    "DatasetTask", "RewardError", "make_reward", "score_rewards",
    "RolloutBatch", "RolloutSpec", "RolloutWorker", "make_noisy_sampler", "parse_mismatch",
    "publish_weights",
    "GRPOConfig", "GRPOTrainer", "MiniBatch", "OldStats", "grpo_loss", "make_rl_optimizer",
    "old_stats", "response_hidden", "update_step", "load_pretrained_params",
    "GRPOSetup", "GRPOState", "GRPOSystem",
]
