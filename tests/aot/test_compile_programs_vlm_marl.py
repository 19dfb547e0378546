"""Compile gate: every program of FlowTrain's and FlexMARL's ``compile_programs`` compiles for
abstract TPU v5e (``v5e:2x2``, 4 chips) and 2 H100s with the real compilers, and fits the chip.

Each experiment runs a small variant (``quick`` with two layers run as one scan over the
layers, as the ``full`` variants run their LM blocks and FlowTrain's ViT blocks, one candidate split for
FlowTrain, micro-batches as large as the version for FlexMARL, the engine benchmark on the
rollout's own shapes): small enough that each program compiles in seconds, with every program
kind the production variant has. Programs are built on the meshes
``jaxflow.run_meshes.resolve_meshes`` gives for the target's devices, lowered under
``jax.set_mesh(program.mesh)`` and compiled; their per-device bytes (arguments + outputs +
temporaries - aliased) must fit the chip's HBM. Their abstract arguments carry shardings on
their mesh, and the steps whose attention is ``auto`` contain the platform's kernel (splash on
TPU, Triton flash on GPU; GRPO also the fused log-probs kernels).

The heads are 64 wide in FlexMARL's small models: XLA:GPU (jaxlib 0.10.2) fails to compile the
KV-cache prefill of ``quick``'s 16-wide heads ("Couldn't find output tile sizes"), a compiler
limit at toy widths that the production widths (128) do not hit.
"""

from __future__ import annotations

import collections
import importlib

import jax
import pytest
from jax.sharding import NamedSharding

from jaxflow.compile_only.kernels import pallas_calls
from jaxflow.config import apply_overrides, experiments
from jaxflow.run_meshes import resolve_meshes
from pallas_kernels import targets

TARGETS = {"v5e-2x2": ("v5e", "v5e:2x2"), "h100x2": ("h100", "1x1x2")}
WIDE_HEADS = ["solver.head_dim_override=64", "verifier.d_model=64", "verifier.d_ff=128",
              "verifier.n_heads=4", "verifier.n_kv_heads=4", "verifier.head_dim_override=64"]
SMALL = {
    "flowtrain": ["model.n_layers=2", "model.scan_layers=True", "vit.n_layers=2",
                  "vit.scan_layers=True", "train.batch_size=8",
                  "train.eval_examples=8", "allocator.encoder_candidates=1"],
    "flexmarl": ["solver.n_layers=2", "solver.scan_layers=True", "verifier.scan_layers=True",
                 "micro_inputs=4", "bench_tokens=6", "bench_rows=4", "bench_chunk=2",
                 *WIDE_HEADS],
}
ATTENTION = {"tpu": "splash_mha_fwd", "gpu": "mha_forward"}
BACKWARD = {"tpu": "splash_mha_dq", "gpu": "mha_backward"}  # the attention backward kernels
PAGED = {"tpu": "paged_flash_attention_kernel", "gpu": "paged_attention_block_h"}  # names' starts
PREFILL = {"tpu": "ragged_paged_attention_kernel", "gpu": "gpu_prefill_attention"}  # the engine's


def _programs(exp: str, target: str):
    spec = experiments()[exp]
    config = apply_overrides(spec.get_config("quick"), SMALL[exp])
    chip, topology = TARGETS[target]
    devices = targets.devices(chip, topology)
    meshes = resolve_meshes(spec, config, devices)
    driver = importlib.import_module(spec.entry.partition(":")[0])
    return targets.chip(chip), devices, driver.compile_programs(config, meshes)


def _expected_names(exp: str, chip) -> set[str]:
    if exp == "flowtrain":
        split = "1(1x1)+1(1x1)" if chip.platform == "gpu" else "1(1x1)+3(3x1)"
        return ({"init/encoder", "init/backbone", "monolithic_padded/step",
                 "monolithic_packed/step", "eval"}
                | {f"encoder/{split}/forward", f"encoder/{split}/update",
                   f"backbone/{split}/step"})
    # the sampler's paged-engine programs; the engine benchmark's share the solver's shapes here
    per_agent = ("old_stats", "update", "accumulate_apply", "rollout/prefill", "rollout/decode")
    return {f"{a}/{p}" for a in ("solver", "verifier") for p in per_agent}


def _kernel_steps(exp: str, name: str) -> bool:
    """Programs whose attention is ``auto`` over packed rows: FlowTrain's LM steps and, since the
    ViT's bidirectional segment attention runs through the kernels (``causal=False``), its
    encoder's forward and update; GRPO's updates (the KV-cache engine's prefill and decode have
    kernels of their own, checked below)."""
    if exp == "flowtrain":
        encoder = name.startswith("encoder/") and name.split("/")[-1] in ("forward", "update")
        return name.endswith("/step") or name == "eval" or encoder
    return name.split("/")[-1] in ("old_stats", "update", "accumulate_apply")


def _abstract_on(tree, mesh) -> bool:
    """Every leaf a ShapeDtypeStruct whose NamedSharding is on ``mesh``'s devices (ints are
    static arguments, None an absent input)."""
    devices = set(mesh.devices.flat)
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, int):
            continue
        if not isinstance(leaf, jax.ShapeDtypeStruct) or not isinstance(leaf.sharding,
                                                                         NamedSharding):
            return False
        if set(leaf.sharding.mesh.devices.flat) != devices:
            return False
    return True


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("exp", sorted(SMALL))
def test_every_program_compiles_and_fits(exp, target):
    chip, devices, programs = _programs(exp, target)
    names = [p.name for p in programs]
    assert len(names) == len(set(names)), names
    assert set(names) == _expected_names(exp, chip), names
    for p in programs:
        assert set(p.mesh.devices.flat) <= set(devices), p.name
        assert _abstract_on((p.args, p.kwargs), p.mesh), p.name
        with jax.set_mesh(p.mesh):
            traced = p.fn.trace(*p.args, **p.kwargs)
            compiled = traced.lower().compile()
        result = targets.compile_result(chip.name, compiled)
        assert 0 < result.total_bytes <= chip.hbm_bytes, (p.name, result)
        if p.kind == "train":
            assert p.model_flops and p.model_flops > 0 and p.tokens, p.name
        calls = collections.Counter()
        for kernel, n in pallas_calls(traced).items():  # splash_mha_fwd_segmented_residuals
            calls[kernel.split("_segmented")[0]] += n
        if exp == "flowtrain" and p.name.startswith("encoder/") and p.name.endswith("/update"):
            # the encoder's update takes the forward's residuals: the backward kernels only
            assert calls[BACKWARD[chip.platform]] >= 1, (p.name, dict(calls))
        elif _kernel_steps(exp, p.name):
            assert calls[ATTENTION[chip.platform]] >= 1, (p.name, dict(calls))
            if exp == "flexmarl":
                assert calls["fused_logprobs_fwd"] >= 1, (p.name, dict(calls))
        elif p.name.endswith("rollout/decode"):  # the paged engine's decode attention, or XLA's
            assert all(k.startswith(PAGED[chip.platform]) for k in calls), (p.name, dict(calls))
        elif p.name.endswith("rollout/prefill"):
            # the engine's prefill: its kernel once per layer (TPU: the ragged paged kernel,
            # 64-wide heads padded to 128 lanes since eb47fbc; GPU: the Triton prefill kernel)
            kernel = PREFILL[chip.platform]
            assert set(calls) == {kernel} and calls[kernel] >= 1, (p.name, dict(calls))
        else:
            assert not calls, (p.name, dict(calls))


def test_marl_gradient_sum_is_laid_out_as_the_params():
    """FlexMARL's ``accumulate`` states its gradient sum's sharding, the params' (its
    ``out_shardings``): on v6e:16x16 at model 8, left to XLA, the verifier's sum came out nearly
    replicated (13.5 GiB per device for 1.9 GiB of params) and its accumulate programs did not
    fit. Here: the small variant's solver on a 2 x 2 trainer mesh of v5p:2x2x2 (data x model),
    two micro-batches per version, so ``accumulate_first`` is one of its programs (at this size
    XLA's own choice happens to match; the lowered results show whether it was stated)."""
    spec = experiments()["flexmarl"]
    config = apply_overrides(spec.get_config("quick"),
                             [*SMALL["flexmarl"], "micro_inputs=2", "trainer_model=2"])
    devices = targets.devices("v5p", "2x2x2")
    driver = importlib.import_module(spec.entry.partition(":")[0])
    programs = driver.compile_programs(config, resolve_meshes(spec, config, devices))
    first = next(p for p in programs if p.name == "solver/accumulate_first")
    assert dict(first.mesh.shape) == {"data": 2, "model": 2}
    with jax.set_mesh(first.mesh):
        lowered = first.fn.trace(*first.args, **first.kwargs).lower()
    # every result's sharding is stated (without out_shardings none is: XLA picks them)
    text = lowered.as_text()
    main = text[text.index("func.func public @main"):]
    results = main[main.index("->"):main.index("{\n")]
    assert results.count("jax.result_info") == results.count("sdy.sharding =") + \
        results.count("mhlo.sharding =") > 0, results[:300]
    sums = lowered.compile().output_shardings[0]
    params = first.args[2]  # accumulate(grad_sum, weight_sum, params, mb)
    pairs = list(zip(jax.tree.leaves(sums), jax.tree.leaves(params), strict=True))
    assert all(s.is_equivalent_to(p.sharding, p.ndim) for s, p in pairs)
    assert any(p.sharding.spec != jax.sharding.PartitionSpec() for _, p in pairs)  # not trivial
