"""DAPO's overlong reward shaping (arXiv 2503.14476, section 3.4; verl's ``overlong_buffer``).

A response whose length exceeds ``max_response_length - buffer_len`` is penalised linearly,
from 0 at that length to ``-penalty_factor`` at ``max_response_length``::

    expected = max_response_length - buffer_len
    reward  += min(-(length - expected) / buffer_len * penalty_factor, 0)

``length`` counts the response tokens the loss sees, EOS included (verl's
``valid_response_length``). The penalty is added to the task score before the group
advantages, so a group of equal scores but different lengths gets a signal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.config_domains import COUNT, NON_NEGATIVE, domains


@domains(len=COUNT, penalty_factor=NON_NEGATIVE)
@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    """verl's ``reward_model.overlong_buffer``: ``len`` (the buffer, in tokens, >= 1 and at
    most the response cap) and ``penalty_factor`` (the penalty at the cap, >= 0). Defaults 1
    and 1.0: only a response that reaches the cap loses ``penalty_factor``."""

    len: int = 1
    penalty_factor: float = 1.0

    def __post_init__(self):
        if not isinstance(self.len, int) or self.len < 1:
            raise ValueError(f"overlong_buffer.len={self.len!r}: need an int >= 1")
        if not self.penalty_factor >= 0:
            raise ValueError(
                f"overlong_buffer.penalty_factor={self.penalty_factor!r}: need >= 0")


def overlong_penalty(lengths: jax.Array, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> jax.Array:
    """[B] penalties (<= 0) for response lengths [B] (see module doc).

    Raises:
      ValueError: ``buffer_len`` outside [1, max_response_length].
    """
    if not 1 <= buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer_len={buffer_len!r} must lie in [1, "
                         f"max_response_length={max_response_length}]")
    lengths = jnp.asarray(lengths, jnp.float32)
    exceed = lengths - (max_response_length - buffer_len)
    return jnp.minimum(-exceed / buffer_len * penalty_factor, 0.0)
