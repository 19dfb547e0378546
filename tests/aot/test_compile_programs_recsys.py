"""``compile_programs`` of the recsys experiments compiles for abstract chips and fits.

For ``dlrm_train``, ``bench_embedding`` and ``nestpipe`` (small variants of ``quick``: the
same programs, fewer and smaller tables, so the file stays within a couple of minutes), every
program the run would execute is built on the meshes ``jaxflow.run_meshes.resolve_meshes``
gives for a v5e:2x2 (4 abstract TPU chips) and for 2 abstract H100s, compiled by the real
XLA:TPU / XLA:GPU compiler, and must fit the chip's HBM per device. Under the configs'
``pooling_backend="auto"`` the embedding-bag Pallas kernel must be inside every program that
pools bags (forward and backward in a training step), and absent from the baselines that do
not use it.
"""

from __future__ import annotations

import importlib

import jax
import pytest

from jaxflow.config import apply_overrides, experiments
from jaxflow.run_meshes import resolve_meshes
from pallas_kernels import dispatch, targets

TARGETS = {"v5e": "v5e:2x2", "h100": "1x1x2"}
KERNEL_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}

#: (experiment, overrides of its quick variant): the same program set, small shapes
SMALL = {
    "dlrm_train": ["data.vocab_sizes=583,12517,100000", "model.embed_dim=16",
                   "model.bottom=16", "model.top=16", "train.batch_size=256"],
    "bench_embedding": ["num_tables=2", "vocab_size=8192", "dim=32", "batch_size=256",
                        "capacity=0", "kernel_vocab=512", "kernel_bags=32"],
    "nestpipe": ["vocab_sizes=5000,1000", "embed_dim=16", "bottom=16", "top=16",
                 "batch_size=256", "micro_batches=2",
                 "pipelines=sync,dbp,dbp+fwp,sync_accum"],
}

#: program -> Pallas embedding-bag calls in it (tables x 1 forward, x 2 with the backward)
def _expected_kernels(name: str, config) -> dict[str, int]:
    if name == "dlrm_train":
        t = len(config.data.vocab_sizes)
        return {"train/step": 2 * t, "eval/predict": t}
    if name == "bench_embedding":
        return {"jaxflow/step": 2 * config.num_tables, "dense_take/step": 0,
                "sparse_take/step": 0, "sparse_take_one_device/step": 0, "kernel/pallas": 1,
                "kernel/reference": 0}
    t, n = len(config.vocab_sizes), config.micro_batches
    return {"N1-per_micro_batch/route": 0, "N1-per_micro_batch/exchange": 0,
            "N1-per_micro_batch/compute": 2 * t, "N1-per_micro_batch/patch": 0,
            f"N{n}-per_micro_batch/route": 0, f"N{n}-per_micro_batch/frozen": 2 * t * n,
            f"N{n}-per_micro_batch/patch": 0, f"N{n}-window/route": 0,
            f"N{n}-window/exchange": 0, f"N{n}-window/compute": 2 * t * n}


def _programs(name: str, chip: str):
    spec = experiments()[name]
    config = apply_overrides(spec.get_config("quick"), SMALL[name])
    driver = importlib.import_module(spec.entry.partition(":")[0])
    meshes = resolve_meshes(spec, config, targets.devices(chip, TARGETS[chip]))
    return config, driver.compile_programs(config, meshes)


@pytest.mark.parametrize("chip", tuple(TARGETS))
@pytest.mark.parametrize("name", tuple(SMALL))
def test_every_program_compiles_fits_and_pools_with_the_kernel(name, chip):
    dispatch.clear_cache()
    config, programs = _programs(name, chip)
    want = _expected_kernels(name, config)
    assert [p.name for p in programs] == list(want)
    spec = targets.chip(chip)
    devices = set(targets.devices(chip, TARGETS[chip]))
    for p in programs:
        assert set(p.mesh.devices.flat) <= devices, p.name
        leaves = jax.tree.leaves((p.args, p.kwargs))
        assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                              for x in leaves), f"{p.name}: arguments not abstract and placed"
        with jax.set_mesh(p.mesh):
            compiled = p.fn.lower(*p.args, **p.kwargs).compile()
        result = targets.compile_result(chip, compiled, keep_hlo=True)
        assert result.fits(), (f"{p.name} on {chip}: {result.total_bytes} bytes per device > "
                               f"{spec.hbm_bytes}")
        assert result.argument_bytes > 0 and result.total_bytes > 0, p.name
        kernels = result.hlo_text.count(KERNEL_CALL[spec.platform])
        assert kernels == want[p.name], f"{p.name} on {chip}: {kernels} kernel calls"
        if p.kind == "train":  # the dense part's analytic FLOPs of one global batch
            batch = config.train.batch_size if name == "dlrm_train" else config.batch_size
            assert p.model_flops > 0 and p.tokens == batch, p.name


def test_programs_are_the_runs_own_builders():
    """The programs are the jitted functions the run's builders return, sharded as the run
    places them: the embedding tables split over "data", the dense state replicated."""
    from jax.sharding import PartitionSpec as P

    config, programs = _programs("dlrm_train", "v5e")
    step = next(p for p in programs if p.name == "train/step")
    state = step.args[0]
    for table in state["emb"]["tables"].values():
        assert table.sharding.spec in (P("data"), P())
    sharded = [t for g, t in state["emb"]["tables"].items() if g.startswith("sharded")]
    assert sharded and all(t.sharding.spec == P("data") for t in sharded)
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(state["dense"]))
    ids, rest = step.args[1], step.args[2]
    assert set(ids) == {f"c{i}" for i in range(len(config.data.vocab_sizes))}
    assert all(x.sharding.spec == P("data") for x in jax.tree.leaves((ids, rest)))
