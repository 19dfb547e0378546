"""Compile gate: every Pallas kernel compiled by the real compilers for abstract chips.

XLA:TPU (Mosaic for Pallas) for TPU v5e, v5p and v6e and XLA:GPU (Triton) for NVIDIA H100 and
H200 compile each kernel of ``pallas_kernels.catalog`` - fused log-probs, embedding bag (forward
and backward), sync diff/compact and scatter/apply, at test and production sizes, with each
chip's own block sizes - and the upstream attention kernels (splash on TPU, Pallas flash on
GPU). Nothing runs: the programs are compiled for ``pallas_kernels.targets``' abstract devices on
this CPU host, with Mosaic's VMEM and tiling checks, Triton's shared-memory check and XLA's HBM
planning. A case whose arguments alone exceed the chip's HBM is "does not fit" (asserted so), not
a failure. ``auto`` must pick the kernel (not XLA) at the production shapes on every chip,
deciding for the chip of the mesh being traced. The full size / dtype / dim matrix
(``catalog.sweep_cases``) is marked ``sweep`` and runs as its own ``.ci/run`` step.

cuDNN attention cannot compile deviceless ("cuDNN not found"): its lowering stays in
``tests/test_lowering_gate.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh

from jaxflow.models import attention_backends
from pallas_kernels import catalog, dispatch, targets

CHIPS = tuple(targets.CHIPS)
EXPORT_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}
KERNEL_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}
CASES = {c.name: c for c in catalog.kernel_cases()}
ATTENTION = {c.name: c for c in attention_backends.catalog_cases() if not c.custom_calls}
SWEEP = {c.name: c for c in catalog.sweep_cases()}


def _compile_case(case: catalog.KernelCase, chip: str) -> targets.CompileResult | None:
    """The case compiled for ``chip`` with the chip's blocks; None when it does not fit."""
    spec = targets.chip(chip)
    if case.arg_bytes() > spec.hbm_bytes:
        return None
    fn, args = case.build(EXPORT_PLATFORM[spec.platform], chip=chip)
    return targets.compile_on(fn, args, chip, keep_hlo=True)


def _assert_compiles(case: catalog.KernelCase, chip: str) -> None:
    result = _compile_case(case, chip)
    if result is None:  # "does not fit": the arguments alone exceed the chip's HBM
        assert case.arg_bytes() > targets.chip(chip).hbm_bytes
        return
    if not result.ok and result.error_kind == "hbm":
        # "does not fit": XLA's HBM planning refuses the program's buffers on this chip (the
        # kernels themselves passed Mosaic / Triton); a result, not a failure.
        assert "RESOURCE_EXHAUSTED" in result.error and "vmem" not in result.error.lower()
        return
    assert result.ok, f"{case.name} on {chip}: {result.error}"
    assert KERNEL_CALL[targets.chip(chip).platform] in result.hlo_text, case.name


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles(case, chip):
    _assert_compiles(CASES[case], chip)


@pytest.mark.parametrize("case,chip", [(name, chip) for name in sorted(ATTENTION)
                                       for chip in CHIPS
                                       if EXPORT_PLATFORM[targets.chip(chip).platform]
                                       in ATTENTION[name].platforms])
def test_attention_kernel_compiles(case, chip):
    _assert_compiles(ATTENTION[case], chip)


@pytest.mark.sweep
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", sorted(SWEEP))
def test_sweep_compiles(case, chip):
    _assert_compiles(SWEEP[case], chip)


# ------------------------------------------------------------------ the gate can say no


def _copy_kernel(rows: int, vmem_limit: int | None):
    """A copy kernel with one (rows, 1024) f32 block in and out (double-buffered: 16 * rows
    KiB of VMEM), as (fn, args)."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def fn(x):
        return pl.pallas_call(
            kernel, grid=(4,), in_specs=[pl.BlockSpec((rows, 1024), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((rows, 1024), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((4 * rows, 1024), jnp.float32),
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit))(x)

    return fn, (jax.ShapeDtypeStruct((4 * rows, 1024), jnp.float32),)


def test_an_oversized_block_is_refused_for_vmem():
    """2 x 2 x 8 MiB of blocks cannot fit v5e's default 16 MiB scoped VMEM: the compiler says
    so, and the gate's result classifies it."""
    result = targets.compile_on(*_copy_kernel(2048, None), "v5e")
    assert not result.ok and result.error_kind == "vmem", result.error


def test_min_vmem_limit_is_the_boundary():
    """The bisected limit compiles and one step below it does not."""
    step = targets.MiB
    limit = targets.min_vmem_limit(*_copy_kernel(512, None), "v5p", step=step)
    assert limit is not None and 8 * step <= limit <= 24 * step, limit
    assert targets.compile_on(*_copy_kernel(512, limit), "v5p").ok
    assert not targets.compile_on(*_copy_kernel(512, limit - step), "v5p").ok


def test_hbm_fit_is_checked_against_the_chip():
    """A program whose arguments exceed v5e's 16 GiB compiles but does not fit (the
    ``--compile-only`` rule), while it fits H200's 141 GB."""
    args = (jax.ShapeDtypeStruct((5 * 2**30,), jnp.float32),)  # 20 GiB
    small = targets.compile_on(lambda x: x + 1, args, "v5e")
    large = targets.compile_on(lambda x: x + 1, args, "h200")
    assert not small.fits() and large.fits(), (small.total_bytes, large.total_bytes)


# ----------------------------------------------------- auto decides for the traced chip


def test_sharded_embedding_step_uses_the_kernel_on_a_tpu_mesh():
    """The sharded-embeddings train step (All2All routing, dedup, pooling inside shard_map) on
    a v5e:2x2 mesh of 4 abstract chips at dim 64: ``auto`` compiles the embedding bag for the
    v5e inside the step and uses it; the whole step compiles with the kernel in it."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxflow.embeddings import (
        ShardedEmbeddings,
        TableSpec,
        make_sparse_optimizer,
        make_train_step,
    )

    dispatch.clear_cache()
    mesh = targets.mesh("v5e", (4,), ("data",))
    dim, batch, bag = 64, 256, 4
    specs = [TableSpec(f"t{i}", 8192, dim, "row_wise", "sum") for i in range(2)]
    cap = batch // 4 * bag * 2
    emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer("rowwise_adagrad", 0.05),
                            capacity=cap, bucket_capacity=-(-2 * cap // 4),
                            pooling_backend="auto")
    shardings = emb.state_shardings()
    S = jax.ShapeDtypeStruct
    tables, opt = {}, {}
    for group in emb.plan.groups:  # abstract state: nothing allocated on the abstract chips
        shape = group.global_shape(4)
        tables[group.name] = S(shape, jnp.float32, sharding=shardings["tables"][group.name])
        init = jax.eval_shape(lambda: emb.optimizer.init(shape[0], group.dim))
        opt[group.name] = {k: S(v.shape, v.dtype, sharding=shardings["opt"][group.name][k])
                           for k, v in init.items()}
    state = {"emb": {"tables": tables, "opt": opt,
                     "step": S((), jnp.int32, sharding=shardings["step"])}, "dense": {}}
    row = NamedSharding(mesh, P("data"))
    ids = {t.name: jax.ShapeDtypeStruct((batch, bag), jnp.int32, sharding=row) for t in specs}
    w = {t.name: jax.ShapeDtypeStruct((batch, dim), jnp.float32, sharding=row) for t in specs}

    def loss_fn(params, pooled, w):
        return sum(jnp.sum(jnp.square(pooled[k] - w[k])) for k in pooled), {}

    step = make_train_step(emb, loss_fn, donate=False)
    result = targets.compile_on(step, (state, ids, w), "v5e", mesh=mesh, keep_hlo=True)
    assert result.ok, result.error
    assert result.hlo_text.count("tpu_custom_call") >= 2, "no embedding-bag kernel in the step"


def _chip_mesh(chip: str) -> Mesh:
    return Mesh(targets.devices(chip)[:1], ("data",))


def _production(kind: str):
    return catalog.SIZES[kind]["production"]


def _fused_auto() -> bool:
    from jaxflow.rl import logprobs

    p = _production("fused_logprobs")
    S = jax.ShapeDtypeStruct
    return logprobs.use_pallas(S((p["n"], p["d"]), p["dtype"]), S((p["d"], p["vocab"]), p["dtype"]),
                               S((p["n"],), jnp.int32), S((p["n"], p["k"]), jnp.int32),
                               own_topk=0, temperature=1.0, mode="auto")


def _bag_auto() -> bool:
    from jaxflow.embeddings import pooling

    p = _production("embedding_bag")
    S = jax.ShapeDtypeStruct
    return pooling._kernel_builds(S((p["vocab"], p["dim"]), jnp.float32),
                                  S((p["bags"], p["bag_len"]), jnp.int32), "mean", "auto", None)


def _diff_auto() -> bool:
    from jaxflow.sync import device_diff

    p = catalog.SIZES["sync"]["production"]
    return device_diff._use_kernel("auto", p["n"], p["capacity"], False, single_device=True)


def _scatter_auto() -> bool:
    from jaxflow.sync import receiver

    p = catalog.SIZES["sync"]["production"]
    S = jax.ShapeDtypeStruct
    dst, pos, vals = S((p["n"],), jnp.uint16), S((p["capacity"],), jnp.int32), S(
        (p["capacity"],), jnp.uint16)
    return dispatch.choose_kernel("sync_scatter_apply", "auto", receiver.scatter_apply,
                                  (dst, pos, vals), options=(p["capacity"],))


def _attention_auto() -> bool:
    from jaxflow.models import attention_backends as ab

    p = _production("attention")
    S = jax.ShapeDtypeStruct
    b, t, d = p["batch"], p["tokens"], p["head_dim"]
    q = S((b, t, p["heads"], d), p["dtype"])
    kv = S((b, t, p["kv_heads"], d), p["dtype"])
    return ab.choose_attention_backend(q, kv, kv, S((b, t), jnp.int32)) != "xla"


AUTO = {"fused_logprobs": _fused_auto, "embedding_bag": _bag_auto,
        "sync_diff_compact": _diff_auto, "sync_scatter_apply": _scatter_auto,
        "attention": _attention_auto}


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("kernel", sorted(AUTO))
def test_auto_picks_the_kernel_on_every_chip(kernel, chip, recwarn):
    """Under a mesh of the chip's abstract devices, ``auto`` compiles the kernel for that chip
    (not for this CPU host) and picks it at the production shapes."""
    dispatch.clear_cache()
    with jax.set_mesh(_chip_mesh(chip)):
        assert dispatch.target_chip() == chip
        picked = AUTO[kernel]()
    fallbacks = [str(w.message) for w in recwarn.list if "using XLA" in str(w.message)
                 and not ("cudnn" in str(w.message).lower() and kernel == "attention")]
    assert picked, fallbacks
    assert not fallbacks, fallbacks
