"""Attention backends == the XLA reference; auto never crashes; bad names are clear errors.

Splash (TPU) and Pallas flash (GPU) run here in Pallas interpret mode, forward and gradient,
on packed rows with padding and grouped K/V heads; cuDNN has no interpret mode and is checked
by lowering only (``tests/test_lowering_gate.py``). Auto decisions for TPU / GPU are made with
``dispatch.backend_platform`` patched (the verdicts then export each kernel for that platform).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import attention_backends as ab
from jaxflow.models.attention import dot_product_attention, segment_causal_mask
from jaxflow.models.transformer import Transformer, TransformerConfig
from pallas_kernels import lowering
from pallas_kernels.dispatch import KernelUnavailable
from tests._cli import persistent_compile_cache


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The tests build equal forward / gradient programs again (a new ``jax.jit`` of the same
    function): each is compiled once and loaded after (jax's persistent cache)."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


TOL = dict(rtol=1e-5, atol=1e-5)  # f32
B, T, H, K, D = 2, 60, 4, 2, 16  # T 60: the wrappers pad to 64 (flash) and 128 (splash) tokens
SEGMENTS = np.stack([np.repeat([1, 2, 3, 0], [20, 26, 10, 4]),  # three samples, then padding
                     np.repeat([1, 2], [33, 27])]).astype(np.int32)
LM = TransformerConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64,
                       max_seq_len=64)


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k = jax.random.normal(keys[1], (B, T, K, D))
    v = jax.random.normal(keys[2], (B, T, K, D))
    ct = jax.random.normal(keys[3], (B, T, H, D)) * (SEGMENTS > 0)[:, :, None, None]
    return q, k, v, jnp.asarray(SEGMENTS), ct


def _out_and_grads(fn, q, k, v, seg, ct):
    """Output and d<out, ct>/d(q, k, v); ct is zero on padding queries (meaningless rows)."""
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return out, vjp(ct)


@pytest.fixture(scope="module")
def reference(qkv):
    q, k, v, seg, ct = qkv
    return _out_and_grads(lambda q, k, v, s: dot_product_attention(q, k, v,
                                                                   segment_causal_mask(s)),
                          q, k, v, seg, ct)


@pytest.mark.parametrize("backend", ["splash", "flash"])
def test_kernel_matches_xla_forward_and_gradient_interpret(backend, qkv, reference):
    q, k, v, seg, ct = qkv
    fn = jax.jit(lambda q, k, v, s, c: _out_and_grads(
        lambda q, k, v, s: ab.attention(q, k, v, s, backend=backend, interpret=True),
        q, k, v, s, c))
    out, grads = fn(q, k, v, seg, ct)
    ref_out, ref_grads = reference
    real = SEGMENTS > 0  # padding queries are meaningless in every backend
    assert out.shape == (B, T, H, D) and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref_out)[real], **TOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name  # dk, dv come back per K/V head (GQA)
        np.testing.assert_allclose(g, r, err_msg=f"d{name}", **TOL)
    assert np.all(np.isfinite(np.asarray(out)))


def _pallas_operand_shapes(fn, *args) -> list[list[tuple[int, ...]]]:
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append([tuple(v.aval.shape) for v in eqn.invars])
            for sub in lowering._sub_jaxprs(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("axes", [{"data": 2, "model": 2}, {"data": 4}, {"model": 2}])
@pytest.mark.parametrize("backend", ["splash", "flash"])
def test_kernel_per_shard_under_a_mesh_matches_xla(backend, axes, qkv, reference):
    """Under ``jax.set_mesh`` the kernel runs per shard: heads over "model" (tensor
    parallelism, K/V heads with their query heads), rows over "data" (padded to its size):
    the output and gradients equal the reference's."""
    q, k, v, seg, ct = qkv
    from jaxflow.mesh import make_mesh

    mesh = make_mesh(axes, jax.devices()[:int(np.prod(list(axes.values())))])
    rows, head = ab.shard_layout(mesh, H, K)
    assert head == ("model" if "model" in axes else None)
    assert rows == tuple(a for a in axes if a != "model")
    with jax.set_mesh(mesh):
        out, grads = jax.jit(lambda q, k, v, s, c: _out_and_grads(
            lambda q, k, v, s: ab.attention(q, k, v, s, backend=backend, interpret=True),
            q, k, v, s, c))(q, k, v, seg, ct)
    real = (SEGMENTS > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, reference[0], 0), **TOL)
    for g, r in zip(grads, reference[1]):
        np.testing.assert_allclose(g, r, **TOL)


def test_splash_reads_grouped_kv_heads_without_repeating_them(qkv):
    q, k, v, seg, _ = qkv
    (operands,) = _pallas_operand_shapes(
        lambda q, k, v, s: ab.attention(q, k, v, s, backend="splash", interpret=True),
        q, k, v, seg)
    tp = 128
    assert operands.count((B, H, tp, D)) == 1  # q only
    assert operands.count((B, K, tp, D)) == 2  # k and v, K = H / 2 heads
    (flash,) = _pallas_operand_shapes(
        lambda q, k, v, s: ab.attention(q, k, v, s, backend="flash", interpret=True),
        q, k, v, seg)
    assert flash[:3] == [(B, 64, H, D)] * 3  # the Triton kernel needs K/V repeated to H heads


def _packed_tokens():
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, LM.vocab_size)
    positions = np.zeros((B, T), np.int32)
    for r in range(B):
        for s in np.unique(SEGMENTS[r]):
            idx = np.flatnonzero(SEGMENTS[r] == s)
            positions[r, idx] = np.arange(idx.size)
    return tokens, jnp.asarray(positions), jnp.asarray(SEGMENTS)


def test_transformer_auto_equals_xla_on_cpu_and_splash_interpret_matches():
    tokens, positions, seg = _packed_tokens()
    auto = Transformer(LM, rngs=nnx.Rngs(0))  # attention="auto", the default
    xla = Transformer(dataclasses.replace(LM, attention="xla"), rngs=nnx.Rngs(0))
    assert auto.config.attention == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto on CPU is XLA without a word
        got = jax.jit(lambda t, p, s: auto.hidden_states(t, positions=p, segment_ids=s))(
            tokens, positions, seg)
    want = jax.jit(lambda t, p, s: xla.hidden_states(t, positions=p, segment_ids=s))(
        tokens, positions, seg)
    np.testing.assert_array_equal(got, want)
    splash = jax.jit(lambda t, p, s: xla.hidden_states(t, positions=p, segment_ids=s,
                                                       attention="splash", interpret=True))(
        tokens, positions, seg)
    real = SEGMENTS > 0
    np.testing.assert_allclose(np.asarray(splash)[real], np.asarray(want)[real], **TOL)


def test_remat_policies_give_the_plain_gradient():
    tokens, positions, seg = _packed_tokens()

    def grads(config):
        graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))

        def loss(params):
            model = nnx.merge(graphdef, params)
            return jnp.sum(model(tokens, positions=positions, segment_ids=seg) ** 2)

        return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

    plain = grads(LM)
    remat = grads(dataclasses.replace(LM, remat=True, remat_policy="dots_saveable"))
    for a, b in zip(remat, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_names_and_forced_kernels_off_their_platform(qkv):
    q, k, v, seg, _ = qkv
    with pytest.raises(ValueError, match=r"'pallas_gpu'; valid: auto, xla, splash, flash, cudnn"):
        TransformerConfig(attention="pallas_gpu")
    with pytest.raises(ValueError, match=r"remat_policy='everything'; valid: nothing_saveable"):
        TransformerConfig(remat=True, remat_policy="everything")
    with pytest.raises(ValueError, match=r"remat_policy='dots_saveable' needs remat=True"):
        TransformerConfig(remat_policy="dots_saveable")
    with pytest.raises(ValueError, match=r"attention backend 'fast'; valid: auto, xla"):
        ab.attention(q, k, v, seg, backend="fast")
    for name, needs in (("splash", "tpu"), ("flash", "gpu"), ("cudnn", "gpu")):
        with pytest.raises(ValueError, match=rf"'{name}' runs on {needs} only, but the JAX "
                                             r"backend is 'cpu'; valid here: auto, xla"):
            ab.attention(q, k, v, seg, backend=name)
    with pytest.raises(ValueError, match="K dividing H"):
        ab.attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), seg)
    with pytest.raises(ValueError, match="segment_ids must be int"):
        ab.attention(q, k, v, seg.astype(jnp.float32))
    assert ab.resolve_attention_backend("auto", "cpu") == "xla"
    assert ab.resolve_attention_backend("auto", "cuda") == "auto"
    assert ab.resolve_attention_backend(ab.AttentionBackend.SPLASH, "tpu") == "splash"
    from configs.flowtrain import Config, FlowConfig

    with pytest.raises(ValueError, match=r"flow.attention='pallas_gpu'; valid: auto, xla"):
        FlowConfig(attention="pallas_gpu")
    with pytest.raises(ValueError, match=r"model.attention='xla' conflicts with flow.attention"):
        Config(model=dataclasses.replace(Config().model, attention="xla"),
               flow=FlowConfig(attention="flash"))


def test_auto_on_gpu_falls_through_to_a_kernel_that_builds(on_platform, qkv):
    q, k, v, seg, _ = qkv
    on_platform("gpu")
    # f32: cuDNN is skipped (bf16 / f16 only) without a warning; flash builds for T 64.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ab.choose_attention_backend(q, k, v, seg) == "flash"
    # bf16: cuDNN is tried first; on this host (no cuDNN) its verdict fails: one warning, then
    # the next candidate.
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.warns(RuntimeWarning, match="cudnn_attention unavailable on gpu"):
        assert ab.choose_attention_backend(q16, k16, v16, seg) == "flash"
    with pytest.raises(KernelUnavailable, match="cudnn_attention"):
        ab.choose_attention_backend(q16, k16, v16, seg, backend="cudnn")


def test_auto_on_tpu_needs_a_mesh_context_on_several_devices(on_platform, qkv):
    q, k, v, seg, _ = qkv
    on_platform("tpu")
    with pytest.warns(RuntimeWarning, match="cannot be partitioned automatically"):
        assert ab.choose_attention_backend(q, k, v, seg) == "xla"
    with pytest.raises(KernelUnavailable, match="splash_attention unavailable on tpu"):
        ab.choose_attention_backend(q, k, v, seg, backend="splash")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    model = Transformer(LM, rngs=nnx.Rngs(0))
    tokens, positions, seg = _packed_tokens()
    S = jax.ShapeDtypeStruct
    with jax.set_mesh(mesh):
        # The LM's forward under the mesh: splash in a shard_map over the batch, for TPU.
        exported = lowering.export_for(
            lambda t, p, s: model(t, positions=p, segment_ids=s),
            S(tokens.shape, jnp.int32), S(positions.shape, jnp.int32), S(seg.shape, jnp.int32),
            platform="tpu")
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "splash_mha_fwd" in text
