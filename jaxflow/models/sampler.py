"""Jitted KV-cache sampler for the Transformer: prefill once, then a lax.scan of 1-token steps.

Functional form first: ``make_sampler(graphdef, config)`` returns a jitted
``fn(params_state, prompts, prompt_lengths, key) -> SampleOutput`` so that a trainer can
call it with a parameter pytree published from another sub-mesh; ``sample`` is the
notebook convenience wrapper around a live model. Options: per-row PRNG keys (a row's sample
is a function of its own key only) and a :class:`LogitsHook` applied to the logits before
sampling (a temperature schedule, a repetition penalty). ``make_decoder`` exposes the prefill
and the chunked decode separately for callers that compact rows between chunks (the MARL
rollout engine). ``decode_kernel`` (a :class:`jaxflow.models.decode_kernel.DecodeKernel`) runs
each decode step's attention through a paged decode kernel on TPU / GPU (a heads-major cache)
and the prefill's through the LM's segment attention kernel; on CPU the XLA reference,
unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.models import moe
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample; validated on construction.

    temperature 0.0 means greedy. top_k 0 and top_p 1.0 mean "off"; when both are on,
    top-k is applied first and top-p to the renormalised top-k distribution.

    Stopping: a row ends at ``eos_id``, or with ``eos_ids`` (every stop id, e.g. a chat
    model's end-of-turn and end-of-text; ``eos_id`` is then ``eos_ids[0]`` or None) at any of
    them. :attr:`stop_ids` is the tuple the samplers check.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None
    pad_id: int = 0
    eos_ids: tuple[int, ...] | None = None

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
        if self.eos_ids is not None:
            if (not isinstance(self.eos_ids, tuple) or not self.eos_ids
                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                           for i in self.eos_ids)):
                raise ValueError(f"SamplingConfig.eos_ids={self.eos_ids!r}: must be None or a "
                                 "non-empty tuple of ints >= 0")
            if self.eos_id is not None and self.eos_id != self.eos_ids[0]:
                raise ValueError(f"SamplingConfig.eos_id={self.eos_id!r} is not eos_ids[0]="
                                 f"{self.eos_ids[0]}; valid: eos_id == eos_ids[0], or None")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a row: ``eos_ids``, else ``(eos_id,)``, else () (no stop)."""
        if self.eos_ids is not None:
            return self.eos_ids
        return () if self.eos_id is None else (self.eos_id,)


def is_stop(token: jax.Array, config: SamplingConfig) -> jax.Array | None:
    """[...] bool: ``token`` is one of ``config.stop_ids``; None when the config has none (a
    single id is the one comparison ``token == eos_id``)."""
    ids = config.stop_ids
    if not ids:
        return None
    hit = token == ids[0]
    for i in ids[1:]:
        hit = hit | (token == i)
    return hit


class SampleOutput(NamedTuple):
    """Generated continuations.

    tokens:   [B, N] int32, N = max_new_tokens; pad_id after the first eos.
    logprobs: [B, N] float32, log-prob of each sampled token under the distribution it was
              actually drawn from: log_softmax(logits / T), restricted and renormalised to
              the top-k / top-p set when those are on. For greedy (T = 0) it is
              log_softmax(raw logits)[token]. 0 where mask == 0.
    mask:     [B, N] float32, 1 for generated tokens up to and including the first eos
              (the losses take it as is: any mask dtype, nonzero = True).
    lengths:  [B] int32, number of generated tokens (including eos) = mask.sum(-1).
    topk_logprobs, topk_indices: with ``behaviour_topk=K`` (:func:`make_sampler`), [B, N, K]
              float32 / int32: the K largest log-probs of the distribution each token was drawn
              from (the one ``logprobs`` is of) and their ids, descending; 0 where mask == 0.
              None otherwise.
    routing_experts, routing_gates: with ``record_routing`` (MoE models), [B, P + N - 1, L, k]:
              the expert ids (:func:`jaxflow.models.moe.expert_index_dtype`) and gates (f32) each
              MoE layer chose for the token at each position of ``prompt[:len] ++ tokens`` (the
              trainer's forward, whose last input is token N - 2), as R3 replays them
              (:mod:`jaxflow.models.moe`); positions past a row's end hold what the sampler fed
              there (pad). None otherwise.
    """

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    topk_logprobs: jax.Array | None = None
    topk_indices: jax.Array | None = None
    routing_experts: jax.Array | None = None
    routing_gates: jax.Array | None = None


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


@dataclasses.dataclass(frozen=True)
class LogitsHook:
    """A function applied to each step's logits before sampling, with an optional state
    carried through the decode (e.g. a repetition penalty's seen-token set, a temperature
    schedule indexed by the step).

    Attributes:
      apply: ``(logits [B, V], state, step int32 [], args) -> logits [B, V]``; ``step`` is the
        index of the token being drawn (0 .. max_new_tokens - 1); ``args`` is the pytree passed
        to the sampler call (traced, so new values do not recompile).
      init: ``(prompts [B, P] int32, prompt_valid [B, P] bool, vocab_size, args) -> state``;
        None: the state is None.
      update: ``(state, token [B] int32, args) -> state`` after every drawn token (pad_id for
        finished rows); None: the state is unchanged.
    """

    apply: Callable
    init: Callable | None = None
    update: Callable | None = None


class DecodeCarry(NamedTuple):
    """What one decode step hands the next: the KV cache, each row's last token [B] int32,
    whether that token is real (live [B] bool), whether the row has finished (done [B] bool)
    and the logits hook's state."""

    cache: Any
    token: jax.Array
    live: jax.Array
    done: jax.Array
    hook_state: Any


class Decoder(NamedTuple):
    """The sampler's two halves (plain functions; callers jit them):

    prefill(params_state, prompts [B, P], prompt_lengths [B], key, hook_args)
        -> (DecodeCarry, (token [B], logprob [B], live [B]))   draws token 0.
    decode(params_state, carry, prompt_lengths [B], key, hook_args, t0, n_steps)
        -> (DecodeCarry, (tokens [n, B], logprobs [n, B], live [n, B]))   draws tokens
        t0 .. t0 + n_steps - 1 (``n_steps`` static).

    ``key``: one PRNG key (step t uses ``split(key, max_new_tokens)[t]`` for the whole batch)
    or, with ``per_row_keys``, keys [B] (row b's step t uses ``fold_in(key[b], t)``, so a row's
    sample does not depend on the batch it is in, and rows may be gathered between calls).
    """

    prefill: Callable
    decode: Callable


def _step_key(key: jax.Array, t, n_new: int, per_row: bool) -> jax.Array:
    if per_row:
        return jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, t)
    return jax.random.split(key, n_new)[t]


def _draw(logits: jax.Array, key: jax.Array, config: SamplingConfig, logit_noise_std: float,
          per_row: bool, hook: LogitsHook | None, hook_state, t, hook_args):
    """Returns (token [B] int32, logprob [B] float32) for one step (:func:`draw_with_dist`)."""
    return draw_with_dist(logits, key, config, logit_noise_std, per_row, hook, hook_state, t,
                          hook_args)[:2]


def draw_with_dist(logits: jax.Array, key: jax.Array, config: SamplingConfig,
                   logit_noise_std: float, per_row: bool, hook: LogitsHook | None, hook_state, t,
                   hook_args) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (token [B] int32, logprob [B] float32, log-probs [B, V] float32 of the
    distribution the token was drawn from) for one step.

    With ``logit_noise_std > 0`` N(0, std^2) noise is added to the raw logits first (the
    train/inference-mismatch knob); then the logits hook; the log-prob is that of the
    resulting distribution.
    """
    if logit_noise_std > 0.0:
        if per_row:
            keys = jax.vmap(jax.random.split)(key)
            noise_key, key = keys[:, 0], keys[:, 1]
            noise = jax.vmap(lambda k: jax.random.normal(k, logits.shape[1:], jnp.float32))(
                noise_key)
        else:
            noise_key, key = jax.random.split(key)
            noise = jax.random.normal(noise_key, logits.shape, jnp.float32)
        logits = logits.astype(jnp.float32) + logit_noise_std * noise
    if hook is not None:
        logits = hook.apply(logits, hook_state, t, hook_args)
    logp = sampling_log_probs(logits, config)
    if config.temperature == 0.0:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    elif per_row:
        token = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(key, logp).astype(jnp.int32)
    else:
        token = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], logp


def sampled_topk(logp: jax.Array, k: int, live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The K largest of one step's sampled log-probs ``logp`` [B, V] and their ids, each
    [B, K] (float32 / int32), zero where ``live`` [B] is False; ``-inf`` entries (outside a
    top-k / top-p set) are kept as they are."""
    top_lp, top_idx = jax.lax.top_k(logp, k)
    keep = live[:, None]
    return jnp.where(keep, top_lp, 0.0), jnp.where(keep, top_idx, 0).astype(jnp.int32)


def mask_finished(token: jax.Array, logprob: jax.Array, done: jax.Array,
                  config: SamplingConfig):
    """One decode step's bookkeeping for rows that already finished.

    token / logprob / done: [B]. Finished rows emit ``pad_id`` with log-prob 0; a row that
    emits a stop id (``config.stop_ids``) is finished from the next step on. Returns (token, logprob, live, done)
    where ``live`` marks the rows whose token this step is real.
    """
    live = ~done
    token = jnp.where(live, token, config.pad_id)
    logprob = jnp.where(live, logprob, 0.0)
    stop = is_stop(token, config)
    if stop is not None:
        done = done | stop
    return token, logprob, live, done


def _check_options(config: SamplingConfig, logit_noise_std: float,
                   logits_hook: LogitsHook | None) -> None:
    if logit_noise_std < 0 or (logit_noise_std > 0 and config.temperature == 0.0):
        raise ValueError(f"logit_noise_std={logit_noise_std!r}: must be >= 0, and > 0 needs "
                         "temperature > 0 (greedy has no distribution)")
    if logits_hook is not None and not isinstance(logits_hook, LogitsHook):
        raise TypeError(f"logits_hook={logits_hook!r}: must be a LogitsHook or None")


@functools.lru_cache(maxsize=32)
def make_decoder(graphdef: nnx.GraphDef, config: SamplingConfig, logit_noise_std: float = 0.0,
                 *, per_row_keys: bool = False, logits_hook: LogitsHook | None = None,
                 behaviour_topk: int = 0, record_routing: bool = False,
                 decode_kernel: DecodeKernel | None = None) -> Decoder:
    """The prefill and chunked decode of :func:`make_sampler` as separate functions (see
    :class:`Decoder`), for callers that compact or reorder rows between decode chunks.

    ``behaviour_topk=K > 0``: every step's draws also carry the sampled distribution's top-K
    log-probs and ids (:func:`behaviour_topk`): ``(token, logprob, live, topk_logprobs [B, K],
    topk_indices [B, K])`` (stacked [n, B, K] by ``decode``). ``record_routing`` (MoE models)
    appends each MoE layer's routing (experts, gates: [B, P, L, k] for the prompt from
    ``prefill``, [B, L, k] per step from ``decode``, :func:`jaxflow.models.moe.pop_routing`).
    ``decode_kernel``: see :func:`make_sampler` (the carry's cache is then heads-major where the
    kernel is active)."""
    _check_options(config, logit_noise_std, logits_hook)
    if decode_kernel is not None and not isinstance(decode_kernel, DecodeKernel):
        raise TypeError(f"decode_kernel={decode_kernel!r}: must be a DecodeKernel or None")
    if isinstance(behaviour_topk, bool) or not isinstance(behaviour_topk, int) or behaviour_topk < 0:
        raise ValueError(f"behaviour_topk={behaviour_topk!r}: need an int >= 0 (0 = off)")
    n_new = config.max_new_tokens

    def emit(logits, done, key, t, hook_state, hook_args):
        token, logprob, logp = draw_with_dist(logits, _step_key(key, t, n_new, per_row_keys), config,
                                              logit_noise_std, per_row_keys, logits_hook, hook_state, t,
                                              hook_args)
        token, logprob, live, done = mask_finished(token, logprob, done, config)
        if logits_hook is not None and logits_hook.update is not None:
            hook_state = logits_hook.update(hook_state, token, hook_args)
        draws = (token, logprob, live)
        if behaviour_topk:
            draws += sampled_topk(logp, behaviour_topk, live)
        return draws, done, hook_state

    def merged(params_state) -> Transformer:
        model = nnx.merge(graphdef, params_state)
        if record_routing:
            moe.record_routing(model)
        return model

    def kernel() -> DecodeKernel | None:  # decided per trace (the platform), the same in both
        return decode_kernel if decode_kernel is not None and decode_kernel.active() else None

    def routed(model, draws, squeeze=False):
        if not record_routing:
            return draws
        return draws + tuple(r[:, 0] if squeeze else r for r in moe.pop_routing(model))

    def prefill(params_state, prompts, prompt_lengths, key, hook_args=None):
        model: Transformer = merged(params_state)
        b, p = prompts.shape
        if p + n_new > model.config.max_seq_len:
            raise ValueError(
                f"prompt length {p} + max_new_tokens {n_new} exceeds the model's "
                f"max_seq_len={model.config.max_seq_len}")
        prompt_lengths = prompt_lengths.astype(jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        prompt_valid = positions < prompt_lengths[:, None]
        paged = kernel()
        if paged is None:
            cache = model.init_cache(b, p + n_new)
        else:
            cache = paged.init_cache(model.config, b, p + n_new)
        logits, cache = model.decode(
            prompts, cache, positions=positions, valid=prompt_valid,
            cache_attention=paged and paged.prefill_cache_attention(model.config))
        last = jnp.clip(prompt_lengths - 1, 0, p - 1)
        last_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        hook_state = None
        if logits_hook is not None and logits_hook.init is not None:
            hook_state = logits_hook.init(prompts, prompt_valid, last_logits.shape[-1], hook_args)
        draws, done, hook_state = emit(
            last_logits, jnp.zeros((b,), bool), key, jnp.int32(0), hook_state, hook_args)
        return DecodeCarry(cache, draws[0], draws[2], done, hook_state), routed(model, draws)

    def decode(params_state, carry, prompt_lengths, key, hook_args, t0, n_steps):
        prompt_lengths = prompt_lengths.astype(jnp.int32)
        paged = kernel()

        def step(carry, t):
            model = merged(params_state)  # merged per step: its MoE layers record inside the scan
            logits, cache = model.decode(carry.token[:, None], carry.cache,
                                         positions=(prompt_lengths + t - 1)[:, None],
                                         valid=carry.live[:, None],
                                         cache_attention=paged and paged.cache_attention)
            draws, done, hook_state = emit(logits[:, 0], carry.done, key, t, carry.hook_state,
                                           hook_args)
            return DecodeCarry(cache, draws[0], draws[2], done, hook_state), routed(model, draws, True)

        return jax.lax.scan(step, carry, t0 + jnp.arange(n_steps, dtype=jnp.int32))

    return Decoder(prefill, decode)


@functools.lru_cache(maxsize=32)
def make_sampler(graphdef: nnx.GraphDef, config: SamplingConfig, logit_noise_std: float = 0.0,
                 *, per_row_keys: bool = False, logits_hook: LogitsHook | None = None,
                 behaviour_topk: int = 0, record_routing: bool = False,
                 decode_kernel: DecodeKernel | None = None) -> Callable:
    """Builds a jitted sampler for one model structure and sampling config.

    ``logit_noise_std > 0`` adds fresh N(0, std^2) noise to the raw logits of every sampled
    step (needs temperature > 0); the returned log-probs are those of the noisy distribution.
    ``logits_hook`` (a :class:`LogitsHook`) is applied to every step's logits (after the
    noise) before sampling; log-probs are those of the hooked distribution.
    ``behaviour_topk=K > 0`` also records, per token, the K largest log-probs of the
    distribution it was drawn from and their ids (``SampleOutput.topk_logprobs`` /
    ``topk_indices`` [B, N, K]; the proposal top-K of SIS with the behaviour policy).
    ``record_routing`` (MoE models) also records each MoE layer's expert ids and gates per
    position (``SampleOutput.routing_*``, what R3 replays).
    ``decode_kernel`` (:class:`jaxflow.models.decode_kernel.DecodeKernel`): on TPU / GPU (or in
    its interpret mode) each decode step attends through that paged decode kernel over a
    heads-major cache of P + max_new_tokens slots rounded up to its page, and the prefill
    through the segment attention kernel (splash / cuDNN / flash; the XLA reference for
    capacity-dispatch MoE models: :meth:`DecodeKernel.prefill_cache_attention`); on CPU the
    XLA reference runs, bit for bit as without it.

    Returns:
      fn(params_state, prompts, prompt_lengths, key, hook_args=None) -> SampleOutput where
        params_state: the state half of nnx.split(model) (or any state that merges with
          graphdef);
        prompts: [B, P] int32, right-padded with pad_id;
        prompt_lengths: [B] int32 in [1, P]; row b continues after its own prompt, at RoPE
          position prompt_lengths[b] + t;
        key: PRNG key (split per step, unused when greedy), or with ``per_row_keys`` keys [B]
          (row b's step t draws with ``fold_in(key[b], t)``);
        hook_args: any pytree handed to the logits hook (traced).
      The KV cache has P + max_new_tokens slots, which must be <= the model's max_seq_len.
    """
    dec = make_decoder(graphdef, config, logit_noise_std, per_row_keys=per_row_keys,
                       logits_hook=logits_hook, behaviour_topk=behaviour_topk,
                       record_routing=record_routing, decode_kernel=decode_kernel)
    n_draws = 3 + 2 * bool(behaviour_topk)

    def run(params_state, prompts, prompt_lengths, key, hook_args=None) -> SampleOutput:
        carry, first = dec.prefill(params_state, prompts, prompt_lengths, key, hook_args)
        _, rest = dec.decode(params_state, carry, prompt_lengths, key, hook_args, jnp.int32(1),
                             config.max_new_tokens - 1)
        # step-major [n, B, ...] -> [B, N, ...], the prefill's draw first
        tokens, logprobs, live, *topk = (jnp.concatenate([a[:, None], jnp.moveaxis(b, 0, 1)], axis=1)
                                         for a, b in zip(first[:n_draws], rest[:n_draws]))
        mask = live.astype(jnp.float32)
        routing = [_by_position(p, r, prompt_lengths) for p, r in zip(first[n_draws:], rest[n_draws:])]
        if routing and not topk:
            topk = [None, None]
        return SampleOutput(tokens, logprobs, mask, mask.sum(axis=1).astype(jnp.int32), *topk, *routing)

    return jax.jit(run)


def _by_position(prompt_part: jax.Array, steps: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
    """[B, P + n, ...]: the prefill's record [B, P, ...] at positions 0 .. P - 1, then decode
    step t's [n, B, ...] (t = 1 .. n, which fed token t - 1) at position ``len_b + t - 1``."""
    b, n = prompt_part.shape[0], steps.shape[0]
    out = jnp.concatenate([prompt_part, jnp.zeros((b, n) + prompt_part.shape[2:], prompt_part.dtype)], axis=1)
    pos = prompt_lengths.astype(jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    return out.at[jnp.arange(b)[:, None], pos].set(jnp.moveaxis(steps, 0, 1))


def sample(model: Transformer, prompts: jax.Array, prompt_lengths: jax.Array, *,
           key: jax.Array, config: SamplingConfig, per_row_keys: bool = False,
           logits_hook: LogitsHook | None = None, hook_args: Any = None) -> SampleOutput:
    """Samples continuations from a live model (see make_sampler for shapes and options)."""
    graphdef, state = nnx.split(model)
    fn = make_sampler(graphdef, config, per_row_keys=per_row_keys, logits_hook=logits_hook)
    return fn(state, prompts, prompt_lengths, key, hook_args)
