"""Backends that never crash: auto falls back with one warning, forced kernels raise.

The build verdicts run for a patched ``dispatch.backend_platform`` (tpu / gpu on this CPU
host: jax.export lowering + footprint checks); deliberately unsupported shapes (a hidden dim
whose smallest TPU block exceeds 16 MiB, a vocab block past a GPU block's 227 KiB) must give
XLA results with exactly one warning under auto and ``KernelUnavailable`` when forced.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.rl import logprobs as lp
from pallas_kernels import dispatch
from pallas_kernels.dispatch import KernelUnavailable
from pallas_kernels.fused_logprobs import FusedLogprobsBlockSizes


def _wide(d=65536, n=4, vocab=256):
    """A hidden dim whose smallest TPU blocks (16 rows, 128 vocab columns) need > 16 MiB."""
    h = jnp.ones((n, d), jnp.bfloat16) * 0.01
    w = jnp.ones((d, vocab), jnp.bfloat16) * 0.01
    return h, w, jnp.arange(n, dtype=jnp.int32)


MESH = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def test_auto_falls_back_once_per_shape_with_a_named_reason(on_platform):
    on_platform("tpu")
    h, w, t = _wide()
    # Inside jit, as in a train step: the verdict is decided while tracing, not at run time.
    step = jax.jit(lambda h, w, t: lp.fused_logprobs(h, w, t, backend="auto").target_logp)
    with jax.set_mesh(MESH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(h, w, t)
        step(h, w + 1, t)  # same shapes: cached verdict, no second warning
    messages = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    for part in ("fused_logprobs", "tpu", "bfloat16[4,65536]", "MiB", "using XLA"):
        assert part in messages[0], messages[0]
    want = lp.fused_logprobs_xla(h, w, t).target_logp
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_forced_kernel_raises_the_same_reason(on_platform):
    on_platform("tpu")
    h, w, t = _wide()
    with jax.set_mesh(MESH), pytest.raises(KernelUnavailable,
                                           match=r"fused_logprobs unavailable on tpu .*MiB"):
        lp.fused_logprobs(h, w, t, backend="pallas")


def test_gpu_verdict_rejects_blocks_past_shared_memory(on_platform):
    on_platform("gpu")
    h, w, t = _wide(d=64, vocab=4096)
    huge = FusedLogprobsBlockSizes(platform="gpu", block_n=64, block_v=4096, block_d=64)
    with pytest.raises(KernelUnavailable, match=r"KiB per program \(budget 227 KiB\)"):
        lp.fused_logprobs(h, w, t, backend="pallas", block_sizes=huge)
    assert lp.use_pallas(h, w, t, None, own_topk=0, temperature=1.0, mode="auto")


def test_supported_shapes_pick_the_kernel_on_each_accelerator(on_platform):
    h, w, t = _wide(d=64)
    for mesh in (MESH, jax.make_mesh((8,), ("data",))):  # Auto and Explicit axes
        for platform in ("tpu", "gpu"):
            on_platform(platform)
            with jax.set_mesh(mesh):
                assert lp.use_pallas(h, w, t, None, own_topk=0, temperature=1.0, mode="auto")


def test_tpu_without_mesh_context_refuses_automatic_partitioning(on_platform):
    on_platform("tpu")
    h, w, t = _wide(d=64)
    with pytest.raises(KernelUnavailable, match="cannot be partitioned automatically"):
        lp.use_pallas(h, w, t, None, own_topk=0, temperature=1.0, mode="pallas")


def test_cpu_auto_is_xla_without_a_build():
    calls = []
    assert not dispatch.choose_kernel("k", "auto", lambda x: calls.append(x), (jnp.ones(3),))
    assert calls == []


def test_mesh_context_runs_the_kernel_in_a_row_shard_map():
    """Under jax.set_mesh the kernel runs on row shards (interpret mode) == the reference,
    gradients included (the head's gradient summed over shards)."""
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (2, 5, 16))  # 10 rows: padded to 16 over 8 devices
    w = 0.5 * jax.random.normal(k[1], (16, 200))
    t = jax.random.randint(k[2], (2, 5), 0, 200)
    blocks = FusedLogprobsBlockSizes(block_n=16, block_v=128, block_n_dw=16, block_v_dw=128)

    def loss(backend, **kw):
        def f(h, w):
            out = lp.fused_logprobs(h, w, t, backend=backend, temperature=0.8, **kw)
            return jnp.sum(out.target_logp * jnp.arange(10.0).reshape(2, 5))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)

    with jax.set_mesh(MESH):
        got = loss("pallas", interpret=True, block_sizes=blocks)
    want = loss("reference")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_pooling_auto_serves_long_bags_with_the_kernel(on_platform):
    """Bags of 9,000 ids once fell back to XLA on TPU (the row buffers were sized to the bag);
    the kernel now walks each bag in chunks, so ``auto`` builds the kernel, without a warning,
    and an unknown backend is still one error naming the valid ones."""
    from jaxflow.embeddings.pooling import pool_bags
    from pallas_kernels import lowering

    table = jax.random.normal(jax.random.key(0), (40, 128), jnp.float32)
    ids = jax.random.randint(jax.random.key(1), (2, 9000), -1, 40)
    on_platform("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        exported = lowering.export_for(lambda t, i: pool_bags(t, i, "mean", backend="auto"),
                                       table, ids, platform="tpu")
    assert "tpu_custom_call" in exported.mlir_module()
    with pytest.raises(ValueError, match="pooling backend 'cuda'"):
        pool_bags(table, ids, "sum", backend="cuda")


def test_tracker_forced_kernel_raises_on_cpu_without_interpret():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxflow import sync

    mesh = jax.make_mesh((8,), ("data",))
    leaf = jax.device_put(jnp.zeros((8 * 64,), jnp.bfloat16), NamedSharding(mesh, P("data")))
    tracker = sync.ChangeTracker({"w": leaf}, backend="pallas")
    with pytest.raises(KernelUnavailable, match="sync_diff_compact unavailable on cpu"):
        tracker.diffs({"w": leaf + 1})
    auto = sync.ChangeTracker({"w": leaf})  # auto on CPU: XLA, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (diff,) = auto.diffs({"w": leaf + 1})
    assert diff.positions.size == 8 * 64


def test_attention_auto_falls_back_on_gpu_past_shared_memory(on_platform):
    from jaxflow.flow.vlm import AttentionBackend, resolve_backend
    from jaxflow.models import attention_backends as ab

    assert resolve_backend("auto") is AttentionBackend.AUTO
    on_platform("gpu")
    # head_dim 512 in f32 (cuDNN takes bf16 / f16 only): the flash kernel's 64-row q / k / v
    # blocks exceed a GPU block's 227 KiB.
    q = jnp.zeros((1, 64, 2, 512))
    seg = jnp.ones((1, 64), jnp.int32)
    with pytest.warns(RuntimeWarning, match="flash_attention unavailable on gpu"):
        assert ab.choose_attention_backend(q, q, q, seg) == "xla"
    with pytest.raises(KernelUnavailable, match="flash_attention"):
        ab.choose_attention_backend(q, q, q, seg, backend=AttentionBackend.FLASH)
