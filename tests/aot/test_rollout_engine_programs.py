"""Compile gate: the rollout engine's own programs (``bench_rollout``'s ``compile_programs``:
:func:`jaxflow.rollout.programs.engine_programs`) compile with the real compilers for a
tensor-parallel engine on abstract TPU v5e (``v5e:2x2``, model 4) and 2 H100s (model 2), at
Qwen3-8B's widths with 2 layers, bf16 weights (the sync replica), 32 slots of 1,024 tokens in
64-token pages; and they fit the chip.

Checked per program: it compiles; its per-device bytes fit; the decode call runs the platform's
paged-attention kernel once per layer (``auto`` under the mesh: the upstream Mosaic TPU decode
kernel, the Triton GPU one) and the prefill its prefill kernel once per layer
(:mod:`jaxflow.rollout.prefill_attention`: on TPU the upstream ragged paged-attention kernel,
on GPU :mod:`jaxflow.rollout.gpu_prefill_kernel`); the pools come out sharded by K/V heads over
"model" (so the donated pool is updated in place, each device holding its heads' pages). The
flagship's ``rl.sampler=engine`` path (:func:`jaxflow.rl.programs.grpo_programs`) builds the
same programs on its rollout mesh.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from jaxflow.compile_only.kernels import pallas_calls
from jaxflow.compile_only.program import compile_ahead
from jaxflow.config import apply_overrides, experiments
from jaxflow.run_meshes import resolve_meshes
from pallas_kernels import dispatch, targets

LAYERS = 2
TARGETS = {"v5e-2x2": ("v5e", "v5e:2x2", 4), "h100x2": ("h100", "1x1x2", 2)}
KERNEL = {"tpu": "paged_flash_attention_kernel", "gpu": "paged_attention_block_h"}  # names' starts
PREFILL_KERNEL = {"tpu": "ragged_paged_attention_kernel", "gpu": "gpu_prefill_attention"}
SMALL = [f"serve.n_layers={LAYERS}", "serve.slots=32", "serve.prompt_len=256",
         "serve.max_new=768", "serve.prefill_rows=4", "serve.prefill_chunk=256"]


def _kernels(program) -> collections.Counter:
    dispatch.clear_cache()
    return pallas_calls(program.fn.trace(*program.args, **program.kwargs))


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_engine_programs_compile_fit_and_use_the_kernel(target):
    from jaxflow.main.bench_rollout import compile_programs

    chip, topology, tp = TARGETS[target]
    spec = experiments()["bench_rollout"]
    config = apply_overrides(spec.get_config("full"), SMALL + [f"serve.model_parallel={tp}"])
    meshes = resolve_meshes(spec, config, targets.devices(chip, topology))
    assert dict(meshes["rollout"].shape) == {"model": tp}
    programs = {p.name: p for p in compile_programs(config, meshes)}
    assert set(programs) == {"rollout/engine/prefill", "rollout/engine/decode"}
    capacity = targets.chip(chip).hbm_bytes
    for name, program in programs.items():
        compiled, outputs = compile_ahead(program)
        assert compiled.compiled is not None, f"{name} did not compile for {chip}"
        mem = compiled.compiled.memory_analysis()
        total = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                 + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
        assert 0 < total <= capacity, (name, total, capacity)
        pools = outputs if name.endswith("prefill") else outputs[0]
        for pool in pools.k + pools.v:  # [8 kv heads, pages, 64, 128]
            assert pool.shape[0] == 8 and pool.sharding.spec[0] == "model", pool.sharding
    decode = _kernels(programs["rollout/engine/decode"])
    kernel = KERNEL[targets.chip(chip).platform]
    assert sum(decode.values()) == LAYERS and all(k.startswith(kernel) for k in decode), decode
    prefill = _kernels(programs["rollout/engine/prefill"])
    assert sum(prefill.values()) == LAYERS and all(
        k.startswith(PREFILL_KERNEL[targets.chip(chip).platform]) for k in prefill), prefill


def test_flagship_engine_sampler_compiles_the_engine_programs():
    """``flagship --variant=full --set rl.sampler=engine --compile-only``: the rollout programs
    are the engine's (on the rollout mesh, the run's f32 published params), each decode layer
    through the TPU kernel."""
    import configs.flagship as flagship_config
    from jaxflow.main.flagship import compile_programs
    from jaxflow.mesh import trainer_rollout_meshes

    cfg = flagship_config.get_config("full")
    model = dataclasses.replace(cfg.pretrain.model, n_layers=LAYERS)
    cfg = dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, model=model))
    cfg = apply_overrides(cfg, ["rl.sampler=engine", "rl.engine.page_size=64"])
    meshes, _ = trainer_rollout_meshes(cfg.roles, targets.devices("v5p", "v5p:4x4x4"))
    programs = {p.name: p for p in compile_programs(cfg, meshes)}
    assert "rollout/sample" not in programs
    decode = programs["rollout/engine/decode"]
    assert decode.mesh is meshes["rollout"]
    calls = _kernels(decode)
    assert sum(calls.values()) == LAYERS and all(k.startswith(KERNEL["tpu"]) for k in calls), calls
