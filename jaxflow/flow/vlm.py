"""The VLM's LLM side: image embeddings spliced into text, packed rows, segment attention.

A packed row holds several samples (or pieces of one, see ``packing.split_over_budget``), each
its own segment with positions restarting at its start; attention is causal within a segment.
Image placeholder tokens take their embedding from an image-embedding buffer ``[E, d]``
through ``embed_index`` (-1 for text tokens), so the same backbone function serves the
monolithic model (buffer = encoder output) and the decoupled backbone (buffer = pool contents).

Attention backend: the LM's shared switch (``jaxflow.models.attention_backends``:
``AttentionBackend`` xla / splash / flash / cudnn / auto), chosen per run (``resolve_backend``)
and passed to ``backbone_hidden`` and to the ViT encoder (bidirectional within an image,
``jaxflow.flow.steps.encoder_embeddings``); "auto" is XLA on CPU and the platform's kernel on
GPU / TPU where it builds for the step's shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxflow.mesh import DEFAULT_RULES, LogicalRules, shardings_from_logical
from jaxflow.models.attention_backends import (
    AttentionBackend,
    resolve_attention_backend,
)
from jaxflow.models.transformer import Transformer, logical_axes
from jaxflow.train.lm_state import token_nll
from jaxflow.train.state import TrainState
from pallas_kernels import dispatch

ROW_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "embed_index")


def resolve_backend(requested: str | AttentionBackend) -> AttentionBackend:
    """The backend a run asks for, checked against this process's platform: ValueError for an
    unknown name or a kernel forced off its platform (``resolve_attention_backend``)."""
    resolve_attention_backend(requested, dispatch.backend_platform())
    return AttentionBackend(requested)


def backbone_hidden(lm: Transformer, x: jax.Array, positions: jax.Array,
                    segment_ids: jax.Array, *, backend: AttentionBackend = AttentionBackend.XLA,
                    interpret: bool = False) -> jax.Array:
    """The LM's blocks + final norm on input EMBEDDINGS x [B, T, d] -> [B, T, d]:
    ``Transformer.hidden_states(inputs_embeds=x)`` with attention on ``backend``
    (``interpret=True`` runs a Pallas kernel in interpret mode, on any platform)."""
    name = backend.value if isinstance(backend, AttentionBackend) else backend
    return lm.hidden_states(inputs_embeds=x, positions=positions, segment_ids=segment_ids,
                            attention=name, interpret=interpret)


def splice(lm: Transformer, tokens: jax.Array, image_embeds: jax.Array,
           embed_index: jax.Array) -> jax.Array:
    """Token embeddings with image placeholders replaced: [B, T] + [E, d] -> [B, T, d]."""
    tok = jnp.take(lm.embedding[...], tokens, axis=0).astype(jnp.float32)
    img = jnp.take(image_embeds.astype(jnp.float32), jnp.maximum(embed_index, 0), axis=0)
    return jnp.where((embed_index >= 0)[..., None], img, tok)


def backbone_loss(lm: Transformer, image_embeds: jax.Array, rows: dict, denom: jax.Array, *,
                  backend: AttentionBackend = AttentionBackend.XLA) -> tuple[jax.Array, dict]:
    """Sum of answer-token NLL / ``denom`` (the global loss-token count, so micro-batches add up).

    Returns (loss, {"nll_sum", "correct": [B, T] bool argmax == target on loss tokens}).
    """
    x = splice(lm, rows["tokens"], image_embeds, rows["embed_index"])
    h = backbone_hidden(lm, x, rows["positions"], rows["segment_ids"], backend=backend)
    logits = jnp.einsum("btd,dv->btv", h, lm.head_weight().astype(h.dtype),
                        preferred_element_type=jnp.float32)
    nll = token_nll(logits, rows["targets"]) * rows["loss_mask"]
    correct = (jnp.argmax(logits, -1) == rows["targets"]) & (rows["loss_mask"] > 0)
    return nll.sum() / denom, {"nll_sum": nll.sum(), "correct": correct}


# -- host-side row building --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tokens ``start:stop`` of sample ``sample`` (the whole sample unless split)."""

    sample: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def bucket(n: int, granularity: int) -> int:
    """n rounded up to a multiple of ``granularity`` (shape buckets bound recompiles)."""
    return max(granularity, math.ceil(n / granularity) * granularity)


def build_rows(bins: Sequence[Sequence[Piece]], samples: Sequence[Any], row_len: int,
               n_rows: int, image_base: Callable[[int, int], int]) -> dict[str, np.ndarray]:
    """Packed rows [n_rows, row_len] for ``bins`` (one bin per row; extra rows are padding).

    ``image_base(sample, i)`` is the index in the image-embedding buffer of image i's first
    token. Positions continue across the pieces of a split sample.
    """
    if len(bins) > n_rows:
        raise ValueError(f"{len(bins)} bins do not fit {n_rows} rows")
    out = {k: np.zeros((n_rows, row_len), np.int32) for k in ROW_KEYS}
    out["loss_mask"] = np.zeros((n_rows, row_len), np.float32)
    out["embed_index"][:] = -1
    for r, pieces in enumerate(bins):
        c = 0
        for seg, p in enumerate(pieces, start=1):
            s = samples[p.sample]
            n = p.length
            if c + n > row_len:
                raise ValueError(f"bin {r} holds {c + n} tokens > row length {row_len}")
            sl = slice(c, c + n)
            out["tokens"][r, sl] = s.inputs[p.start:p.stop]
            out["targets"][r, sl] = s.targets[p.start:p.stop]
            out["loss_mask"][r, sl] = s.loss_mask[p.start:p.stop]
            out["segment_ids"][r, sl] = seg
            out["positions"][r, sl] = np.arange(p.start, p.stop)
            for i, (st, count) in enumerate(zip(s.image_starts, s.image_tokens)):
                lo, hi = max(st, p.start), min(st + count, p.stop)
                if lo < hi:
                    base = image_base(p.sample, i)
                    out["embed_index"][r, c + lo - p.start:c + hi - p.start] = (
                        base + np.arange(lo - st, hi - st))
            c += n
    return out


# -- parameters and optimizer state of one side (encoder or backbone) ---------------------


@dataclasses.dataclass(frozen=True)
class SideFunctions:
    """A module's static half (graphdef, abstract state) and its param shardings on a mesh."""

    graphdef: Any
    abstract_state: Any
    param_shardings: Any
    mesh: Mesh

    def module(self, params: Any) -> nnx.Module:
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def abstract_params(self) -> Any:
        """Pure-dict ``jax.ShapeDtypeStruct`` params in their shardings (compile-only)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            nnx.to_pure_dict(self.abstract_state), self.param_shardings)


def side_functions(factory: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh,
                   rules: LogicalRules = DEFAULT_RULES) -> SideFunctions:
    abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    axes = nnx.to_pure_dict(logical_axes(nnx.state(abstract, nnx.Param)))
    shardings = shardings_from_logical(nnx.to_pure_dict(state), axes, mesh, rules)
    return SideFunctions(graphdef, state, shardings, mesh)


def state_shardings(fns: SideFunctions, tx: optax.GradientTransformation) -> TrainState:
    """The side's :class:`TrainState` shardings: params as ``fns.param_shardings``, moments
    mirroring them, scalars replicated.

    Steps use them as out_shardings so a state's layout never changes (no recompiles)."""
    return TrainState.shardings(tx, nnx.to_pure_dict(fns.abstract_state), fns.param_shardings)


def abstract_side_state(fns: SideFunctions, tx: optax.GradientTransformation) -> TrainState:
    """The side's :class:`TrainState` as ``jax.ShapeDtypeStruct`` in :func:`state_shardings`
    (what ``Sides.place`` gives a trainer; nothing allocated)."""
    return TrainState.abstract(tx, fns.abstract_params(), fns.param_shardings)


def make_side_init(fns: SideFunctions, factory: Callable[[nnx.Rngs], nnx.Module],
                   tx: optax.GradientTransformation) -> Callable[[jax.Array], TrainState]:
    """The jitted init ``key [] -> TrainState`` whose outputs are the side's state shardings
    (:func:`init_side_state` calls it; ``--compile-only`` compiles it)."""

    def init(k):
        return TrainState.create(tx, nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(params=k)))))

    return jax.jit(init, out_shardings=state_shardings(fns, tx))


def init_side_state(fns: SideFunctions, factory: Callable[[nnx.Rngs], nnx.Module],
                    tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """A fresh :class:`TrainState` (params a pure dict) created directly in the side's
    shardings: one jitted init, no device ever holds an unsharded copy."""
    return make_side_init(fns, factory, tx)(key)
