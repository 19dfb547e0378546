"""Fused log-probs from hidden states and the LM head (the policy losses' input).

The implementation lives in :mod:`jaxflow.models.fused_logprobs` (a model-head op, so that
:func:`jaxflow.models.token_logprobs` can use it without the model package importing the RL
one); this module keeps the RL-side import path ``jaxflow.rl.logprobs``.
"""

from jaxflow.models.fused_logprobs import (
    DEFAULT_VOCAB_TILE,
    FusedLogprobsOutput,
    KernelUnavailable,
    LogprobBackend,
    fused_logprobs,
    fused_logprobs_reference,
    fused_logprobs_xla,
    use_pallas,
)

__all__ = [
    "DEFAULT_VOCAB_TILE",
    "FusedLogprobsOutput",
    "KernelUnavailable",
    "LogprobBackend",
    "fused_logprobs",
    "fused_logprobs_reference",
    "fused_logprobs_xla",
    "use_pallas",
]
