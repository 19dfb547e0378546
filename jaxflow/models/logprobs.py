"""Per-token log-probs of a sequence under a live model (the notebook form of what the RL code
computes): ``token_logprobs(model, tokens)``.

It composes the same two pieces the GRPO trainer uses (:func:`jaxflow.rl.grpo.response_hidden`
then :func:`jaxflow.models.fused_logprobs.fused_logprobs`, also ``jaxflow.rl.fused_logprobs``):
the model's final hidden states and its LM head, with the log-softmax taken by
``fused_logprobs`` (f32 logits ``(hidden @ head) / T``, never holding [B, T, V] logits on the
fused backends). So a response's log-probs read off ``token_logprobs(model, prompt ++
response)`` are the trainer's ``old_stats(...).logp``, bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflow.models.fused_logprobs import fused_logprobs


def predicted_mask(tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """[B, T] bool: the positions :func:`token_logprobs` scores.

    Position t is scored when t >= 1 and, with ``segment_ids``, ``segment_ids[:, t] ==
    segment_ids[:, t - 1] != 0`` (same packed sequence, not padding): the first token of every
    row and of every packed segment has no context to be predicted from.
    """
    b, t = tokens.shape
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(t) >= 1, (b, t))
    seg = jnp.asarray(segment_ids)
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return jnp.concatenate([jnp.zeros((b, 1), bool), same], axis=1)


def token_logprobs(model: Any, tokens: jax.Array, *, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, temperature: float = 1.0,
                   backend: Any = None, return_mask: bool = False
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-prob of each token given the tokens before it: ``out[b, t] = log p(tokens[b, t] |
    tokens[b, :t])`` under ``model`` at ``temperature``.

    The model reads ``tokens[:, :-1]`` (with ``positions[:, :-1]`` / ``segment_ids[:, :-1]``);
    its hidden state at position t - 1 scores ``tokens[:, t]`` through the LM head, as the RL
    trainer does.

    Args:
      model: a :class:`jaxflow.models.Transformer` (anything with ``hidden_states(tokens,
        positions=, segment_ids=)`` and ``head_weight()``).
      tokens: [B, T] int32, T >= 2.
      positions, segment_ids: [B, T] int32 as for ``model(tokens, ...)`` (packed sequences:
        tokens attend within their own segment, 0 = padding); default arange(T) / all ones.
      temperature: logits are divided by it (> 0); 1.0 = the model's own distribution, the
        sampler's ``temperature`` to match ``SampleOutput.logprobs`` (without top-k / top-p).
      backend: ``fused_logprobs`` backend (``"auto"``, ``"xla"``, ``"pallas"``,
        ``"reference"`` or a ``LogprobBackend``); None = auto.
      return_mask: also return the [B, T] bool mask of scored positions.

    Returns:
      [B, T] float32 log-probs, **exactly 0.0 at every position that is not scored**: column 0,
      and with ``segment_ids`` the first token of each packed segment and padding (segment 0)
      -- see :func:`predicted_mask`. With ``return_mask=True``: ``(logp, mask)``.

    Raises:
      ValueError: tokens not [B, T >= 2] integers, positions / segment_ids of another shape,
        or temperature <= 0 (each naming the value).
    """
    if not hasattr(tokens, "shape") or len(tokens.shape) != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens shape {getattr(tokens, 'shape', None)}; valid: [B, T] with "
                         "T >= 2 (position t is scored from positions < t)")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens dtype {tokens.dtype}; valid: integer token ids")
    for name, x in (("positions", positions), ("segment_ids", segment_ids)):
        if x is not None and tuple(getattr(x, "shape", ())) != tuple(tokens.shape):
            raise ValueError(f"{name} shape {getattr(x, 'shape', None)} does not match tokens "
                             f"shape {tuple(tokens.shape)} [B, T]")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}; valid: > 0")
    tokens = jnp.asarray(tokens, jnp.int32)
    hidden = model.hidden_states(
        tokens[:, :-1],
        positions=None if positions is None else jnp.asarray(positions)[:, :-1],
        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids)[:, :-1])
    head = model.head_weight().astype(hidden.dtype)
    logp = fused_logprobs(hidden, head, tokens[:, 1:], temperature=temperature,
                          backend=backend).target_logp
    logp = jnp.pad(logp.astype(jnp.float32), ((0, 0), (1, 0)))
    mask = predicted_mask(tokens, segment_ids)
    logp = jnp.where(mask, logp, 0.0)
    return (logp, mask) if return_mask else logp
