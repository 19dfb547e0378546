"""Supervised warm start for RL: next-token loss on (prompt, answer) pairs, answer tokens only.

A policy that never writes a correct answer gives GRPO no signal; a short SFT run on a task's
own demonstrations (e.g. a reasoning-gym generator's answers) makes it right part of the time,
which RL then improves. The rows are laid out exactly as the RL sampler sees them: the prompt
as :func:`jaxflow.rl.tasks.encode_prompts` encodes it (BOS when the tokenizer has one), then the
answer's tokens and EOS; the loss covers the answer and the EOS.

The step is :func:`jaxflow.train.lm_state.make_train_step` on a
:class:`jaxflow.train.state.TrainState`, run by :func:`jaxflow.train.loop.run_steps` (rows,
stop signals and checkpoints as in every other loop).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.config import require_positive
from jaxflow.config_domains import COUNT, COUNT0, domains
from jaxflow.train.lm_state import OptimConfig, lm_functions, make_optimizer, make_train_step
from jaxflow.train.loop import run_steps
from jaxflow.train.state import TrainState


@domains(steps=COUNT0, batch_size=COUNT, log_every=COUNT)
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """``steps`` optimizer steps of ``batch_size`` (prompt, answer) rows; 0 steps: no SFT."""

    steps: int = 0
    batch_size: int = 32
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=20)
    log_every: int = 50

    def __post_init__(self):
        require_positive(self, "steps", allow_zero=True)
        require_positive(self, "batch_size", "log_every")


def sft_rows(tokenizer: Any, prompts: Sequence[str], answers: Sequence[str],
             seq_len: int) -> dict[str, np.ndarray]:
    """The SFT batch of ``(prompt, answer)`` pairs: ``[BOS] prompt answer EOS`` per row,
    right-padded to ``seq_len``.

    Returns a dict of int32 / float32 [B, seq_len] arrays (``make_train_step``'s batch):
    ``tokens``, ``targets`` (the next token), ``loss_mask`` (1 where the target is an answer
    token or the EOS), ``segment_ids`` (1 on the row, 0 on padding), ``positions``.

    Raises:
      ValueError: a row longer than ``seq_len`` (naming its index and length).
    """
    n = len(prompts)
    if len(answers) != n:
        raise ValueError(f"sft_rows: {n} prompts but {len(answers)} answers; valid: one each")
    tokens = np.full((n, seq_len + 1), tokenizer.pad_id, np.int32)
    answer_from = np.zeros(n, np.int32)
    lengths = np.zeros(n, np.int32)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        head = tokenizer.encode(p, bos=True)
        ids = head + tokenizer.encode(a) + [tokenizer.eos_id]
        if len(ids) > seq_len + 1:
            raise ValueError(f"sft_rows: row {i} has {len(ids)} tokens; valid: at most "
                             f"seq_len + 1 = {seq_len + 1}")
        tokens[i, :len(ids)] = ids
        answer_from[i], lengths[i] = len(head), len(ids)
    pos = np.arange(seq_len)[None, :]
    # target t is token t + 1: an answer / EOS target when t + 1 >= answer_from
    mask = (pos + 1 >= answer_from[:, None]) & (pos + 1 < lengths[:, None])
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": mask.astype(np.float32),
            "segment_ids": (pos < lengths[:, None] - 1).astype(np.int32),
            "positions": np.broadcast_to(pos, (n, seq_len)).astype(np.int32)}


def sft_warm_start(params: Any, model_cfg: Any, mesh: Mesh, tokenizer: Any,
                   prompts: Sequence[str], answers: Sequence[str], config: SFTConfig, *,
                   seed: int = 0, run: Any = None, checkpointer: Any = None) -> tuple[Any, dict]:
    """``config.steps`` SFT steps from ``params`` (pure dict on ``mesh``, laid out by
    ``lm_functions(model_cfg, mesh)``) on batches drawn with replacement from the pairs
    (a pure function of ``seed`` and the step). Returns (the trained params, a summary:
    ``steps``, ``loss_first`` / ``loss_last``, ``token_accuracy_last``)."""
    if config.steps == 0:
        return params, {"steps": 0}
    fns = lm_functions(model_cfg, mesh)
    tx = make_optimizer(config.optim, config.steps)
    shardings = TrainState.shardings(tx, params, fns.param_shardings)
    rows = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    if config.batch_size % mesh.devices.size:
        rows = NamedSharding(mesh, PartitionSpec())
    step_fn = make_train_step(fns, tx, shardings, rows)
    seq_len = max(len(tokenizer.encode(p, bos=True)) + len(tokenizer.encode(a)) + 1
                  for p, a in zip(prompts, answers)) - 1
    state = TrainState.create(tx, jax.tree.map(lambda x: x.copy(), params), fns.param_shardings)

    def step(state, i):
        pick = np.random.default_rng([seed, i, 0x5F7]).integers(0, len(prompts), config.batch_size)
        batch = sft_rows(tokenizer, [prompts[j] for j in pick], [answers[j] for j in pick], seq_len)
        return step_fn(state, {k: jax.device_put(v, rows) for k, v in batch.items()})

    result = run_steps(step, state, steps=config.steps, run=run, checkpointer=checkpointer,
                       log_every=config.log_every)
    losses = [float(r["loss"]) for r in result.rows]
    return result.state.params, {
        "steps": config.steps, "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "token_accuracy_last": float(result.rows[-1]["token_accuracy"]) if result.rows else None}
