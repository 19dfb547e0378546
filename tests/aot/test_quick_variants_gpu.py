"""Compile gate: the flagship's quick variant compiles for 8 abstract H100s (XLA:GPU, Triton
gemm fusions), with the static sampler and with ``rl.sampler=engine``.

Both samplers prefill a 9-token prompt (the worked-addition prompt): a prompt length that is not
a power of 2 is what once failed XLA:GPU ("Couldn't find output tile sizes" on the output
projection's gemm, ``f32[2304,64]`` static and ``f32[36,64]`` engine) when the attention's
probs @ values product came out with the time axis minor
(:func:`jaxflow.models.attention.dot_product_attention` now keeps head_dim minor). Every
program of one RL step (:meth:`jaxflow.rl.system.GRPOSystem.programs`) is compiled in this
process, on the meshes the runner would build (``resolve_meshes``) from the target's devices;
with the engine only the rollout programs are compiled (the trainer and sync programs are the
static case's, compiled there), which keeps the gate's added time near half.
"""

from __future__ import annotations

import pytest

from jaxflow.compile_only.compile import compile_program
from jaxflow.config import apply_overrides, experiments
from jaxflow.run_meshes import resolve_meshes
from pallas_kernels import targets

SAMPLERS = {"static": [], "engine": ["rl.sampler=engine"]}


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_flagship_quick_compiles_for_eight_h100s(sampler):
    from jaxflow.main.flagship import compile_programs

    spec = experiments()["flagship"]
    config = apply_overrides(spec.get_config("quick"), SAMPLERS[sampler])
    meshes = resolve_meshes(spec, config, targets.devices("h100", "1x1x8"))
    programs = list(compile_programs(config, meshes))
    names = {p.name for p in programs}
    rollout = {"static": "rollout/sample", "engine": "rollout/engine/prefill"}[sampler]
    assert rollout in names, names
    chip = targets.chip("h100")
    if sampler != "static":
        programs = [p for p in programs if p.name.startswith("rollout/")]
    for program in programs:
        entry = compile_program(program, chip)
        assert entry["status"] == "ok", (program.name, entry.get("error"))
        assert entry["memory"]["fits"], (program.name, entry["memory"])
