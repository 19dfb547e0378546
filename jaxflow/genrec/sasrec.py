"""SASRec-style next-item baseline (Kang & McAuley, 2018) on the project's decoder-only LM.

Tokens: 0 = padding, 1 = BOS, item i = i + 2. A request's sequence is ``[BOS, h_0 .. h_{n-1}]``
(its latest ``max_len - 1`` history items) and position t is trained to predict h_t (the
request's target after the last item): full softmax cross-entropy over the item vocabulary.
Ranking: the item logits at the last real position, top-K over all items. No instructions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow.config_domains import COUNT, POSITIVE, domains
from jaxflow.genrec.data.requests import Requests
from jaxflow.genrec.train import data_mesh, replicated_state, shard_batch
from jaxflow.models.transformer import Transformer, TransformerConfig
from jaxflow.train.loop import last_row, run_steps
from jaxflow.train.state import TrainState


@domains(max_len=COUNT, d_model=COUNT, n_layers=COUNT, n_heads=COUNT, d_ff=COUNT, steps=COUNT, batch_size=COUNT,
         lr=POSITIVE)
@dataclasses.dataclass(frozen=True)
class SASRecConfig:
    """The SASRec-style baseline: sequence length, model size and training schedule."""
    max_len: int = 33  # BOS + 32 history items
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3


def sequences(requests: Requests, max_len: int) -> dict:
    """tokens / labels / segment_ids int32[R, max_len] and last int32[R] (last real position)."""
    r = len(requests)
    tokens = np.zeros((r, max_len), np.int32)
    labels = np.zeros((r, max_len), np.int32)
    n = np.minimum((requests.history >= 0).sum(1), max_len - 1)
    for i in range(r):
        h = requests.history[i][requests.history[i] >= 0][-(max_len - 1):] if n[i] else []
        seq = [1] + [int(x) + 2 for x in h]
        tokens[i, :len(seq)] = seq
        labels[i, :len(seq)] = [int(x) + 2 for x in h] + [int(requests.target[i]) + 2]
    segment = (np.arange(max_len)[None, :] <= n[:, None]).astype(np.int32)
    return {"tokens": tokens, "labels": labels, "segment_ids": segment, "last": n.astype(np.int32)}


def _model_config(c: SASRecConfig, n_items: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=n_items + 2, d_model=c.d_model, n_layers=c.n_layers,
                             n_heads=c.n_heads, n_kv_heads=c.n_heads, d_ff=c.d_ff,
                             max_seq_len=c.max_len)


def make_sasrec_step(graphdef):
    """Jitted ``(state, batch) -> (state, {"loss"})``: full-softmax next-item cross-entropy over
    the real positions of ``batch`` (tokens / labels / segment_ids int32[B, T]); ``state`` a
    :class:`TrainState` of Transformer params."""

    def step(state: TrainState, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch["tokens"], segment_ids=batch["segment_ids"])
            logits = logits.at[..., :2].set(-1e9)  # never predict padding / BOS
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
            m = batch["segment_ids"].astype(jnp.float32)
            return jnp.sum(nll * m) / jnp.maximum(m.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    return jax.jit(step)


def fit_sasrec(requests: Requests, n_items: int, config: SASRecConfig, *, seed: int, mesh=None):
    """Trains the baseline; returns (graphdef, params, losses)."""
    mesh = data_mesh() if mesh is None else mesh
    graphdef, params = nnx.split(Transformer(_model_config(config, n_items), rngs=nnx.Rngs(seed)))
    state = replicated_state(optax.adam(config.lr), params, mesh)
    step = make_sasrec_step(graphdef)
    seqs = sequences(requests, config.max_len)
    rng = np.random.default_rng([seed, 2])

    def step_fn(state, i):
        idx = rng.integers(0, len(requests), config.batch_size)
        return step(state, shard_batch({k: v[idx] for k, v in seqs.items() if k != "last"}, mesh))

    result = run_steps(step_fn, state, steps=config.steps, summarize=last_row)
    losses = jax.device_get([row["loss"] for row in result.rows])
    return graphdef, result.state.params, [float(x) for x in losses]


def recommend_sasrec(graphdef, params, requests: Requests, config: SASRecConfig, *, k: int,
                     batch_size: int = 256) -> np.ndarray:
    """Top-k item ids int32[R, k] from the last real position's logits."""

    @jax.jit
    def run(params, tokens, segment_ids, last):
        logits = nnx.merge(graphdef, params)(tokens, segment_ids=segment_ids)
        at_last = jnp.take_along_axis(logits, last[:, None, None], 1)[:, 0, 2:]
        return jax.lax.top_k(at_last, k)[1]

    seqs = sequences(requests, config.max_len)
    r, out = len(requests), []
    for start in range(0, r, batch_size):
        idx = np.arange(start, start + batch_size) % r
        top = run(params, seqs["tokens"][idx], seqs["segment_ids"][idx], seqs["last"][idx])
        out.append(np.asarray(top)[: min(batch_size, r - start)])
    return np.concatenate(out).astype(np.int32)
