"""Monolithic baselines: the whole VLM as one jitted step on one mesh.

``padded``: one sample per row, each batch padded to its own longest sample (bucketed), the
way a competent user of a JAX VLM trainer without multimodal packing would batch.
``packed``: the same step on rows from the packing scheduler. Both use the same model,
kernels, optimizers and samples as the decoupled mode.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from jaxflow.flow.batching import (
    PackingConfig,
    encoder_image_base,
    encoder_patches,
    layout_rows,
    loss_tokens,
    zeros_like_arrays,
)
from jaxflow.flow.decoupled import put_replicated, put_rows
from jaxflow.flow.packing import CostModel
from jaxflow.flow.steps import Sides, make_monolithic_step
from jaxflow.train.loop import last_row, run_steps
from jaxflow.train.state import TrainState


class MonolithicTrainer:
    """``run(steps)`` trains on ``[(step, samples), ...]`` and returns per-step results."""

    def __init__(self, sides: Sides, enc_state: TrainState, bb_state: TrainState, *, layout: str,
                 packing: PackingConfig, cost: CostModel):
        self.sides, self.enc_state, self.bb_state = sides, enc_state, bb_state
        self.layout, self.packing, self.cost = layout, packing, cost
        self.mesh = sides.bb.mesh
        self.rows_multiple = self.mesh.shape.get("data", 1)
        self._step = make_monolithic_step(sides)
        self.timers = {"step_s": 0.0}

    def _host(self, samples):
        patches = encoder_patches(samples, self.sides.vit, self.rows_multiple)
        layout = layout_rows(samples, self.layout, encoder_image_base(samples, patches),
                             packing=self.packing, cost=self.cost,
                             row_multiple=self.rows_multiple)
        return patches, layout

    def warm(self, steps: Sequence[tuple[int, list]]) -> int:
        """Compiles the step for every shape these steps will use (on zeros and a throwaway
        copy of the state), so timed runs never compile. Returns the number of shapes."""
        seen = set()
        for _, samples in steps:
            patches, layout = self._host(samples)
            sig = (patches.patches.shape, layout.rows["tokens"].shape)
            if sig in seen:
                continue
            seen.add(sig)
            enc, bb = self.sides.place(self.enc_state, self.bb_state)
            out = self._step(enc, bb, put_rows(zeros_like_arrays(patches.arrays()), self.mesh),
                             put_rows(zeros_like_arrays(layout.rows), self.mesh),
                             put_replicated(np.float32(1.0), self.mesh))
            jax.block_until_ready(out)
        return len(seen)

    def run(self, steps: Sequence[tuple[int, list]]) -> list[dict]:
        """Trains on every (step, samples) with :func:`jaxflow.train.loop.run_steps` over the
        (encoder, backbone) states; each row is one step's result (metrics, layout)."""
        steps = list(steps)

        def step_fn(states, k):
            t0 = time.perf_counter()
            samples = steps[k][1]
            patches, layout = self._host(samples)
            denom = loss_tokens(samples)
            enc_state, bb_state, metrics = self._step(
                *states, put_rows(patches.arrays(), self.mesh),
                put_rows(layout.rows, self.mesh), put_replicated(denom, self.mesh))
            metrics["loss"].block_until_ready()
            self.timers["step_s"] += time.perf_counter() - t0
            return (enc_state, bb_state), {"metrics": metrics, "layout": layout, "staleness": 0,
                                           "rows": layout.rows}

        result = run_steps(step_fn, (self.enc_state, self.bb_state), steps=len(steps),
                           summarize=last_row)
        self.enc_state, self.bb_state = result.state
        return result.rows
