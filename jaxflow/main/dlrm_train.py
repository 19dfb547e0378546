"""The ``dlrm_train`` experiment: DLRM (or DCN-v2) over sharded embedding tables.

The system is :class:`jaxflow.recsys.system.DLRMSystem` (sharded tables + replicated dense
model in one ``shard_map`` step), driven by :func:`jaxflow.train.loop.run_steps`. Data: the
synthetic Criteo-like generator, or a Criteo TSV / MovieLens file given by ``data.path``.
Evaluation: AUC and log loss on held-out batches. Checkpoints every
``train.checkpoint_every`` steps; ``--resume`` continues.
"""

from __future__ import annotations

import functools
import time

import jax

from jaxflow.compile_only.program import Program
from jaxflow.embeddings.checkpoint import EmbeddingCheckpointer
from jaxflow.experiment import RunContext
from jaxflow.recsys.system import DLRMSystem, placement_counts, train_row
from jaxflow.train.loop import run_steps

SYSTEM = DLRMSystem()


def compile_programs(config, meshes) -> list[Program]:
    """The run's jitted programs (``train/step``, ``eval/predict``): :meth:`DLRMSystem.programs`."""
    return SYSTEM.programs(config, meshes)


def main(config, run: RunContext) -> dict:
    tc = config.train
    state = SYSTEM.init(config, {"mesh": config.mesh.make()}, jax.random.key(config.seed))
    run.info(placement_counts(state.embeddings))
    ckpt = EmbeddingCheckpointer(run.checkpoint_dir, save_every=tc.checkpoint_every)
    run.set_total_steps(tc.steps, "dlrm_train")

    def train_step(state, step):
        return SYSTEM.step(state, state.data.train(step, tc.batch_size))

    t0 = time.time()
    loop = run_steps(train_step, state, steps=tc.steps, run=run, checkpointer=ckpt,
                     log_every=tc.log_every,
                     summarize=functools.partial(train_row, capacity=state.embeddings.capacity))
    train_seconds = time.time() - t0
    result = SYSTEM.evaluate(loop.state)
    run.log(tc.steps, {f"eval_{k}": v for k, v in result.items() if k != "eval_ctr"})
    run.info(f"eval AUC {result['auc']:.4f} logloss {result['logloss']:.4f} (ctr {result['eval_ctr']:.3f})")
    steps_run = tc.steps - loop.start  # this process's steps (fewer after --resume)
    return {**result, "train_steps": tc.steps,
            "samples_per_second": steps_run * tc.batch_size / train_seconds if steps_run > 0 else None,
            "placements": {s.name: s.placement for s in state.embeddings.plan.specs}}
