"""The ``lm_pretrain`` experiment: train the LM on the arithmetic corpus, checkpoint, resume.

The work is :func:`jaxflow.train.pretrain.pretrain` (shared with the RL warm start); this entry
point names it for the runner, and :func:`compile_programs` gives ``--compile-only`` the train
step the run executes (built by the same :func:`jaxflow.train.pretrain.build_train_step`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from jaxflow.compile_only.program import Program, count_params, transformer_train_flops
from jaxflow.experiment import RunContext
from jaxflow.mesh import DEFAULT_RULES, require_divisible
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.rollout.paged_attention import paged_attention
from jaxflow.train.pretrain import build_task, build_train_step, host_batch, pretrain
from jaxflow.train.state import TrainState


def main(config, run: RunContext) -> dict:
    # the held-out evaluation decodes through the paged decode kernel on TPU / GPU (CPU: XLA)
    return pretrain(config, run, decode_kernel=DecodeKernel(paged_attention))


def compile_programs(config, meshes: Mapping[str, Mesh]) -> list[Program]:
    """``--compile-only``: the train step on ``meshes["mesh"]`` (the config's ``mesh`` on the
    target's devices), with an abstract train state and a [batch_size, seq_len] batch.

    ``model_flops``: 6 x (parameters the matmuls use: all but the input embedding table when
    it is untied) x tokens + causal attention (``transformer_train_flops``), with tokens =
    batch_size x seq_len (padding positions cost as much as real ones). ``recompute_flops``
    (with remat): the blocks' forward again, a third of their ``transformer_train_flops``.

    Raises:
      MeshError: ``train.batch_size`` is not divisible by the devices the batch is split over.
    """
    mesh = meshes["mesh"]
    tc, mc = config.train, config.model
    built = build_train_step(config, mesh)
    batch_spec = built.batch_sharding.spec[0]
    batch_axes = () if batch_spec is None else (
        (batch_spec,) if isinstance(batch_spec, str) else tuple(batch_spec))
    shards = 1
    for axis in batch_axes:
        shards *= mesh.shape[axis]
    require_divisible("train.batch_size", tc.batch_size, shards)
    params = built.fns.abstract_params()
    state = TrainState.abstract(built.tx, params, built.fns.param_shardings)
    tokenizer, task = build_task(config)
    one_row = host_batch(config, task, tokenizer, 0, batch_size=1)  # the run's keys and dtypes
    batch = {k: jax.ShapeDtypeStruct((tc.batch_size, tc.seq_len), v.dtype,
                                     sharding=built.batch_sharding)
             for k, v in one_row.items()}
    embedding = 0 if mc.tie_embeddings else mc.vocab_size * mc.d_model
    tokens = tc.batch_size * tc.seq_len
    flops = transformer_train_flops(count_params(params) - embedding, tokens,
                                    n_layers=mc.n_layers, seq_len=tc.seq_len,
                                    d_attn=mc.n_heads * mc.head_dim)
    # remat recomputes each block's forward in the backward: a third of the blocks' training
    # FLOPs (the head's matmul, outside the blocks, is not recomputed)
    blocks = count_params(params) - embedding - mc.vocab_size * mc.d_model
    recompute = transformer_train_flops(blocks, tokens, n_layers=mc.n_layers, seq_len=tc.seq_len,
                                        d_attn=mc.n_heads * mc.head_dim) / 3 if mc.remat else 0.0
    note = f"{' x '.join(f'{k} {v}' for k, v in mesh.shape.items())}: " + _layout(mesh) + \
        f"; remat={mc.remat}, attention={mc.attention}"
    return [Program("train/step", built.train_step, (state, batch), mesh, kind="train",
                    model_flops=flops, recompute_flops=recompute, tokens=tokens, note=note)]


def _layout(mesh: Mesh) -> str:
    """The sharding :data:`jaxflow.mesh.DEFAULT_RULES` give on ``mesh``, in words: which
    logical dimensions each mesh axis of size > 1 splits ("fsdp: batch, vocab, mlp")."""
    parts = []
    for axis, size in mesh.shape.items():
        if size == 1:
            continue
        dims = [logical for logical, target in DEFAULT_RULES
                if axis in ((target,) if isinstance(target, str) else (target or ()))]
        parts.append(f"{axis} splits {', '.join(dims) or 'nothing'}")
    return "; ".join(parts) + "; the rest replicated" if parts else "everything replicated"
