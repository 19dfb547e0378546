"""Jitted KV-cache sampler for the Transformer: prefill once, then a lax.scan of 1-token steps.

Functional form first: ``make_sampler(graphdef, config)`` returns a jitted
``fn(params_state, prompts, prompt_lengths, key) -> SampleOutput`` so that a trainer can
call it with a parameter pytree published from another sub-mesh; ``sample`` is the
notebook convenience wrapper around a live model.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample; validated on construction.

    temperature 0.0 means greedy. top_k 0 and top_p 1.0 mean "off"; when both are on,
    top-k is applied first and top-p to the renormalised top-k distribution.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None
    pad_id: int = 0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingConfig.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if not self.temperature >= 0:
            raise ValueError(
                f"SamplingConfig.temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k!r}: must be an int >= 0 "
                             "(0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p={self.top_p!r}: must be in (0, 1] "
                             "(1 = off)")
        if self.eos_id is not None and (not isinstance(self.eos_id, int) or self.eos_id < 0):
            raise ValueError(f"SamplingConfig.eos_id={self.eos_id!r}: must be None or an "
                             "int >= 0")
        if not isinstance(self.pad_id, int) or self.pad_id < 0:
            raise ValueError(f"SamplingConfig.pad_id={self.pad_id!r}: must be an int >= 0")


class SampleOutput(NamedTuple):
    """Generated continuations.

    tokens:   [B, N] int32, N = max_new_tokens; pad_id after the first eos.
    logprobs: [B, N] float32, log-prob of each sampled token under the distribution it was
              actually drawn from: log_softmax(logits / T), restricted and renormalised to
              the top-k / top-p set when those are on. For greedy (T = 0) it is
              log_softmax(raw logits)[token]. 0 where mask == 0.
    mask:     [B, N] float32, 1 for generated tokens up to and including the first eos.
    lengths:  [B] int32, number of generated tokens (including eos) = mask.sum(-1).
    """

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array


def sampling_log_probs(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """Log-probs of the distribution tokens are drawn from (before the greedy special case).

    Args:
      logits: [B, V] float32 raw logits.

    Returns:
      [B, V] float32 log-probs; -inf outside the top-k / top-p set. With temperature 0
      this is log_softmax(logits) (no truncation), the convention for greedy logprobs.
      Ties at the top-k / top-p boundary are all kept.
    """
    logits = logits.astype(jnp.float32)
    if config.temperature == 0.0:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, config.top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if config.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the top token always kept).
        keep = mass_before < config.top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def _draw(logits: jax.Array, key: jax.Array, config: SamplingConfig, logit_noise_std: float = 0.0):
    """Returns (token [B] int32, logprob [B] float32) for one step.

    With ``logit_noise_std > 0`` N(0, std^2) noise is added to the raw logits first (the
    train/inference-mismatch knob); the log-prob is then that of the noisy distribution.
    """
    if logit_noise_std > 0.0:
        noise_key, key = jax.random.split(key)
        logits = logits.astype(jnp.float32) + logit_noise_std * jax.random.normal(
            noise_key, logits.shape, jnp.float32)
    logp = sampling_log_probs(logits, config)
    if config.temperature == 0.0:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        token = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def mask_finished(token: jax.Array, logprob: jax.Array, done: jax.Array,
                  config: SamplingConfig):
    """One decode step's bookkeeping for rows that already finished.

    token / logprob / done: [B]. Finished rows emit ``pad_id`` with log-prob 0; a row that
    emits ``eos_id`` is finished from the next step on. Returns (token, logprob, live, done)
    where ``live`` marks the rows whose token this step is real.
    """
    live = ~done
    token = jnp.where(live, token, config.pad_id)
    logprob = jnp.where(live, logprob, 0.0)
    if config.eos_id is not None:
        done = done | (token == config.eos_id)
    return token, logprob, live, done


@functools.lru_cache(maxsize=32)
def make_sampler(graphdef: nnx.GraphDef, config: SamplingConfig, logit_noise_std: float = 0.0) -> Callable:
    """Builds a jitted sampler for one model structure and sampling config.

    ``logit_noise_std > 0`` adds fresh N(0, std^2) noise to the raw logits of every sampled
    step (needs temperature > 0); the returned log-probs are those of the noisy distribution.

    Returns:
      fn(params_state, prompts, prompt_lengths, key) -> SampleOutput where
        params_state: the state half of nnx.split(model) (or any state that merges with
          graphdef);
        prompts: [B, P] int32, right-padded with pad_id;
        prompt_lengths: [B] int32 in [1, P]; row b continues after its own prompt, at RoPE
          position prompt_lengths[b] + t;
        key: PRNG key (split per step, unused when greedy).
      The KV cache has P + max_new_tokens slots, which must be <= the model's max_seq_len.
    """
    if logit_noise_std < 0 or (logit_noise_std > 0 and config.temperature == 0.0):
        raise ValueError(f"logit_noise_std={logit_noise_std!r}: must be >= 0, and > 0 needs "
                         "temperature > 0 (greedy has no distribution)")
    n_new = config.max_new_tokens

    def run(params_state, prompts, prompt_lengths, key) -> SampleOutput:
        model: Transformer = nnx.merge(graphdef, params_state)
        b, p = prompts.shape
        if p + n_new > model.config.max_seq_len:
            raise ValueError(
                f"prompt length {p} + max_new_tokens {n_new} exceeds the model's "
                f"max_seq_len={model.config.max_seq_len}")
        prompt_lengths = prompt_lengths.astype(jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        prompt_valid = positions < prompt_lengths[:, None]
        cache = model.init_cache(b, p + n_new)
        logits, cache = model.decode(prompts, cache, positions=positions, valid=prompt_valid)
        last = jnp.clip(prompt_lengths - 1, 0, p - 1)
        last_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        step_keys = jax.random.split(key, n_new)

        def emit(logits, done, step_key):
            token, logprob = _draw(logits, step_key, config, logit_noise_std)
            return mask_finished(token, logprob, done, config)

        def step(carry, step_key):
            cache, token, live, done, t = carry
            positions = (prompt_lengths + t - 1)[:, None]
            logits, cache = model.decode(token[:, None], cache, positions=positions,
                                         valid=live[:, None])
            token, logprob, live, done = emit(logits[:, 0], done, step_key)
            return (cache, token, live, done, t + 1), (token, logprob, live)

        done0 = jnp.zeros((b,), bool)
        token0, logprob0, live0, done = emit(last_logits, done0, step_keys[0])
        carry = (cache, token0, live0, done, jnp.int32(1))
        _, (tokens, logprobs, live) = jax.lax.scan(step, carry, step_keys[1:])
        tokens = jnp.concatenate([token0[:, None], tokens.T], axis=1)
        logprobs = jnp.concatenate([logprob0[:, None], logprobs.T], axis=1)
        mask = jnp.concatenate([live0[:, None], live.T], axis=1).astype(jnp.float32)
        return SampleOutput(tokens=tokens, logprobs=logprobs, mask=mask,
                            lengths=mask.sum(axis=1).astype(jnp.int32))

    return jax.jit(run)


def sample(model: Transformer, prompts: jax.Array, prompt_lengths: jax.Array, *,
           key: jax.Array, config: SamplingConfig) -> SampleOutput:
    """Samples continuations from a live model (see make_sampler for shapes)."""
    graphdef, state = nnx.split(model)
    return make_sampler(graphdef, config)(state, prompts, prompt_lengths, key)
