"""Exactness of the pipelines against ``sync``: every pipeline trained K steps from the same
state, the trajectories' difference (params and tables after K steps), and the one-step
difference from sync's own state at each step (the per-step error of a reordered sum; the
K-step difference also holds its amplification by training).

Differences are relative to one scale for the whole model: max |x - x_sync| / max |x_sync| over
all dense params and tables together (:func:`max_relative_diff`); :func:`max_leafwise_diff` is
the per-leaf view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxflow.nestpipe.system import NestPipeState, NestPipeSystem

__all__ = ["compare_to_sync", "max_leafwise_diff", "max_relative_diff", "one_step_diffs",
           "snapshot"]


def max_relative_diff(a, b) -> float:
    """max |a - b| / max |b| over all leaves together (dense params and tables).

    One scale for the whole model: a leaf whose own values are ~0 (e.g. a bias after one Adam
    step on a ~1e-11 gradient, where the update is g / (|g| + eps)) would otherwise turn a
    harmless absolute error into a large relative one; :func:`max_leafwise_diff` reports that
    view.
    """
    diff = scale = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        diff, scale = max(diff, float(np.max(np.abs(x - y)))), max(scale, float(np.max(np.abs(y))))
    return diff / max(scale, 1e-30)


def max_leafwise_diff(a, b) -> float:
    """max over leaves of max |a - b| / max |b| of that leaf."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return out


def snapshot(state: NestPipeState) -> dict:
    """Host copies of the dense params and every table: ``{"params": ..., "tables": {name:
    (values f32[V, D], optimizer state)}}``."""
    return {"params": jax.device_get(state.dense.params),
            "tables": {n: t.to_numpy() for n, t in state.tables.items()}}


def one_step_diffs(pipeline: str, state: NestPipeState, steps: int) -> list[float]:
    """Per step t < ``steps``: ``pipeline``'s step t and ``sync``'s step t, both from sync's
    state before t; the max relative difference of the results."""
    system, sync, out = NestPipeSystem(pipeline), NestPipeSystem("sync"), []
    for _ in range(steps):
        branch, _ = system.train(state, 1)
        state, _ = sync.train(state, 1)
        out.append(max_relative_diff(snapshot(branch), snapshot(state)))
    return out


def compare_to_sync(pipelines: Sequence[str], state: NestPipeState, steps: int,
                    log: Callable[[str], object] = print) -> dict[str, dict]:
    """Each of ``pipelines`` (``sync`` first) trained ``steps`` steps from ``state``, compared
    as soon as it finishes (one snapshot held besides sync's). Returns ``{"diff": {pipeline:
    max_relative_diff vs sync}, "leafwise": {...: max_leafwise_diff}, "results": {pipeline:
    {"final_train_loss" (mean of the last 10 losses), "auc", "logloss"}}}``."""
    if pipelines[0] != "sync":
        raise ValueError(f"pipelines={tuple(pipelines)}: sync must come first (the baseline)")
    sync_final, diff, leafwise, results = None, {}, {}, {}
    for p in pipelines:
        system = NestPipeSystem(p)
        trained, stats = system.train(state, steps)
        final = snapshot(trained)
        sync_final = final if p == "sync" else sync_final
        diff[p], leafwise[p] = max_relative_diff(final, sync_final), max_leafwise_diff(final, sync_final)
        results[p] = {"final_train_loss": float(np.mean(stats["losses"][-10:])),
                      **system.evaluate(trained)}
        del final, trained
        log(f"{p}: {steps} steps, loss {results[p]['final_train_loss']:.4f}, "
            f"AUC {results[p]['auc']:.4f}")
    return {"diff": diff, "leafwise": leafwise, "results": results}
