"""Lowering gate: every Pallas kernel and every system step lowers for TPU and GPU, and fits.

(a) Each kernel of ``pallas_kernels.catalog`` at test and production sizes (6 kernels x 2
sizes x {tpu, cuda} = 24 lowerings) exports with ``jax.export`` (Mosaic TPU under a declared
TPU device kind; Triton for cuda), the exported module really contains the kernel, and every
``pallas_call``'s per-program footprint fits: TPU in + out + scratch blocks x2 <= 16 MiB
(HBM / pl.ANY refs excluded); Triton peak of live loads, stores, loop carries and dot results
<= 227 KiB (``pallas_kernels.lowering``).
The attention backends (``attention_backends.catalog_cases``: splash for tpu, Pallas flash and cuDNN
for cuda, forward and forward + gradient, 2 sizes = 12 lowerings) export on their platform
with their kernel inside, and their Pallas programs fit.

(b) Each system's jitted step, traced with ``dispatch.backend_platform`` patched to the target
platform, so its ``auto`` backends resolve as they would there (the dispatch verdict then
exports the kernel alone for that platform), exports for that platform on the 8 fake CPU
devices, with the kernel inside where ``auto`` picks it.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.models import attention_backends
from pallas_kernels import catalog, dispatch, lowering

PLATFORMS = ("tpu", "cuda")
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
CASES = {case.name: case for case in catalog.kernel_cases()}
ATTENTION = {case.name: case for case in attention_backends.catalog_cases()}


@contextlib.contextmanager
def building_for(platform: str, monkeypatch):
    """Programs traced inside are built as on ``platform`` (fresh trace caches both ways)."""
    jax.clear_caches()
    dispatch.clear_cache()
    monkeypatch.setattr(dispatch, "backend_platform", lambda: catalog.block_platform(platform))
    try:
        yield
    finally:
        monkeypatch.undo()
        jax.clear_caches()
        dispatch.clear_cache()


def _check_footprints(footprints, platform):
    assert footprints, "no pallas_call traced"
    for fp in footprints:
        if platform == "tpu":
            assert fp.tpu_bytes <= fp.tpu_budget, (fp.name, fp.tpu_bytes, fp.blocks)
        else:
            assert fp.triton_bytes <= lowering.GPU_SMEM_BUDGET, (fp.name, fp.triton_bytes)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_lowers_and_fits(case, platform):
    fn, args = CASES[case].build(platform)
    exported = lowering.export_for(fn, *args, platform=platform)
    assert exported.platforms == (platform,)
    assert KERNEL_CALL[platform] in exported.mlir_module()
    _check_footprints(lowering.pallas_footprints(fn, *args), platform)


@pytest.mark.parametrize("case,platform", [(name, p) for name in sorted(ATTENTION)
                                           for p in ATTENTION[name].platforms])
def test_attention_kernel_lowers_on_its_platform(case, platform):
    exported = ATTENTION[case].export(platform)
    assert exported.platforms == (platform,)
    text = exported.mlir_module()
    for call in ATTENTION[case].custom_calls or (KERNEL_CALL[platform],):
        assert call in text, call
    other = [p for p in PLATFORMS if p not in ATTENTION[case].platforms]
    for p in other:
        with pytest.raises(ValueError, match=f"is built for {platform}"):
            ATTENTION[case].export(p)


@pytest.mark.parametrize("case", [name for name in sorted(ATTENTION)
                                  if not ATTENTION[name].custom_calls])
def test_attention_kernel_fits(case):
    (platform,) = ATTENTION[case].platforms
    fn, args = ATTENTION[case].build(platform)
    _check_footprints(lowering.pallas_footprints(fn, *args), platform)


@pytest.mark.parametrize("dtype,platform,fits", [
    ("bfloat16", "tpu", True), ("bfloat16", "cuda", True), ("float32", "cuda", True),
    # f32 at d 8,192 and 129 id columns: the blocks' estimate exceeds the default 16 MiB
    # scoped limit, so the kernel must raise its own limit (whether that compiles is the
    # compile gate's question, tests/aot/).
    ("float32", "tpu", False),
])
def test_fused_logprobs_range_corner(dtype, platform, fits):
    """d 8,192, V 262,144, K 128 (the top of the stated range), forward and backward."""
    from pallas_kernels import fused_logprobs as fl

    dt = jnp.dtype(dtype)
    n, d, vocab, k = 8192, 8192, 262_144, 128
    blocks = fl.FusedLogprobsBlockSizes.get_default(catalog.block_platform(platform), d=d,
                                                    dtype=dt, num_ids=k + 1)

    def bwd(h, w, t, ids):
        return jax.grad(lambda h, w: jnp.sum(fl.fused_logprobs(h, w, t, ids, block_sizes=blocks)
                                             .topk_logp), argnums=(0, 1))(h, w)

    S = jax.ShapeDtypeStruct
    args = (S((n, d), dt), S((d, vocab), dt), S((n,), jnp.int32), S((n, k), jnp.int32))
    footprints = lowering.pallas_footprints(bwd, *args)
    assert len(footprints) == 3
    if fits:
        _check_footprints(footprints, platform)
    else:
        big = [fp for fp in footprints if fp.tpu_bytes > lowering.TPU_VMEM_BUDGET]
        assert big and all(fp.vmem_limit_bytes and fp.vmem_limit_bytes > lowering.TPU_VMEM_BUDGET
                           for fp in big), [(fp.name, fp.tpu_bytes, fp.vmem_limit_bytes)
                                            for fp in footprints]


def test_footprint_counts_blocks_twice_and_skips_hbm_refs():
    """The TPU rule on a hand-sized kernel: 2 x (in + out + scratch), pl.ANY excluded."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_ref, hbm_ref, o_ref, acc_ref):
        del hbm_ref
        acc_ref[...] = x_ref[...]
        o_ref[...] = acc_ref[...]

    def f(x, big):
        return pl.pallas_call(
            kernel, grid=(4,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], name="toy")(x, big)

    args = (jax.ShapeDtypeStruct((32, 128), jnp.float32),
            jax.ShapeDtypeStruct((4096, 4096), jnp.float32))
    (fp,) = lowering.pallas_footprints(f, *args)
    assert fp.name == "toy" and fp.grid == (4,)
    assert fp.tpu_bytes == 2 * 3 * 8 * 128 * 4
    assert [b[3] for b in fp.blocks] == [False, True, False, False]


def test_gate_rejects_a_kernel_that_breaks_tpu_tiling():
    """The gate can fail: a (1, 256) block of a (4, 256) array is refused by Mosaic TPU."""
    from jax.experimental import pallas as pl

    def f(x):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
                              grid=(4,), in_specs=[pl.BlockSpec((1, 256), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((1, 256), lambda i: (i, 0)),
                              out_shape=jax.ShapeDtypeStruct((4, 256), jnp.float32))(x)

    with pytest.raises(Exception, match="divisible by 8 and 128"):
        lowering.export_for(f, jax.ShapeDtypeStruct((4, 256), jnp.float32), platform="tpu")


# ------------------------------------------------------------------------------ systems


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


_LAST_GRPO_KEY: tuple = ()


def _grpo_steps():
    """(update step, old-stats step, their abstract args) of a tiny GRPO policy, backend auto."""
    from jaxflow.mesh import make_mesh
    from jaxflow.models.transformer import TransformerConfig
    from jaxflow.rl import grpo
    from jaxflow.rl.policy_loss import PolicyLossConfig
    from jaxflow.train.lm_state import OptimConfig

    mesh = make_mesh({"data": 8})
    model = TransformerConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                              d_ff=64, max_seq_len=32)
    config = grpo.GRPOConfig(prompts_per_rollout=2, group_size=4, max_new_tokens=4,
                             loss=PolicyLossConfig(correction="sis"), sis_topk=4,
                             logprob_backend="auto")
    grpo.compiled_functions.cache_clear()
    global _LAST_GRPO_KEY
    _LAST_GRPO_KEY = (model, mesh, config, OptimConfig(warmup_steps=0), 10)
    fns, tx, shardings, old_fn, update = grpo.compiled_functions(*_LAST_GRPO_KEY)
    from jaxflow.train.state import TrainState

    params = fns.abstract_params()
    rep = NamedSharding(mesh, P())
    policy = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          TrainState.abstract(tx, params), shardings)
    b, n, k = 8, 4, 4
    row = NamedSharding(mesh, P("data"))
    S = jax.ShapeDtypeStruct
    mb = grpo.MiniBatch(S((b, 3), jnp.int32, sharding=row), S((b,), jnp.int32, sharding=row),
                        S((b, n), jnp.int32, sharding=row), S((b, n), jnp.float32, sharding=row),
                        S((b, n), jnp.float32, sharding=row), S((b,), jnp.float32, sharding=row))
    old = grpo.OldStats(S((b, n), jnp.float32, sharding=row),
                        S((b, n, k), jnp.float32, sharding=row),
                        S((b, n, k), jnp.int32, sharding=row), S((b, n), jnp.float32, sharding=row))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    # (name, fn taking every argument positionally, abstract args, trace context)
    # Under the trainer mesh (jax.set_mesh) the kernel runs in its own row shard_map; without
    # a mesh context, auto must fall back on TPU (Mosaic refuses automatic partitioning).
    on_mesh = functools.partial(jax.set_mesh, mesh)
    return [("grpo_update", lambda p, m, o, k: update(p, m, o, key=k), (policy, mb, old, key),
             on_mesh),
            ("grpo_old_stats", lambda p, m: old_fn(p, None, m), (params, mb), on_mesh)]


def _embedding_step():
    from jaxflow.embeddings import (
        ShardedEmbeddings,
        TableSpec,
        make_sparse_optimizer,
        make_train_step,
    )
    from jaxflow.mesh import make_mesh

    mesh = make_mesh({"data": 8})
    specs = [TableSpec("a", 64, 128, "row_wise", "mean")]
    emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer("sgd", 0.1), capacity=16,
                            pooling_backend="auto")

    def loss_fn(params, pooled, batch):
        return jnp.sum(pooled["a"] * batch["w"]), {}

    step = make_train_step(emb, loss_fn, donate=False)
    state = {"emb": _abstract(emb.init(0)), "dense": {}}
    row = NamedSharding(mesh, P("data"))
    ids = {"a": jax.ShapeDtypeStruct((16, 4), jnp.int32, sharding=row)}
    batch = {"w": jax.ShapeDtypeStruct((16, 128), jnp.float32, sharding=row)}
    return [("embedding_train_step", step, (state, ids, batch), contextlib.nullcontext)]


def _tracker_compaction():
    """The tracker's auto decision for a sharded bf16 leaf, then its in-mesh compaction."""
    from jaxflow import sync
    from jaxflow.mesh import make_mesh
    from jaxflow.sync import tracker as tr

    mesh = make_mesh({"data": 8})
    sharding = NamedSharding(mesh, P("data"))
    leaf = jax.device_put(jnp.zeros((8 * 2048,), jnp.bfloat16), sharding)
    tracker = sync.ChangeTracker({"w": leaf})
    capacity = 128
    backend = "pallas" if tracker._use_kernel(leaf, capacity) else "xla"
    fn = tr.shard_compact_fn(mesh, sharding.spec, tuple(leaf.shape), capacity, backend, False)
    arg = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return [("sync_tracker_compact", fn, (arg, arg), contextlib.nullcontext)]


def _vlm_backbone_step():
    from jaxflow.flow.digits_data import tokenizer
    from jaxflow.flow.steps import build_sides, make_backbone_step
    from jaxflow.flow.vit import ViTConfig
    from jaxflow.flow.vlm import ROW_KEYS, AttentionBackend
    from jaxflow.mesh import make_mesh
    from jaxflow.models.transformer import TransformerConfig
    from jaxflow.train.lm_state import OptimConfig

    mesh = make_mesh({"data": 8})
    vit = ViTConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, out_dim=32)
    lm = TransformerConfig(vocab_size=tokenizer().vocab_size, d_model=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, d_ff=64, max_seq_len=128)
    sides = build_sides(vit, lm, mesh, mesh, OptimConfig(warmup_steps=1), 10,
                        backend=AttentionBackend.AUTO)
    step = make_backbone_step(sides)
    bb_state = jax.eval_shape(lambda: sides.init(jax.random.key(0))[1])
    bb_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            bb_state, sides.bb_state_shardings)
    row = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    rows = {k: jax.ShapeDtypeStruct((8, 64), jnp.int32 if k != "loss_mask" else jnp.float32,
                                    sharding=row) for k in ROW_KEYS}
    embeds = jax.ShapeDtypeStruct((16, lm.d_model), jnp.float32, sharding=rep)
    denom = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    return [("vlm_backbone_step", step, (bb_state, embeds, rows, denom), contextlib.nullcontext)]


SYSTEMS = {"grpo": _grpo_steps, "embeddings": _embedding_step, "sync": _tracker_compaction,
           "vlm": _vlm_backbone_step}
# Where `auto` must pick the kernel: everywhere (the VLM backbone step is built with
# ``jit_on(backbone mesh)``, so splash runs per shard on TPU although the caller sets no mesh
# context on these 8 devices) ...
EXPECT_KERNEL = {(system, platform) for system in SYSTEMS for platform in ("tpu", "cuda")}
# ... and the attention kernel inside (f32 models: flash, not cuDNN, on cuda).
EXPECT_ATTENTION = {("grpo", "tpu"): "splash_mha_fwd", ("grpo", "cuda"): "mha_forward",
                    ("vlm", "tpu"): "splash_mha_fwd", ("vlm", "cuda"): "mha_forward"}


def test_grpo_steps_set_their_own_mesh_context(monkeypatch):
    """The GRPO steps are built with ``jit_on(trainer mesh)``: called with no mesh context by
    the caller on 8 devices they still trace under the trainer mesh and use the TPU kernel.
    The same function jitted bare (no context, 8 devices) gets a negative TPU verdict (one
    warning) and still lowers, on XLA."""
    from jaxflow.mesh import MeshJit

    with building_for("tpu", monkeypatch):
        (_, update, update_args, _), (_, old, old_args, _) = _grpo_steps()
        exported = lowering.export_for(old, *old_args, platform="tpu", declare_device=False)
        assert KERNEL_CALL["tpu"] in exported.mlir_module()
        from jaxflow.rl import grpo

        jitted = grpo.compiled_functions.cache_info()  # the cached steps are MeshJit
        assert jitted.currsize == 1
        _, _, _, old_fn, _ = grpo.compiled_functions(*_LAST_GRPO_KEY)
        assert isinstance(old_fn, MeshJit)
        bare = old_fn.jitted  # the same jax.jit, traced without the trainer mesh
        with pytest.warns(RuntimeWarning, match="cannot be partitioned automatically"):
            exported = lowering.export_for(lambda p, m: bare(p, None, m), *old_args,
                                           platform="tpu", declare_device=False)
        assert KERNEL_CALL["tpu"] not in exported.mlir_module()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_system_steps_lower_with_auto_backends(system, platform, monkeypatch):
    with building_for(platform, monkeypatch):
        for name, fn, args, context in SYSTEMS[system]():
            # The steps' own shard_maps name the concrete CPU mesh, which a declared TPU
            # device kind would contradict; the kernels inside declare it for their verdicts.
            with context():
                exported = lowering.export_for(fn, *args, platform=platform,
                                               declare_device=False)
            assert exported.nr_devices == 8, name
            text = exported.mlir_module()
            has_kernel = KERNEL_CALL[platform] in text
            assert has_kernel == ((system, platform) in EXPECT_KERNEL), (name, has_kernel)
            if (system, platform) in EXPECT_ATTENTION:
                assert EXPECT_ATTENTION[system, platform] in text, name
