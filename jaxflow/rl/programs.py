"""The jitted programs of one GRPO trainer, with abstract arguments, for ``--compile-only``.

:func:`grpo_programs` takes a constructed :class:`jaxflow.rl.grpo.GRPOTrainer` (constructing one
allocates nothing: its jitted functions and shardings only) and returns the programs one RL
step runs, each the trainer's own jitted function, reached through public signatures: pi_old's
statistics and the update on the trainer mesh (``old_stats_fn``, ``update_fn``), the sampler on
the rollout mesh (:meth:`jaxflow.rl.rollout.RolloutWorker.sampler_programs`: the static prefill
+ decode scan, or with ``rl.sampler=engine`` the paged engine's prefill and decode calls on the
published weights), and SparseRL-Sync's device diff and the replica's scatter
(:func:`jaxflow.sync.programs.sync_programs`). :class:`jaxflow.rl.system.GRPOSystem`'s
``programs`` is this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program, count_params, transformer_train_flops
from jaxflow.models.moe import expert_index_dtype
from jaxflow.rl.grpo_step import MiniBatch, OldStats
from jaxflow.rl.rollout import batch_sharding
from jaxflow.sync.programs import sync_programs
from jaxflow.train.state import TrainState


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _routing_bytes(record: jax.ShapeDtypeStruct) -> int:
    """Bytes of an R3 routing record: layers x top-k x tokens x itemsize."""
    return int(np.prod(record.shape)) * record.dtype.itemsize


def _sharding_note(mesh) -> str:
    shape = dict(mesh.shape)
    tp = shape.get("model", 1)
    return (" x ".join(f"{k} {v}" for k, v in shape.items())
            + (": TP over heads / kv heads / mlp / vocab" if tp > 1 else ": data parallel"))


def grpo_programs(trainer, *, prefix: str = "") -> list[Program]:
    """[old_stats, update, sample (or the engine's prefill / decode), sync cast+count, sync
    compact, replica scatter] of ``trainer`` (a GRPOTrainer), named ``prefix +
    "trainer/update"`` etc. Mini-batches are ``[minibatch_size, prompt_width + max_new_tokens]``
    rows on the trainer mesh; a generation batch is ``prompts_per_gen_batch * group_size``
    sequences on the rollout mesh."""
    cfg, fns = trainer.config, trainer.fns
    tm, rm = trainer.trainer_mesh, trainer.rollout_mesh
    model = trainer.model_cfg
    params = fns.abstract_params()
    n_params = count_params(params)
    policy = TrainState.abstract(trainer.tx, params, fns.param_shardings)
    b, n = cfg.minibatch_size, cfg.max_new_tokens
    worker = trainer.worker
    width = worker.prompt_width
    k = min(cfg.sis_topk, model.vocab_size)
    row = batch_sharding(tm, b)
    f32, i32 = jnp.float32, jnp.int32
    extra, note_t = {}, _sharding_note(tm)
    if cfg.loss.sis_proposal == "behaviour":  # sis_b: the sampler's top-K rides with the rows
        extra.update(behaviour_topk_logp=_sds((b, n, k), f32, row), behaviour_topk_ids=_sds((b, n, k), i32, row))
    if cfg.routing_replay != "off":  # R3: experts per position and MoE layer, the smallest uint
        n_moe = sum(model.is_moe_layer(i) for i in range(model.n_layers))
        dtype = expert_index_dtype(model.n_experts)
        extra["routing"] = _sds((b, width + n - 1, n_moe, model.n_experts_per_token), dtype, row)
        note_t += (f"; R3 record {n_moe} layers x top-{model.n_experts_per_token} x {b * (width + n - 1)} "
                   f"tokens x {dtype.itemsize} B ({dtype.name}) = {_routing_bytes(extra['routing'])} B per mini-batch")
    mb = MiniBatch(_sds((b, width), i32, row), _sds((b,), i32, row), _sds((b, n), i32, row),
                   _sds((b, n), f32, row), _sds((b, n), f32, row), _sds((b,), f32, row), **extra)
    old = OldStats(_sds((b, n), f32, row), _sds((b, n, k), f32, row),
                   _sds((b, n, k), i32, row), _sds((b, n), f32, row))
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = _sds(key.shape, key.dtype, NamedSharding(tm, P()))
    ref = params if cfg.kl_coef > 0 else None
    seq = width + n
    d_attn = model.n_heads * model.head_dim
    train_flops = transformer_train_flops(n_params, b * seq, n_layers=model.n_layers,
                                          seq_len=seq, d_attn=d_attn)
    programs = [
        Program(prefix + "trainer/old_stats", trainer.old_stats_fn, (policy.params, ref, mb), tm,
                kind="forward", model_flops=train_flops / 3, tokens=b * seq, note=note_t),
        Program(prefix + "trainer/update", trainer.update_fn, (policy, mb, old), tm,
                kwargs={"key": key}, kind="train", model_flops=train_flops, tokens=b * seq,
                note=note_t),
    ]
    rows = cfg.prompts_per_gen_batch * cfg.group_size
    sample_flops = 2.0 * n_params * rows * seq + 2.0 * model.n_layers * rows * seq * seq * d_attn
    programs += worker.sampler_programs(rows, prefix=prefix, model_flops=sample_flops,
                                        note=_sharding_note(rm))
    if trainer.sync_config is not None:
        programs += sync_programs(params, fns.param_shardings, worker.param_shardings, tm, rm,
                                  prefix=prefix)
    return programs
