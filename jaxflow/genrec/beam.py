"""Trie-constrained decoding of semantic IDs: beam search, sampling and sequence log-probs.

Every function masks each level's logits with the trie (``jaxflow.genrec.trie``), so only
codes that continue a valid item are ever emitted; everything is jit-able (fixed shapes, the
trie is a pytree argument). The policy is the *masked* distribution: log-probs are
renormalised over the allowed codes, in sampling and in :func:`constrained_logp` alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflow.genrec.model import GenRec
from jaxflow.genrec.trie import Trie

_NEG = -jnp.inf


def _masked_log_softmax(logits, allowed):
    logits = jnp.where(allowed, logits.astype(jnp.float32), _NEG)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.where(allowed, logits - jnp.where(jnp.isfinite(lse), lse, 0.0), _NEG)


def _repeat_rows(x, n):
    return jnp.repeat(x, n, axis=0)


def beam_search(model: GenRec, trie: Trie, instruction, history_codes, history_behaviour,
                history_valid, *, beam_size: int):
    """Top-``beam_size`` valid items per request by constrained beam search.

    Args:
      model: a GenRec; trie: the item trie (same levels / width).
      instruction, history_codes, history_behaviour, history_valid: see ``GenRec.encode``.
      beam_size: K >= 1 (static).

    Returns:
      (items int32[B, K], codes int32[B, K, L], scores f32[B, K]) sorted by score (sum of
      masked log-probs). A beam that found no valid item (fewer than K items exist) has score
      -inf and item -1; every other item is a valid catalogue item.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size}: need >= 1")
    c = model.config
    L, W, K = c.levels, c.width, beam_size
    memory, mvalid = model.encode(instruction, history_codes, history_behaviour, history_valid)
    kv = model.memory_kv(memory)
    b = memory.shape[0]
    root_allowed = trie.children[0] >= 0
    logp0 = _masked_log_softmax(model.decode(jnp.zeros((b, 0), jnp.int32), kv, mvalid)[:, 0],
                                root_allowed[None])
    k0 = min(K, W)
    score, code = jax.lax.top_k(logp0, k0)
    if k0 < K:
        score = jnp.pad(score, ((0, 0), (0, K - k0)), constant_values=_NEG)
        code = jnp.pad(code, ((0, 0), (0, K - k0)))
    node = jnp.where(jnp.isfinite(score), trie.children[0][code], -1)
    prefix = code[..., None]
    kv = [(_repeat_rows(k, K), _repeat_rows(v, K)) for k, v in kv]
    mvalid = _repeat_rows(mvalid, K)
    for level in range(1, L):
        logits = model.decode(prefix.reshape(b * K, level), kv, mvalid)[:, level]
        allowed = (trie.children[jnp.maximum(node, 0)] >= 0) & (node >= 0)[..., None]
        logp = _masked_log_softmax(logits.reshape(b, K, W), allowed)
        total = (score[..., None] + logp).reshape(b, K * W)
        score, flat = jax.lax.top_k(total, K)
        parent, code = flat // W, flat % W
        parent_node = jnp.take_along_axis(node, parent, 1)
        node = jnp.where(jnp.isfinite(score),
                         trie.children[jnp.maximum(parent_node, 0), code], -1)
        prefix = jnp.concatenate([jnp.take_along_axis(prefix, parent[..., None], 1),
                                  code[..., None]], axis=-1)
    items = jnp.where(jnp.isfinite(score) & (node >= 0), trie.leaf_item[jnp.maximum(node, 0)], -1)
    return items, prefix.astype(jnp.int32), score


def constrained_sample(model: GenRec, trie: Trie, instruction, history_codes,
                       history_behaviour, history_valid, *, samples: int, key: jax.Array,
                       temperature: float = 1.0):
    """``samples`` items per request drawn from the trie-masked policy (for RL groups).

    Returns:
      (items int32[B, G], codes int32[B, G, L], logp f32[B, G, L]) where logp is the masked
      log-prob of each sampled code under temperature 1 (the policy being optimised).
    """
    c = model.config
    L, G = c.levels, samples
    memory, mvalid = model.encode(instruction, history_codes, history_behaviour, history_valid)
    kv = [(_repeat_rows(k, G), _repeat_rows(v, G)) for k, v in model.memory_kv(memory)]
    mvalid = _repeat_rows(mvalid, G)
    rows = memory.shape[0] * G
    node = jnp.zeros((rows,), jnp.int32)
    prefix = jnp.zeros((rows, 0), jnp.int32)
    logps = []
    for level, k in enumerate(jax.random.split(key, L)):
        logits = model.decode(prefix, kv, mvalid)[:, level]
        allowed = trie.children[node] >= 0
        logp = _masked_log_softmax(logits, allowed)
        draw = _masked_log_softmax(logits / temperature, allowed)
        code = jax.random.categorical(k, draw, axis=-1).astype(jnp.int32)
        logps.append(jnp.take_along_axis(logp, code[:, None], 1)[:, 0])
        node = trie.children[node, code]
        prefix = jnp.concatenate([prefix, code[:, None]], axis=1)
    items = trie.leaf_item[node]
    b = memory.shape[0]
    return items.reshape(b, G), prefix.reshape(b, G, L), jnp.stack(logps, -1).reshape(b, G, L)


def constrained_logp(model: GenRec, trie: Trie, instruction, history_codes, history_behaviour,
                     history_valid, codes):
    """Masked per-token log-probs f32[B, L] of valid code tuples int32[B, L] (teacher forced)."""
    logits = model(instruction, history_codes, history_behaviour, history_valid, codes)
    node = jnp.zeros(codes.shape[:1], jnp.int32)
    out = []
    for level in range(codes.shape[1]):
        logp = _masked_log_softmax(logits[:, level], trie.children[node] >= 0)
        out.append(jnp.take_along_axis(logp, codes[:, level:level + 1], 1)[:, 0])
        node = trie.children[node, codes[:, level]]
    return jnp.stack(out, -1)
