"""The pruning pipeline as a :class:`jaxflow.system.System`: one step prunes one decoder block.

``PruneSystem(params, calibration)`` holds a dense foundation LM's pure-dict params and its
calibration batches; ``init(PruneConfig(sparsity=0.6), meshes, key)`` embeds the calibration
tokens; every ``step`` prunes the next block "true-sequentially" (``jaxflow.prune.sequential``:
its four linear groups in order, each calibrated on the block with the groups before it pruned)
and feeds the pruned block's output to the next one; ``evaluate`` scores the pruned model (an
``evaluator`` such as ``jaxflow.prune.capabilities.CapabilityEvaluator``) and, given the dense
model's scores, the retention = pruned / dense. Running it to the end gives exactly
``jaxflow.prune.sequential.prune``'s params and report (the same functions, in the same order).

    system = PruneSystem(dense_params, batches, evaluator=evaluator, dense_scores=dense)
    state = system.run(PruneConfig(sparsity="2:4"))          # init + one step per block
    system.evaluate(state)    # {"score/math": ..., "retention/math": ..., "retention/total": ...}

Pruning is deterministic (``key`` is accepted and unused) and runs where the params live (the
meshes are used only by :meth:`PruneSystem.programs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.compile_only.program import Program
from jaxflow.models.transformer import TransformerConfig
from jaxflow.prune.capabilities import retention
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.sequential import (
    LINEAR_GROUPS,
    METHODS,
    BlockRunner,
    PrunedMatrix,
    as_batch,
    block_runner,
    infer_model_config,
    prune_block,
)
from jaxflow.prune.sparsegpt import hessian_init, hessian_update
from jaxflow.system import static_field, system_state
from jaxflow.train.loop import last_row, run_steps

__all__ = ["PruneConfig", "PruneState", "PruneSystem"]

FEEDS = ("pruned", "dense")


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """How to prune: ``sparsity`` a fraction in (0, 1) or "N:M"; ``method`` one of
    :data:`jaxflow.prune.sequential.METHODS`; ``feed`` "pruned" (sequential) or "dense" (every
    block calibrated on the dense model's activations); ``block_size`` / ``damp`` SparseGPT's;
    ``model`` the LM's config (None: inferred from the params' shapes, max_seq_len = T)."""

    sparsity: float | str = 0.5
    method: str = "sparsegpt"
    feed: str = "pruned"
    block_size: int = 128
    damp: float = 0.01
    model: TransformerConfig | None = None

    def __post_init__(self):
        parse_sparsity(self.sparsity)
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; valid: {', '.join(METHODS)}")
        if self.feed not in FEEDS:
            raise ValueError(f"feed={self.feed!r}; valid: 'pruned', 'dense'")


@system_state
class PruneState:
    """The pipeline between two blocks.

    params: the LM's pure-dict params, blocks ``< layer`` pruned; xs: per calibration batch, the
    hidden states [B, T, d_model] entering block ``layer`` (the pruned model's); dense_xs: the
    dense model's (``feed="dense"``), else None; batches: the calibration batches
    (``tokens`` / ``segment_ids`` / ``positions`` int32 [B, T]); layer: blocks pruned so far;
    report: one :class:`~jaxflow.prune.sequential.PrunedMatrix` per pruned weight matrix.
    """

    params: dict
    xs: tuple
    dense_xs: tuple | None
    batches: tuple
    layer: int = static_field()
    report: tuple[PrunedMatrix, ...] = static_field()
    config: PruneConfig = static_field()
    runner: BlockRunner = static_field()

    @property
    def done(self) -> bool:
        """Every decoder block is pruned."""
        return self.layer == len(self.params["layers"])


@dataclasses.dataclass(frozen=True, eq=False)
class PruneSystem:
    """Sequential pruning of one dense LM on one calibration set (see the module docstring).

    params: pure-dict params of ``jaxflow.models.Transformer``; calibration: token arrays
    [B, T] or dicts with ``tokens`` (and optionally ``segment_ids`` / ``positions``);
    evaluator: ``params -> {name: float}`` (e.g. capability scores), used by :meth:`evaluate`;
    dense_scores: the evaluator's scores of the dense model, for the retention.
    """

    params: Mapping[str, Any]
    calibration: Sequence[Any]
    evaluator: Callable[[Mapping[str, Any]], Mapping[str, float]] | None = None
    dense_scores: Mapping[str, float] | None = None

    def init(self, config: PruneConfig, meshes: Mapping[str, Any] | None = None,
             key: jax.Array | None = None) -> PruneState:
        """The state before block 0: the calibration tokens embedded ([B, T, d_model] each)."""
        batches = tuple(as_batch(b) for b in self.calibration)
        if not batches:
            raise ValueError("PruneSystem needs at least one calibration batch; got 0")
        model = config.model or infer_model_config(
            self.params, max_seq_len=max(b["tokens"].shape[1] for b in batches))
        params = jax.tree.map(lambda x: x, dict(self.params))
        params["layers"] = dict(self.params["layers"])
        emb = jnp.asarray(self.params["embedding"])
        xs = tuple(jnp.take(emb, b["tokens"], axis=0).astype(model.compute_dtype) for b in batches)
        return PruneState(params=params, xs=xs, dense_xs=xs if config.feed == "dense" else None,
                          batches=batches, layer=0, report=(), config=config, runner=block_runner(model))

    def step(self, state: PruneState, batch: Any = None, *,
             key: jax.Array | None = None) -> tuple[PruneState, dict[str, float]]:
        """Prunes block ``state.layer`` (``batch`` is unused: the calibration is in the state).

        Returns the next state and ``{"layer", "calib_error", "sparsity"}`` (the block's mean
        relative calibration error tr(dW H dW^T) / tr(W H W^T) and realised sparsity)."""
        keys = sorted(state.params["layers"], key=int)
        if state.layer >= len(keys):
            raise ValueError(f"state.layer={state.layer}: all {len(keys)} blocks are pruned; "
                             f"valid: a state with layer < {len(keys)}")
        cfg, runner, name = state.config, state.runner, keys[state.layer]
        dense_layer = state.params["layers"][name]
        layer, rows = prune_block(runner, dense_layer, state.batches, state.xs, state.dense_xs,
                                  parse_sparsity(cfg.sparsity), method=cfg.method,
                                  layer_idx=state.layer, block_size=cfg.block_size, damp=cfg.damp)
        xs = tuple(runner.forward(layer, x, b["positions"], b["segment_ids"])
                   for b, x in zip(state.batches, state.xs))
        dense_xs = None if state.dense_xs is None else tuple(
            runner.forward(dense_layer, x, b["positions"], b["segment_ids"])
            for b, x in zip(state.batches, state.dense_xs))
        params = dict(state.params)
        params["layers"] = {**state.params["layers"], name: layer}
        metrics = {"layer": float(state.layer),
                   "calib_error": float(np.mean([r.calib_error for r in rows])),
                   "sparsity": float(np.mean([r.sparsity for r in rows]))}
        return dataclasses.replace(state, params=params, xs=xs, dense_xs=dense_xs,
                                   layer=state.layer + 1, report=state.report + tuple(rows)), metrics

    def run(self, config: PruneConfig, meshes: Mapping[str, Any] | None = None,
            key: jax.Array | None = None) -> PruneState:
        """``init`` and one ``step`` per decoder block (``jaxflow.train.loop.run_steps``)."""
        state = self.init(config, meshes, key)
        return run_steps(lambda s, _: self.step(s, None, key=key), state,
                         steps=len(self.params["layers"]), log_every=len(self.params["layers"]),
                         summarize=last_row).state

    def evaluate(self, state: PruneState) -> dict[str, float]:
        """``score/<name>`` of the evaluator on the (partly) pruned params and, with
        ``dense_scores``, ``retention/<name>`` (pruned / dense, ``total`` included); without an
        evaluator, the mean calibration error and sparsity of the matrices pruned so far."""
        if self.evaluator is None:
            return {"calib_error": float(np.mean([r.calib_error for r in state.report] or [0.0])),
                    "sparsity": float(np.mean([r.sparsity for r in state.report] or [0.0]))}
        scores = dict(self.evaluator(state.params))
        out = {f"score/{k}": v for k, v in scores.items()}
        if self.dense_scores is not None:
            out.update({f"retention/{k}": v for k, v in retention(scores, dict(self.dense_scores)).items()})
        return out

    def programs(self, config: PruneConfig, meshes: Mapping[str, Any]) -> list[Program]:
        """The jitted programs of one block's pruning on ``meshes``' first mesh (replicated):
        each linear group's input computation, the Hessian update and the block forward, with
        abstract [B, T] calibration batches of the first calibration batch's shape."""
        if not meshes:
            raise ValueError("PruneSystem.programs needs a mesh; got meshes={}")
        mesh = meshes.get("mesh", next(iter(meshes.values())))
        rep = NamedSharding(mesh, PartitionSpec())

        def abstract(x):
            return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=rep)

        batch = as_batch(self.calibration[0])
        b, t = batch["tokens"].shape
        model = config.model or infer_model_config(self.params, max_seq_len=t)
        runner = block_runner(model)
        layer = jax.tree.map(abstract, self.params["layers"][sorted(self.params["layers"], key=int)[0]])
        x = jax.ShapeDtypeStruct((b, t, model.d_model), model.compute_dtype, sharding=rep)
        pos = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep)
        programs = [Program(f"prune/stage_input/{stage}", runner.stage_input, (layer, x, pos, pos), mesh,
                            kind="forward", kwargs={"stage": stage}, tokens=b * t)
                    for stage, _ in LINEAR_GROUPS]
        d = model.d_model
        hess = jax.tree.map(abstract, hessian_init(d))
        valid = jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=rep)
        programs.append(Program("prune/hessian_update", hessian_update, (hess, x, valid), mesh,
                                kind="forward", tokens=b * t))
        programs.append(Program("prune/block_forward", runner.forward, (layer, x, pos, pos), mesh,
                                kind="forward", tokens=b * t))
        return programs
