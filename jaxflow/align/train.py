"""Training one alignment method (SFT on revisions, DPO, FIGA) on interleaved pair rows.

Pure pieces: :func:`row_logp` (per-token log-probs of the response rows), :func:`method_loss`
(the loss of a method on rows ``[2P, ...]``, even rows revised, odd rows original),
:func:`make_method_step` (the jitted ``(TrainState, ref_params, rows) -> (TrainState,
metrics)``), :func:`batch_schedule` (the pair order every method shares) and
:func:`train_method` (one (seed, method) cell through :func:`jaxflow.train.loop.run_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxflow.align.baselines import dpo_loss, sequence_logp, sft_loss
from jaxflow.align.figa_loss import FigaConfig, figa_loss
from jaxflow.align.pairs import Rows
from jaxflow.rl.grpo import response_hidden
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.train.lm_state import LMFunctions
from jaxflow.train.loop import run_steps
from jaxflow.train.state import TrainState


def batch_schedule(n_pairs: int, steps: int, per_batch: int, seed: int) -> np.ndarray:
    """[steps, per_batch] pair indices: epochs of fresh permutations, concatenated."""
    rng = np.random.default_rng([seed, 0xBA7C])
    need = steps * per_batch
    order = np.concatenate([rng.permutation(n_pairs) for _ in range(-(-need // n_pairs))])
    return order[:need].reshape(steps, per_batch)


def row_logp(fns: LMFunctions, params, rows: Rows) -> jax.Array:
    """f32[R, T]: the log-prob (temperature 1) of every response token of ``rows`` under
    ``params``."""
    hidden, head = response_hidden(fns, params, rows.prompts, rows.prompt_lengths, rows.tokens)
    return fused_logprobs(hidden, head, rows.tokens, temperature=1.0).target_logp


def method_loss(params, ref_params, rows: Rows, *, fns: LMFunctions, method: str,
                dpo_beta: float, figa: FigaConfig) -> tuple[jax.Array, dict]:
    """The loss of ``method`` on interleaved rows (even rows revised, odd rows original):

      sft            token-mean NLL of the revised rows (the original rows are ignored)
      dpo            DPO on (revised, original) sequence log-probs, ``ref_params`` the reference
      figa           :func:`jaxflow.align.figa_loss` (the paper's weights)
      figa_constant  the same with the reference code's constant weights
    """
    logp = row_logp(fns, params, rows)
    mask = rows.mask > 0
    if method == "sft":
        return sft_loss(logp[0::2], mask[0::2])
    if method == "dpo":
        seq = sequence_logp(logp, mask)
        ref = jax.lax.stop_gradient(sequence_logp(row_logp(fns, ref_params, rows), mask))
        return dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=dpo_beta)
    weighting = "constant" if method == "figa_constant" else "figa"
    return figa_loss(logp, rows.marks, mask, rows.revised,
                     config=dataclasses.replace(figa, weighting=weighting))


def make_method_step(fns: LMFunctions, method: str, dpo_beta: float, figa: FigaConfig,
                     replicated: NamedSharding):
    """The jitted train step ``(state, ref_params, rows) -> (state, metrics)`` (``state`` a
    :class:`TrainState`, ``ref_params`` the frozen warm start, ``rows`` interleaved [2P, ...]);
    everything in and out is replicated (a tiny model), so the first step's inputs and every
    later step's match and it compiles once."""
    loss_fn = functools.partial(method_loss, fns=fns, method=method, dpo_beta=dpo_beta,
                                figa=figa)

    @functools.partial(jax.jit, out_shardings=replicated)
    def step(state: TrainState, ref_params, rows):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params,
                                                                           ref_params, rows)
        return state.apply_gradients(grads), {"loss": loss, **metrics}

    return step


def train_method(step: Callable, state: TrainState, rows_at: Callable[[int], Rows], *, ref_params,
                 evaluate: Callable[[Any], dict], steps: int, log_every: int, eval_every: int,
                 run=None, step_offset: int = 0,
                 row_fields: dict | None = None) -> tuple[list[dict], dict]:
    """Trains one (seed, method) cell: ``state, metrics = step(state, ref_params, rows_at(i))``
    for ``steps`` steps (:func:`jaxflow.train.loop.run_steps`).

    Rows ``{**row_fields, "step", metrics (every log_every steps and at the last), evaluation
    (every eval_every steps and at the last)}`` go to ``run.log(step_offset + step)``.

    Returns:
      (curve, first): curve ``[{"step", **evaluate(params)}]`` of the evaluated steps; first
      the first step's metrics as floats.
    """
    curve: list[dict] = []
    first: dict = {}

    def step_fn(state, i):
        state, metrics = step(state, ref_params, rows_at(i))
        if i == 0:
            first.update({k: float(v) for k, v in metrics.items()})
        return state, {"step": i + 1, "metrics": metrics}

    def eval_fn(state, done):
        ev = evaluate(state.params)
        curve.append({"step": done, **ev})
        return ev

    run_steps(step_fn, state, steps=steps, run=run, log_every=log_every,
              summarize=_row_every(log_every, steps), eval_fn=eval_fn, eval_every=eval_every,
              step_offset=step_offset, row_fields=row_fields)
    return curve, first


def _row_every(log_every: int, steps: int):
    """``run_steps`` rows of the figa log: ``step`` and, every ``log_every`` steps and at the
    last, that step's metrics as floats (the row of an evaluation-only step has no metrics)."""

    def summarize(window) -> dict:
        done, metrics = window[-1]["step"], window[-1]["metrics"]
        row = {"step": done}
        if done % log_every == 0 or done == steps:
            row.update({k: float(v) for k, v in metrics.items()})
        return row

    return summarize
