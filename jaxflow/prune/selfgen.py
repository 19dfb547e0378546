"""Model-generated text for self-calibration, and per-document perplexity scoring.

Self-Cal needs a per-step temperature schedule and SGS a CTRL-style repetition penalty; both
are a logits hook (:class:`jaxflow.models.sampler.LogitsHook`) on the foundation sampler, whose
top-k / top-p filtering applies after them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.sampler import LogitsHook, SamplingConfig, make_sampler
from jaxflow.rollout.paged_attention import paged_attention

_JITTED: dict[tuple[int, str], tuple] = {}


def _jit_for(fns, fn, **jit_kwargs):
    """One jitted ``fn`` per model structure (``fns`` holds unhashable nnx state)."""
    key = (id(fns), fn.__name__)
    if key not in _JITTED:
        _JITTED[key] = (fns, jax.jit(functools.partial(fn, fns), **jit_kwargs))
    return _JITTED[key][1]


def _seen_prompt_tokens(prompts, prompt_valid, vocab_size, args):
    b = prompts.shape[0]
    return jnp.zeros((b, vocab_size), bool).at[jnp.arange(b)[:, None], prompts].set(prompt_valid)


def _penalised_scheduled_logits(logits, seen, step, args):
    """CTRL repetition penalty on the seen tokens, then the step's temperature."""
    penalty, temperatures = args
    logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
    return logits / temperatures[step]


def _mark_seen(seen, token, args):
    return seen.at[jnp.arange(seen.shape[0]), token].set(True)


#: The sampler's logits hook for self-generation; its call args are (penalty, temperatures).
SELF_GENERATION_HOOK = LogitsHook(apply=_penalised_scheduled_logits, init=_seen_prompt_tokens,
                                  update=_mark_seen)


def generate(fns, params, prompts: list[list[int]], *, key: jax.Array, max_new: int,
             temperatures: np.ndarray | float = 1.0, top_k: int = 0, top_p: float = 1.0,
             repetition_penalty: float = 1.0, eos_id: int = 2) -> list[list[int]]:
    """Samples a continuation of every prompt (token lists starting with BOS).

    ``temperatures``: a float or [max_new] per-step schedule. Returns prompt + continuation
    token lists, each ending at (and including) its first EOS when one was drawn. The decode
    is :func:`jaxflow.models.make_sampler` (one key per step for the batch) with
    :data:`SELF_GENERATION_HOOK`; the schedule and the penalty are traced call arguments, so
    new values do not recompile.
    """
    # Prompt length rounded up to a multiple of 16: one compilation serves many prompt sets.
    width = -(-max(len(p) for p in prompts) // 16) * 16
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    temps = np.broadcast_to(np.asarray(temperatures, np.float32), (max_new,))
    if np.any(temps <= 0):
        raise ValueError(f"temperatures must be > 0, got min {temps.min()}")
    config = SamplingConfig(max_new_tokens=max_new, temperature=1.0, top_k=top_k, top_p=top_p,
                            eos_id=eos_id, pad_id=0)
    sampler = make_sampler(fns.graphdef, config, logits_hook=SELF_GENERATION_HOOK,
                           decode_kernel=DecodeKernel(paged_attention))  # TPU / GPU: the kernel
    out = sampler(fns.nnx_state(params), jnp.asarray(tokens), jnp.asarray(lengths), key,
                  (jnp.float32(repetition_penalty), jnp.asarray(temps)))
    new, live = np.asarray(out.tokens), np.asarray(out.mask) > 0
    return [list(p) + new[i][live[i]].tolist() for i, p in enumerate(prompts)]


def _token_nll(fns, params, tokens, mask):
    logits = fns.model(params)(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return (nll * mask).sum(-1), mask.sum(-1)


def document_perplexity(fns, params, docs: list[list[int]], *, batch: int = 256,
                        pad_to: int | None = None) -> np.ndarray:
    """exp(mean next-token NLL) of every token list (first token is context only)."""
    length = pad_to or max(len(d) for d in docs)
    out = []
    for s in range(0, len(docs), batch):
        chunk = docs[s:s + batch]
        tokens = np.zeros((batch, length), np.int32)
        mask = np.zeros((batch, length - 1), np.float32)
        for i, d in enumerate(chunk):
            d = d[:length]
            tokens[i, :len(d)] = d
            mask[i, :len(d) - 1] = 1
        total, count = _jit_for(fns, _token_nll)(params, jnp.asarray(tokens), jnp.asarray(mask))
        out.append(np.asarray(total)[:len(chunk)] / np.maximum(np.asarray(count)[:len(chunk)], 1))
    return np.exp(np.concatenate(out))


def packed_perplexity(fns, params, batch: dict) -> float:
    """exp(mean NLL) over the scored targets of a packed batch (``loss_mask``)."""
    run = _jit_for(fns, _packed_nll)
    return float(np.exp(run(params, {k: jnp.asarray(v) for k, v in batch.items()})))


def _packed_nll(fns, params, b):
    from jaxflow.train.lm_state import token_nll

    logits = fns.model(params)(b["tokens"], positions=b["positions"], segment_ids=b["segment_ids"])
    nll = token_nll(logits, b["targets"])
    return (nll * b["loss_mask"]).sum() / jnp.maximum(b["loss_mask"].sum(), 1.0)
