"""FlexMARL's jitted programs with abstract arguments, for ``--compile-only``.

Per agent (an :class:`~jaxflow.marl.pipeline.AgentRuntime`): the barrier's (``run_sync``) pi_old
statistics and GRPO update on the version's full batch, the pipeline's (``AgentTrainer``)
gradient accumulation over micro-batches (first, later, last + optimizer step); per rollout
sampler (:class:`~jaxflow.marl.sampling.AgentSampler`) the paged engine's prefill and decode
calls for an engine call's rows (:func:`jaxflow.rollout.programs.engine_programs`; the decode over
every slot, the largest of its shapes). Arguments that a program's output feeds (pi_old
statistics, gradient sums) take that output's shardings from its compile
(:func:`~jaxflow.compile_only.program.compile_ahead`).
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
from jaxflow.marl.sampling import AgentSampler
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
    width, n = rt.sampler.prompt_width, cfg.max_new_tokens
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


def engine_programs(name: str, sampler: AgentSampler, rows: int) -> list[Program]:
    """``NAME/prefill`` and ``NAME/decode``: the paged engine's public programs
    (:func:`jaxflow.rollout.programs.engine_programs`) on ``sampler``'s replica mesh, shaped as
    its engine is for calls of ``rows`` rows (every slot decoded: the largest decode call), with
    the f32 weights a FlexMARL trainer publishes."""
    from jaxflow.rollout.programs import engine_programs as paged_engine_programs

    return paged_engine_programs(sampler.model, sampler.mesh, sampler.engine_config(rows),
                                 sampler.config, prompt_len=sampler.prompt_width, param_dtype=None,
                                 prefix=name + "/")
