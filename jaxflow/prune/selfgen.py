"""Model-generated text for self-calibration: a KV-cache sampling loop with a per-step
temperature schedule and a repetition penalty, and per-document perplexity scoring.

``jaxflow.models.make_sampler`` has one fixed temperature and no repetition penalty; Self-Cal
needs a temperature schedule and SGS a CTRL-style repetition penalty, so this loop reuses the
model's ``init_cache``/``decode`` and the sampler's ``sampling_log_probs`` (top-k / top-p).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.models.sampler import SamplingConfig, sampling_log_probs


_JITTED: dict[tuple[int, str], tuple] = {}


def _jit_for(fns, fn, **jit_kwargs):
    """One jitted ``fn`` per model structure (``fns`` holds unhashable nnx state)."""
    key = (id(fns), fn.__name__)
    if key not in _JITTED:
        _JITTED[key] = (fns, jax.jit(functools.partial(fn, fns), **jit_kwargs))
    return _JITTED[key][1]


def _generate(fns, params, prompts, lengths, temperatures, penalty, key, *, max_new, top_k,
              top_p, eos_id):
    model = fns.model(params)
    b, p = prompts.shape
    vocab = model.config.vocab_size
    filt = SamplingConfig(max_new_tokens=1, temperature=1.0, top_k=top_k, top_p=top_p)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    valid = positions < lengths[:, None]
    cache = model.init_cache(b, p + max_new)
    logits, cache = model.decode(prompts, cache, positions=positions, valid=valid)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    seen = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], prompts].set(valid)

    def step(carry, inputs):
        cache, logits, seen, done = carry
        t, temperature, k = inputs
        logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
        logp = sampling_log_probs(logits / temperature, filt)
        token = jax.random.categorical(k, logp, axis=-1).astype(jnp.int32)
        token = jnp.where(done, 0, token)
        live = ~done
        done = done | (token == eos_id)
        seen = seen.at[jnp.arange(b), token].set(True)
        new_logits, cache = model.decode(token[:, None], cache, positions=(lengths + t)[:, None],
                                         valid=live[:, None])
        return (cache, new_logits[:, 0], seen, done), (token, live)

    steps = jnp.arange(max_new, dtype=jnp.int32)
    keys = jax.random.split(key, max_new)
    _, (tokens, live) = jax.lax.scan(step, (cache, last, seen, jnp.zeros((b,), bool)),
                                     (steps, temperatures, keys))
    return tokens.T, live.T


def generate(fns, params, prompts: list[list[int]], *, key: jax.Array, max_new: int,
             temperatures: np.ndarray | float = 1.0, top_k: int = 0, top_p: float = 1.0,
             repetition_penalty: float = 1.0, eos_id: int = 2) -> list[list[int]]:
    """Samples a continuation of every prompt (token lists starting with BOS).

    ``temperatures``: a float or [max_new] per-step schedule. Returns prompt + continuation
    token lists, each ending at (and including) its first EOS when one was drawn.
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
    run = _jit_for(fns, _generate, static_argnames=("max_new", "top_k", "top_p", "eos_id"))
    new, live = run(params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(temps),
                          jnp.float32(repetition_penalty), key, max_new=max_new, top_k=top_k,
                          top_p=top_p, eos_id=eos_id)
    new, live = np.asarray(new), np.asarray(live)
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
