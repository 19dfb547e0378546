"""Sequential (layer-by-layer) pruning of the foundation LM (``jaxflow.models.Transformer``).

``prune(params, calibration_batches, sparsity, method=...)`` walks the decoder blocks in order.
Inside a block the linear layers are pruned "true-sequentially" in four groups, each group's
calibration inputs computed with everything before it ALREADY PRUNED:

  attn_in  (wq, wk, wv  <- attn_norm(x))        attn_out (wo     <- attention output)
  mlp_in   (w_gate, w_up <- mlp_norm(x + attn)) mlp_out  (w_down <- silu(gate) * up)

and the next block sees the pruned block's output. Embedding, norms and the LM head are kept
dense (as in SparseGPT/Wanda). ``feed="dense"`` instead feeds every layer the dense model's
activations (the one-shot variant, useful to measure what sequential feeding buys).

Weights are stored as the model uses them (input axes first: wq [d, H, hd], wo [H, hd, d],
w_gate [d, f], w_down [f, d]); they are viewed as [outputs, inputs] matrices for pruning.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.models.attention import dot_product_attention, segment_causal_mask
from jaxflow.models.transformer import Block, TransformerConfig
from jaxflow.prune.baselines import magnitude_prune, wanda_prune
from jaxflow.prune.masks import SparsityPattern, parse_sparsity
from jaxflow.prune.sparsegpt import hessian_init, hessian_update, sparsegpt_prune

METHODS: dict[str, Callable] = {
    "sparsegpt": sparsegpt_prune,
    "wanda": wanda_prune,
    "magnitude": magnitude_prune,
}

#: (group, ((module, weight, number of leading input axes), ...)) in pruning order.
LINEAR_GROUPS = (
    ("attn_in", (("attn", "wq", 1), ("attn", "wk", 1), ("attn", "wv", 1))),
    ("attn_out", (("attn", "wo", 2),)),
    ("mlp_in", (("mlp", "w_gate", 1), ("mlp", "w_up", 1))),
    ("mlp_out", (("mlp", "w_down", 1),)),
)


@dataclasses.dataclass(frozen=True)
class PrunedMatrix:
    """What happened to one weight matrix."""

    layer: int
    name: str  # e.g. "attn.wq"
    shape: tuple[int, int]  # [outputs, inputs] as pruned
    sparsity: float  # realised fraction of zeros
    calib_error: float  # tr(dW H dW^T) / tr(W H W^T) on the calibration inputs
    seconds: float


def infer_model_config(params: Mapping[str, Any], **overrides) -> TransformerConfig:
    """TransformerConfig from a param tree's shapes; ``overrides`` supply what shapes cannot
    tell (max_seq_len, rope_theta, norm_eps, dtype) and default to TransformerConfig's."""
    layers = params["layers"]
    first = layers[sorted(layers, key=int)[0]]
    d, h, hd = np.shape(first["attn"]["wq"])
    fields = dict(vocab_size=int(np.shape(params["embedding"])[0]), d_model=int(d),
                  n_layers=len(layers), n_heads=int(h), n_kv_heads=int(np.shape(first["attn"]["wk"])[1]),
                  d_ff=int(np.shape(first["mlp"]["w_gate"])[1]), tie_embeddings="lm_head" not in params)
    fields.update(overrides)
    return TransformerConfig(**fields)


def as_batch(batch: Any) -> dict[str, jax.Array]:
    """A calibration batch as ``{"tokens", "segment_ids", "positions"}``, each int32 [B, T].

    ``batch``: tokens [B, T] int, or a dict with ``tokens`` and optionally ``segment_ids``
    (0 = padding; default all 1) and ``positions`` (default 0..T-1; required with segment_ids).
    """
    if isinstance(batch, Mapping):
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        seg = batch.get("segment_ids")
        pos = batch.get("positions")
    else:
        tokens, seg, pos = jnp.asarray(batch, jnp.int32), None, None
    if tokens.ndim != 2:
        raise ValueError(f"calibration tokens must be [batch, seq], got shape {tokens.shape}")
    b, t = tokens.shape
    if seg is None:
        seg = jnp.ones((b, t), jnp.int32)
    if pos is None:
        if isinstance(batch, Mapping) and batch.get("segment_ids") is not None:
            raise ValueError("calibration batch has segment_ids but no positions")
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return {"tokens": tokens, "segment_ids": jnp.asarray(seg, jnp.int32),
            "positions": jnp.asarray(pos, jnp.int32)}


class BlockRunner:
    """Jitted pieces of one decoder block of ``config``, on a pure-dict layer's params.

    ``stage_input(layer, x, positions, segment_ids, stage=...)``: the inputs [B, T, d_in] of one
    of :data:`LINEAR_GROUPS`' stages for hidden states ``x`` [B, T, d_model];
    ``forward(layer, x, positions, segment_ids)``: the block's output [B, T, d_model].
    """

    def __init__(self, config: TransformerConfig):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Block(config, rngs=nnx.Rngs(0))))
        self.graphdef, self.abstract = graphdef, abstract
        self.stage_input = jax.jit(self._stage_input, static_argnames=("stage",))
        self.forward = jax.jit(self._forward)

    def _block(self, layer_params) -> Block:
        state = jax.tree.map(lambda x: x, self.abstract)
        nnx.replace_by_pure_dict(state, layer_params)
        return nnx.merge(self.graphdef, state)

    def _stage_input(self, layer_params, x, positions, segment_ids, *, stage: str):
        block = self._block(layer_params)
        h = block.attn_norm(x)
        if stage == "attn_in":
            return h
        q, k, v = block.attn.project_qkv(h, positions)
        attn = dot_product_attention(q, k, v, segment_causal_mask(segment_ids))
        if stage == "attn_out":
            return attn.reshape(*attn.shape[:2], -1)
        m = block.mlp_norm(x + block.attn.project_out(attn))
        if stage == "mlp_in":
            return m
        dt = block.mlp.dtype
        return jax.nn.silu(m @ block.mlp.w_gate[...].astype(dt)) * (m @ block.mlp.w_up[...].astype(dt))

    def _forward(self, layer_params, x, positions, segment_ids):
        return self._block(layer_params)(x, positions, segment_causal_mask(segment_ids))


@functools.lru_cache(maxsize=8)
def block_runner(config: TransformerConfig) -> BlockRunner:
    """The :class:`BlockRunner` of ``config``, shared (its jitted functions compile once)."""
    return BlockRunner(config)


def _to_matrix(w: jax.Array, n_in_axes: int) -> jax.Array:
    n_in = int(np.prod(w.shape[:n_in_axes]))
    return w.reshape(n_in, -1).T


def _from_matrix(m: jax.Array, like: jax.Array) -> jax.Array:
    return m.T.reshape(like.shape).astype(like.dtype)


@jax.jit
def _relative_calib_error(w, p, h):
    dw = (w - p).astype(jnp.float32)
    w = w.astype(jnp.float32)
    return jnp.sum((dw @ h) * dw) / jnp.sum((w @ h) * w)


def prune(params: Mapping[str, Any], calibration_batches: Iterable[Any], sparsity: float | str, *,
          method: str = "sparsegpt", model_config: TransformerConfig | None = None,
          feed: str = "pruned", block_size: int = 128, damp: float = 0.01,
          log: Callable[[str], None] | None = None) -> tuple[dict, list[PrunedMatrix]]:
    """Prunes every decoder linear layer of a foundation-LM param tree.

    Args:
      params: pure-dict params of ``jaxflow.models.Transformer`` (e.g. ``state["params"]`` of an
        ``lm_pretrain`` checkpoint).
      calibration_batches: iterable of token arrays [B, T] int, or dicts with ``tokens`` and
        optionally ``segment_ids`` (0 = padding, excluded from the Hessians) and ``positions``.
      sparsity: fraction in (0, 1) or "N:M" (e.g. "2:4").
      method: "sparsegpt", "wanda" or "magnitude".
      model_config: the model's TransformerConfig; default ``infer_model_config(params,
        max_seq_len=T)`` (RoPE theta / norm eps at TransformerConfig defaults).
      feed: "pruned" (sequential, the default) or "dense" (every layer sees dense activations).
      block_size, damp: SparseGPT settings (see ``sparsegpt_prune``).
      log: optional callable for one line per block.

    Returns:
      (pruned params with the same structure and dtypes, one PrunedMatrix per weight matrix).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}; valid: {', '.join(METHODS)}")
    if feed not in ("pruned", "dense"):
        raise ValueError(f"feed={feed!r}; valid: 'pruned', 'dense'")
    pattern = parse_sparsity(sparsity)
    batches = [as_batch(b) for b in calibration_batches]
    if not batches:
        raise ValueError("prune needs at least one calibration batch")
    if model_config is None:
        model_config = infer_model_config(params, max_seq_len=max(b["tokens"].shape[1] for b in batches))
    runner = block_runner(model_config)
    out = jax.tree.map(lambda x: x, dict(params))
    out["layers"] = dict(params["layers"])
    emb = jnp.asarray(params["embedding"])
    xs = [jnp.take(emb, b["tokens"], axis=0).astype(model_config.compute_dtype) for b in batches]
    dense_xs = list(xs) if feed == "dense" else None
    report: list[PrunedMatrix] = []
    for layer_idx, key in enumerate(sorted(params["layers"], key=int)):
        dense_layer = params["layers"][key]
        layer, rows = prune_block(runner, dense_layer, batches, xs, dense_xs, pattern, method=method,
                                  layer_idx=layer_idx, block_size=block_size, damp=damp)
        report += rows
        xs = [runner.forward(layer, x, b["positions"], b["segment_ids"]) for b, x in zip(batches, xs)]
        if dense_xs is not None:
            dense_xs = [runner.forward(dense_layer, x, b["positions"], b["segment_ids"])
                        for b, x in zip(batches, dense_xs)]
        out["layers"][key] = layer
        if log is not None:
            errs = [r.calib_error for r in rows]
            log(f"pruned layer {layer_idx} ({method}, {pattern}): mean calib error {np.mean(errs):.4g}")
    return out, report


def prune_block(runner: BlockRunner, dense_layer: Mapping[str, Any], batches: Sequence[Mapping[str, jax.Array]],
                xs: Sequence[jax.Array], dense_xs: Sequence[jax.Array] | None, pattern: SparsityPattern, *,
                method: str = "sparsegpt", layer_idx: int = 0, block_size: int = 128,
                damp: float = 0.01) -> tuple[dict, list[PrunedMatrix]]:
    """Prunes one decoder block "true-sequentially" (the four :data:`LINEAR_GROUPS` in order).

    Args:
      runner: the model's :class:`BlockRunner`.
      dense_layer: the block's dense pure-dict params.
      batches: the calibration batches (:func:`as_batch`), [B, T] each.
      xs: the hidden states [B, T, d_model] entering this block, one per batch (the pruned
        model's: each group is calibrated on the block with the groups before it pruned).
      dense_xs: the dense model's hidden states instead (``feed="dense"``), or None.
      pattern: the sparsity (:func:`jaxflow.prune.masks.parse_sparsity`).
      method, layer_idx, block_size, damp: as in :func:`prune` (``layer_idx`` names the rows).

    Returns:
      (the pruned block's params, one :class:`PrunedMatrix` per weight matrix).
    """
    prune_fn = METHODS[method]
    layer = {mod: dict(v) if isinstance(v, Mapping) else v for mod, v in dense_layer.items()}
    report: list[PrunedMatrix] = []
    for stage, members in LINEAR_GROUPS:
        feed_layer, feed_xs = (dense_layer, dense_xs) if dense_xs is not None else (layer, xs)
        hess = None
        for b, x in zip(batches, feed_xs):
            act = runner.stage_input(feed_layer, x, b["positions"], b["segment_ids"], stage=stage)
            hess = hessian_update(hess or hessian_init(act.shape[-1]), act, b["segment_ids"] > 0)
        for module, wname, n_in in members:
            start = time.perf_counter()
            w = jnp.asarray(dense_layer[module][wname])
            matrix = _to_matrix(w, n_in)
            pruned, mask = prune_fn(matrix, hess.h, pattern, block_size=block_size, damp=damp,
                                    name=f"layer {layer_idx} {module}.{wname}")
            pruned = jax.block_until_ready(pruned)
            seconds = time.perf_counter() - start
            layer[module][wname] = _from_matrix(pruned, w)
            report.append(PrunedMatrix(
                layer=layer_idx, name=f"{module}.{wname}", shape=tuple(matrix.shape),
                sparsity=float(jnp.mean(pruned == 0)),
                calib_error=float(_relative_calib_error(matrix, pruned, hess.h)), seconds=seconds))
    return layer, report
