"""LM pretraining on the arithmetic corpus: build, train with checkpoints, resume exactly.

Every process builds the same global batch from ``(seed, step)`` and contributes its devices'
slices (``jax.make_array_from_callback``), so one program runs unchanged on 1 CPU, 8 fake
devices, or N processes of the multi-controller runtime. The ``lm_pretrain`` experiment and the
RL warm start (``jaxflow.rl.warm_start``) both run :func:`pretrain`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxflow.checkpoint import Checkpointer
from jaxflow.data.arithmetic import AdditionTask, packed_batch
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import global_batch
from jaxflow.experiment import RunContext
from jaxflow.mesh import DEFAULT_RULES, assert_params_sufficiently_sharded, logical_to_spec
from jaxflow.models import lora
from jaxflow.models.transformer import param_count
from jaxflow.sync.replica import tree_digest
from jaxflow.train.evaluate import ExactMatchEvaluator
from jaxflow.train.lm_state import (
    LMFunctions,
    init_train_state,
    lm_functions,
    make_optimizer,
    make_train_step,
    model_optimizer,
)
from jaxflow.train.loop import run_steps
from jaxflow.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class PretrainStep:
    """The jitted train step of a pretraining run and what it was built from.

    fns: the model's functions with params sharded by ``jaxflow.mesh.DEFAULT_RULES`` (ZeRO-3
    over "fsdp", tensor parallelism over "model") on ``mesh``; tx: the optimizer; shardings:
    the train state's (a ``TrainState`` of ``NamedSharding``); batch_sharding: every
    [batch_size, seq_len] batch array's; train_step:
    ``(state, batch) -> (state, metrics)``, donating the state."""

    mesh: Mesh
    fns: LMFunctions
    tx: Any
    shardings: TrainState
    batch_sharding: NamedSharding
    train_step: Callable


def build_train_step(config, mesh: Mesh) -> PretrainStep:
    """The train step ``pretrain`` runs for ``config`` on ``mesh`` (its devices may be abstract
    topology devices: nothing is allocated), built by :func:`make_train_step`."""
    fns = lm_functions(config.model, mesh, DEFAULT_RULES)
    tx = model_optimizer(make_optimizer(config.optim, config.train.steps), config.model)
    shardings = TrainState.shardings(tx, fns.abstract_params(), fns.param_shardings)
    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", "length"), DEFAULT_RULES, mesh))
    return PretrainStep(mesh, fns, tx, shardings, batch_sharding,
                        make_train_step(fns, tx, shardings, batch_sharding,
                                        microbatches=getattr(config.train, "microbatches", 1),
                                        fused_loss=getattr(config.train, "fused_loss", False)))


def build_task(config):
    """(tokenizer, task) of ``config.data``; ValueError when the model's vocabulary is smaller
    than the tokenizer's."""
    tokenizer = CharTokenizer()
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={config.model.vocab_size} < tokenizer's {tokenizer.vocab_size}")
    # A data config may build its own corpus (e.g. worked addition for the RL testbed).
    task = (config.data.make_corpus() if hasattr(config.data, "make_corpus") else
            AdditionTask(max_digits=config.data.max_digits, heldout_mod=config.data.heldout_mod))
    return tokenizer, task


def host_batch(config, task, tokenizer, step: int, *, batch_size: int | None = None) -> dict:
    """Training batch ``step`` on the host: {tokens, targets, loss_mask, segment_ids,
    positions}, each [batch_size, seq_len] (default ``config.train.batch_size``)."""
    tc = config.train
    host = packed_batch(task, tokenizer, seed=config.seed, step=step,
                        batch_size=tc.batch_size if batch_size is None else batch_size,
                        seq_len=tc.seq_len, loss_on=config.data.loss_on)
    return vars(host)


def pretrain(config, run: RunContext, *, checkpoint_dir=None, decode_kernel=None) -> dict:
    """Trains ``config.model`` per ``config.train`` into ``run``'s checkpoints (or
    ``checkpoint_dir``; resuming from the latest when ``run.resume``); returns the summary
    (final loss, held-out accuracy, checksum). ``decode_kernel``: the held-out evaluator's
    (:class:`jaxflow.train.evaluate.ExactMatchEvaluator`)."""
    tokenizer, task = build_task(config)
    built = build_train_step(config, config.mesh.make())
    mesh, fns, batch_sharding = built.mesh, built.fns, built.batch_sharding
    tc = config.train
    state, _ = init_train_state(fns, config.model, built.tx, jax.random.key(config.seed))
    evaluate = ExactMatchEvaluator(fns, task, tokenizer, n=tc.eval_examples, mesh=mesh,
                                    decode_kernel=decode_kernel)
    ckpt = Checkpointer(run.checkpoint_dir if checkpoint_dir is None else checkpoint_dir,
                        save_every=tc.checkpoint_every, max_to_keep=tc.keep_checkpoints)
    assert_params_sufficiently_sharded(state.params, mesh)  # no-op without a "model" axis
    trainable = (f" ({param_count(lora.adapters(state.params)):,} trainable: LoRA adapters)"
                 if config.model.lora.enabled else "")
    run.info(f"model params: {param_count(state.params):,}{trainable}; mesh {dict(mesh.shape)}")

    def step_fn(state, step):
        host = host_batch(config, task, tokenizer, step)
        return built.train_step(state, global_batch(host, batch_sharding))

    run.set_total_steps(tc.steps, "lm_pretrain")
    result = run_steps(step_fn, state, steps=tc.steps, run=run, checkpointer=ckpt,
                       log_every=tc.log_every, summarize=_row,
                       eval_fn=lambda state, done: {"heldout_accuracy": evaluate(state.params)},
                       eval_every=tc.eval_every)
    state = result.state
    evaluated = [r["heldout_accuracy"] for r in result.rows if "heldout_accuracy" in r]
    # resumed at the very end: nothing left to train, so evaluate the restored state
    accuracy = evaluated[-1] if evaluated else evaluate(state.params)
    final_loss = (float(jax.device_get(result.last_metrics["loss"])) if result.last_metrics
                  else _last_logged_loss(run))
    return {
        "final_loss": final_loss,
        "heldout_accuracy": accuracy,
        "steps": tc.steps,
        "param_count": param_count(state.params),
        "params_checksum": tree_digest(state.params),
    }


def _row(window) -> dict:
    """The logged row: means of loss / token accuracy / grad norm over the window, last loss."""
    rows = jax.device_get(list(window))
    row = {k: float(np.mean([r[k] for r in rows])) for k in ("loss", "token_accuracy", "grad_norm")}
    row["last_loss"] = float(rows[-1]["loss"])
    return row


def _last_logged_loss(run: RunContext) -> float:
    from jaxflow.plots import read_metrics

    rows = [r for r in read_metrics(run.out_dir / "metrics.jsonl") if "last_loss" in r]
    return float(rows[-1]["last_loss"]) if rows else float("nan")
