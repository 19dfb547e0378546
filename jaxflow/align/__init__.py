"""Alignment objectives on response pairs: FIGA, and its baselines SFT and DPO.

Modules (one idea each):
  marking     FIGA token marks from (original, revised) pairs via Levenshtein edit operations
  figa_loss   FigaConfig and figa_loss (token-weighted likelihood / unlikelihood)
  baselines   sft_loss, dpo_loss, sequence_logp
  pairs       FIGA-shaped pairs from a model's own samples, revised minimally by a task oracle;
              interleaved (revised, original) rows

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

__all__ = [
    "figa_marks", "figa_mark_batch", "MarkedPairs",
    "FigaConfig", "figa_loss", "figa_token_weights", "WEIGHTINGS",
    "sft_loss", "dpo_loss", "sequence_logp",
    "PairData", "Rows", "addition_answers", "build_pairs", "concat_pairs", "interleave_rows",
    "minimal_revision",
]
