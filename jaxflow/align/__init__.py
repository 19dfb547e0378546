"""Alignment objectives on response pairs: FIGA, and its baselines SFT and DPO.

Modules (one idea each):
  marking     FIGA token marks from (original, revised) pairs via Levenshtein edit operations
  figa_loss   FigaConfig and figa_loss (token-weighted likelihood / unlikelihood)
  baselines   sft_loss, dpo_loss, sequence_logp
  pairs       FIGA-shaped pairs from a model's own samples, revised minimally by a task oracle;
              interleaved (revised, original) rows
  sampling    a seed's pair pool from a rollout worker's samples (sample_pairs), its sizes
  policy      what a method trains: the warm start or LoRA adapters over it (lora_policy)
  train       method_loss / make_method_step (SFT, DPO, FIGA), batch_schedule, train_method
  report      per-method aggregates over seeds, the markdown table, the curves' plot

Usage::

    from jaxflow.align import figa_marks, figa_loss, FigaConfig
    orig_marks, rev_marks = figa_marks([5, 7, 2], [5, 8, 2], eos_id=2)
    loss, metrics = figa_loss(logp, marks, mask, revised, config=FigaConfig())
"""

from jaxflow.align.baselines import dpo_loss, sequence_logp, sft_loss
from jaxflow.align.figa_loss import WEIGHTINGS, FigaConfig, figa_loss, figa_token_weights
from jaxflow.align.marking import MarkedPairs, figa_mark_batch, figa_marks
from jaxflow.align.pairs import (
    PairData,
    Rows,
    addition_answers,
    build_pairs,
    concat_pairs,
    interleave_rows,
    minimal_revision,
)
from jaxflow.align.policy import Policy, lora_info, lora_policy
from jaxflow.align.report import aggregate, format_table, plot_curves
from jaxflow.align.sampling import pair_stats, sample_pairs
from jaxflow.align.train import batch_schedule, make_method_step, method_loss, row_logp, train_method

__all__ = [
    "figa_marks", "figa_mark_batch", "MarkedPairs",
    "FigaConfig", "figa_loss", "figa_token_weights", "WEIGHTINGS",
    "sft_loss", "dpo_loss", "sequence_logp",
    "PairData", "Rows", "addition_answers", "build_pairs", "concat_pairs", "interleave_rows",
    "minimal_revision",
    "sample_pairs", "pair_stats", "Policy", "lora_policy", "lora_info",
    "batch_schedule", "row_logp", "method_loss", "make_method_step", "train_method",
    "aggregate", "format_table", "plot_curves",
]
