"""FlexMARL's jitted programs with abstract arguments, for ``--compile-only``.

Per agent (an :class:`~jaxflow.marl.pipeline.AgentRuntime`): the barrier's (``run_sync``) pi_old
statistics and GRPO update on the version's full batch, the pipeline's (``AgentTrainer``)
gradient accumulation over micro-batches (first, later, last + optimizer step); per rollout
engine (:class:`~jaxflow.marl.engine.RolloutEngine`) the prefill and one decode chunk on an
engine call's rows - the largest of the engine's shapes (compaction decodes smaller buckets).
Arguments that a program's output feeds (pi_old statistics, gradient sums, the decode carry)
take that output's shardings from its compile (:func:`~jaxflow.compile_only.program.compile_ahead`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.compile_only.program import (
    Program,
    compile_ahead,
    count_params,
    mesh_note,
    sds,
    transformer_train_flops,
)
from jaxflow.marl.engine import RolloutEngine, row_keys
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import MiniBatch
from jaxflow.rl.rollout import batch_sharding
from jaxflow.train.state import TrainState


def mini_batch(rows: int, width: int, n: int, sharding) -> MiniBatch:
    """A trainer batch of ``rows`` rows (``width`` prompt + ``n`` response tokens) as
    ``AgentRuntime.place`` lays it out (rows over "data")."""
    shapes = ((rows, width), (rows,), (rows, n), (rows, n), (rows, n), (rows,))
    dtypes = (np.int32, np.int32, np.int32, np.float32, np.float32, np.float32)
    return MiniBatch(*(sds(s, d, sharding) for s, d in zip(shapes, dtypes)))


def _key(mesh) -> dict:
    key = jax.eval_shape(lambda: jax.random.key(0))
    return {"key": sds(key.shape, key.dtype, NamedSharding(mesh, PartitionSpec()))}


def agent_programs(rt, *, n_inputs: int, micro_inputs: int) -> list[Program]:
    """``rt``'s trainer programs: ``NAME/old_stats`` and ``NAME/update`` on the full batch
    (``n_inputs`` x G rows), then ``NAME/accumulate_first``, ``NAME/accumulate`` and
    ``NAME/accumulate_apply`` on ``micro_inputs`` x G rows, as many kinds as the version has
    micro-batches for. Analytic FLOPs: ``transformer_train_flops`` of the rows (the
    accumulation steps also run pi_old's forward, a third of it)."""
    name, cfg, mesh, model = rt.spec.name, rt.config, rt.mesh, rt.spec.model
    params = rt.fns.abstract_params()
    policy = TrainState.abstract(rt.tx, params, rt.fns.param_shardings)
    width, n = rt.engine.prompt_width, cfg.max_new_tokens
    key = _key(mesh)
    embed = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    n_matmul = count_params(params) - embed

    def flops(rows):  # one forward + backward of ``rows`` sequences
        return transformer_train_flops(n_matmul, rows * (width + n), n_layers=model.n_layers,
                                       seq_len=width + n, d_attn=model.n_heads * model.head_dim)

    def words(rows):
        return f"{mesh_note(mesh)}; {rows} rows of {width} prompt + {n} response tokens"

    full, micro = cfg.rollout_size, micro_inputs * cfg.group_size
    mb = mini_batch(full, width, n, batch_sharding(mesh, full))
    old, stats = compile_ahead(Program(
        f"{name}/old_stats", rt.old_stats, (params, None, mb), mesh, "forward",
        model_flops=flops(full) / 3, tokens=full * (width + n), note=words(full)))
    out = [old, Program(f"{name}/update", rt.update, (policy, mb, stats), mesh, "train",
                        kwargs=key, model_flops=flops(full), tokens=full * (width + n),
                        note=words(full))]
    mb = mini_batch(micro, width, n, batch_sharding(mesh, micro))
    step = dict(kind="train", kwargs=key, model_flops=4 * flops(micro) / 3,
                tokens=micro * (width + n), note=words(micro))
    sums, n_micro = (None, None), n_inputs // micro_inputs
    if n_micro > 1:
        first, sums = compile_ahead(Program(f"{name}/accumulate_first", rt.accumulate,
                                            (*sums, params, mb), mesh, **step))
        out.append(first)
    if n_micro > 2:
        out.append(Program(f"{name}/accumulate", rt.accumulate, (*sums, params, mb), mesh,
                           **step))
    out.append(Program(f"{name}/accumulate_apply", rt.accumulate_apply, (policy, *sums, mb),
                       mesh, **step))
    return out


def engine_programs(name: str, eng: RolloutEngine, model: TransformerConfig, rows: int
                    ) -> tuple[list[Program], dict]:
    """``eng``'s (of ``model``) ``NAME/prefill`` and ``NAME/decode`` (its first chunk) on
    ``rows`` rows, and the arguments a decode call takes (for :func:`padded_decode_program`)."""
    mesh, n = eng.mesh, eng.config.max_new_tokens
    row, rep = batch_sharding(mesh, rows), NamedSharding(mesh, PartitionSpec())
    key = jax.eval_shape(lambda: row_keys(jax.random.key(0), rows))
    params = eng.fns.abstract_params()
    state = eng.fns.nnx_state(params)
    prefill_args = (state, sds((rows, eng.prompt_width), np.int32, row),
                    sds((rows,), np.int32, row), sds(key.shape, key.dtype, rep))
    prefill, (carry, _) = compile_ahead(Program(
        f"{name}/prefill", eng.prefill_fn, prefill_args, mesh, "sample",
        model_flops=2.0 * count_params(params) * rows * eng.prompt_width,
        tokens=rows * eng.prompt_width, note=_engine_note(eng, rows)))
    decode_args = dict(state=state, carry=carry, lengths=prefill_args[2], keys=prefill_args[3],
                       t0=sds((), np.int32, rep))
    return [prefill, _decode(f"{name}/decode", eng, model, rows, decode_args,
                             min(eng.chunk, n - 1))], decode_args


def padded_decode_program(name: str, eng: RolloutEngine, model: TransformerConfig, rows: int,
                          decode_args: dict) -> Program:
    """``NAME/decode_padded``: every step after the prefill in one decode call on ``rows``
    padded rows (the engine benchmark's baseline); ``decode_args`` from :func:`engine_programs`
    on the same engine shapes."""
    return _decode(f"{name}/decode_padded", eng, model, rows, decode_args,
                   eng.config.max_new_tokens - 1)


def _engine_note(eng: RolloutEngine, rows: int) -> str:
    ctx = eng.prompt_width + eng.config.max_new_tokens
    return f"{mesh_note(eng.mesh)}; {rows} rows, KV cache of {ctx} slots (XLA attention)"


def _decode(name: str, eng: RolloutEngine, model: TransformerConfig, rows: int, a: dict,
            steps: int) -> Program:
    ctx = eng.prompt_width + eng.config.max_new_tokens
    n_params = count_params(a["state"])
    flops = 2.0 * rows * steps * (n_params + 2 * model.n_layers * ctx * model.n_heads
                                  * model.head_dim)
    return Program(name, eng.decode_fn, (a["state"], a["carry"], a["lengths"], a["keys"], a["t0"],
                                       steps), eng.mesh, "sample", model_flops=flops,
                   tokens=rows * steps,
                   note=_engine_note(eng, rows) + f"; {steps} decode steps per call")
