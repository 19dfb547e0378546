"""Compile gate: the static sampler's program (:func:`jaxflow.models.make_sampler` with the
flagship's ``DecodeKernel(paged_attention)``, as :class:`jaxflow.rl.rollout.RolloutWorker` builds
it) for tensor-parallel meshes of abstract TPU v5e (``v5e:2x2``: data 2 x model 2) and H100s
(``1x1x2``: model 2), at Qwen3-8B's widths (the flagship full model) with 2 layers, 64 rows, a
16-token prompt and 24 new tokens.

Checked per target, on the compiled HLO (:func:`jaxflow.compile_only.hlo.summarize`, counts per
call with the decode scan's trip count):
The rollout sampler (bf16, T = 1) and the held-out evaluation's greedy sampler (f32, T = 0) are
each compiled.

* the decode attention is the platform's paged decode kernel (the upstream Mosaic TPU one, the
  Triton GPU one): exactly once per layer per decode step; the prefill's (over the empty
  cache) the LM's segment attention kernel (splash's forward on TPU, the Triton flash ``mha``
  forward on GPU) exactly once per layer; no other Pallas call and no fallback to XLA. On the
  abstract H100 the bf16 prefill's ``auto`` tries cuDNN attention first, which needs the cuDNN
  library this host lacks ("cuDNN not found": the one fallback record allowed), and takes the
  Triton kernel (a real H100 with cuDNN takes cuDNN's fused attention, a custom call that is
  not a Pallas kernel);
* its collectives are the tensor-parallel reductions and nothing that moves the KV cache: every
  all-reduce is [rows per data shard, (tokens,) d_model] (each layer's attention output and MLP
  down projections in bf16; the vocab-sharded embedding lookup, in f32 on XLA:GPU) or a per-row
  scalar of the sampling (the vocab-sharded softmax), so the all-reduce bytes per call are at
  most (2 x layers x 2 + 4) x (prompt + steps) x rows x d_model bytes plus 64 per row and step;
  all-gathers stay under 4 KiB per step. A KV cache resharded per step (the kernel's
  shard_map laid out unlike the cache) would add [KVH, rows, slots, D] gathers.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import configs.flagship as flagship_config
from jaxflow.compile_only import hlo
from jaxflow.compile_only.program import Program, compile_ahead
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.sampler import SamplingConfig, make_sampler
from jaxflow.rollout.paged_attention import paged_attention
from jaxflow.train.lm_state import lm_functions
from pallas_kernels import dispatch, targets

LAYERS, ROWS, PROMPT, NEW = 2, 64, 16, 24
TARGETS = {"v5e-2x2": ("v5e", "v5e:2x2", (2, 2)), "h100x2": ("h100", "1x1x2", (1, 2))}
KERNEL = {"tpu": "paged_attention", "gpu": "paged_attention"}  # HLO names (starts)
PREFILL = {"tpu": "splash_mha_fwd", "gpu": "mha_forward"}  # the prefill's kernel (starts)
#: the RolloutWorker's samplers: the rollout's (bf16 policy copy, T = 1) and the held-out
#: evaluation's greedy one (the f32 policy itself, T = 0; its pass@1 sampler differs only in T)
SAMPLERS = {"rollout-bf16": ("bfloat16", 1.0), "greedy-f32": ("float32", 0.0)}


def _program(chip: str, topology: str, shape: tuple[int, int], dtype: str, temperature: float):
    model = dataclasses.replace(flagship_config.get_config("full").pretrain.model,
                                n_layers=LAYERS, dtype=dtype)
    mesh = Mesh(np.asarray(targets.devices(chip, topology)).reshape(shape), ("data", "model"))
    fns = lm_functions(model, mesh)
    sampler = make_sampler(fns.graphdef, SamplingConfig(max_new_tokens=NEW, temperature=temperature),
                           decode_kernel=DecodeKernel(paged_attention))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (fns.nnx_state(fns.abstract_params()),
            jax.ShapeDtypeStruct((ROWS, PROMPT), np.int32, sharding=rows),
            jax.ShapeDtypeStruct((ROWS,), np.int32, sharding=rows),
            jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec())))
    return model, Program("rollout/sample", sampler, args, mesh, kind="sample")


def _all_reduce_shapes(text: str) -> collections.Counter:
    """{result shape without layout: executions per call} of the module's all-reduces."""
    ins = hlo.instructions(text)
    times = hlo._multipliers(ins)
    out: collections.Counter = collections.Counter()
    for i in ins:
        kind, phase = hlo._kind(i.opcode)
        if kind == "all-reduce" and phase != "done":
            out[re.sub(r"\{[^}]*\}", "", i.shape)] += times.get(i.computation, 1)
    return out


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_static_sampler_decodes_through_the_kernel_without_moving_the_cache(target, sampler):
    chip, topology, shape = TARGETS[target]
    dtype, temperature = SAMPLERS[sampler]
    dispatch.clear_cache()
    model, program = _program(chip, topology, shape, dtype, temperature)
    compiled, _ = compile_ahead(program)
    assert compiled.compiled is not None, f"the sampler did not compile for {chip}"
    platform = targets.chip(chip).platform
    assert all(f["kernel"] == "cudnn_attention" and "cuDNN not found" in f["reason"]
               for f in compiled.fallbacks), compiled.fallbacks
    assert platform == "gpu" and dtype == "bfloat16" or not compiled.fallbacks
    text = compiled.compiled.as_text()
    summary = hlo.summarize(text)
    steps = NEW - 1
    calls = collections.Counter()
    for name, n in summary.pallas_kernels.items():
        kind = ("decode" if name.startswith(KERNEL[platform])
                else "prefill" if name.startswith(PREFILL[platform]) else name)
        calls[kind] += n
    assert calls == {"decode": LAYERS * steps, "prefill": LAYERS}, summary.pallas_kernels
    local_rows = ROWS // shape[0]
    d = model.d_model
    allowed = {f"{t}[{local_rows},{w}{d}]" for t in ("bf16", "f32")
               for w in ("", "1,", f"{PROMPT},")}
    shapes = _all_reduce_shapes(text)
    big = {s: n for s, n in shapes.items() if hlo.shape_bytes(s) > 8 * local_rows}
    assert set(big) <= allowed, shapes
    # the layers' reductions in the model's dtype; the embedding lookup's in it or f32 (XLA:GPU
    # reduces the f32 table's rows before the cast)
    width = jnp.dtype(dtype).itemsize
    bound = ((2 * LAYERS * width + 4) * (PROMPT + steps) * local_rows * d
             + 64 * local_rows * (steps + 1))
    assert summary.collectives["all-reduce"]["bytes"] <= bound, (summary.collectives, bound)
    assert summary.collectives["all-gather"]["bytes"] <= 4096 * (steps + 1), summary.collectives
    for kind in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert summary.collectives[kind]["bytes"] == 0, summary.collectives
