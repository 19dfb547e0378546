"""Compile gate for the rollout's paged attention: the upstream kernels at Qwen3-8B shapes.

Each backend of ``jaxflow.rollout.paged_attention`` is compiled by the real compilers for
abstract chips (nothing runs): the upstream TPU decode kernel (``tpu``) and ragged kernel
(a decode batch, T = 256 queries, and a mixed chunked-prefill batch, T = 2048) by XLA:TPU with
Mosaic for v5e / v5p / v6e, the upstream GPU decode kernel (``gpu``) by XLA:GPU with Triton for
H100 / H200. Shapes: Qwen3-8B's heads (32 query heads, 8 K/V heads, head_dim 128), bf16, 256
sequences at contexts 4k and 32k, page sizes 16 and 128 (and head_dim 64, Llama-3.2-1B's
heads, at 4k: the padded layout, decode and ragged), one layer's pool holding every
sequence at the full context (P = 256 * context / page size). The ragged kernel's page table
lives in SMEM (1 MiB): at 32k with pages of 16 it is refused, asserted so. Where that pool does not fit the
chip's HBM (32k on v5e and v6e), the chip compiles its shard of a tensor-parallel mesh (K/V
heads over tp chips, the smallest tp in 1, 2, 4, 8 that fits; recorded as ``tp``). ``auto``
must choose the kernel (its verdict compiled for the chip of the mesh) at every shape.

With ``JAXFLOW_ROLLOUT_REPORT=<path>`` the last test writes the compiled memory and a roofline
per chip as JSON (``experiments/compile_reports/rollout_paged_attention.json``):

  JAXFLOW_COMPILE_GATE=1 JAXFLOW_ROLLOUT_REPORT=experiments/compile_reports/rollout_paged_attention.json \\
      /work/.venv-aot/bin/python -m pytest -q tests/aot/test_rollout_paged_attention_gate.py

Roofline (per chip, decode is bound by HBM reads): a decode step of B sequences at context L
reads every cached K/V byte once (L * kv_bytes_per_token per sequence, all layers) and the
weights once; per chip, tokens/s = HBM bandwidth / (L * kv_bytes_per_token + weight_bytes / B),
independent of how many chips share the heads (each reads its 1/tp of both and the group emits
B tokens per step). ``kv_only`` drops the weights. Figures at L = the full context (the last
step; a sequence decoding from its prompt to L reads less on average).
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxflow.models.architectures import shipped_config
from jaxflow.models.transformer import Transformer, param_count
from jaxflow.rollout import paged_attention as pa
from pallas_kernels import dispatch, targets

MODEL = shipped_config("qwen3-8b")
H, KVH, D = MODEL.n_heads, MODEL.n_kv_heads, MODEL.head_dim
BATCH = 256
CONTEXTS = (4096, 32768)
PAGE_SIZES = (16, 128)
RAGGED_TOKENS = (BATCH, 2048)  # a decode batch; a chunked-prefill batch (max batched tokens)
DTYPE = jnp.bfloat16
KERNEL_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}
TPU, GPU = targets.TPU_CHIPS, targets.GPU_CHIPS
HBM_FRACTION = 0.9  # a shape "fits" when its arguments take at most this much of HBM
_RESULTS: dict[tuple, dict] = {}


def _tp(chip: str, context: int, page: int) -> int:
    """The smallest tensor-parallel degree whose per-chip pool fits the chip."""
    pool = 2 * BATCH * context * KVH * D * jnp.dtype(DTYPE).itemsize  # K and V, one layer
    hbm = targets.chip(chip).hbm_bytes * HBM_FRACTION
    return next(t for t in (1, 2, 4, 8) if pool / t <= hbm)


def _sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def decode_args(context: int, page: int, tp: int):
    """(q, k_pages, v_pages, lengths, page_table) of one chip's shard."""
    pps = context // page
    pool = (KVH // tp, BATCH * pps, page, D)
    return (_sds((BATCH, H // tp, D), DTYPE), _sds(pool, DTYPE), _sds(pool, DTYPE),
            _sds((BATCH,)), _sds((BATCH, pps)))


def ragged_args(context: int, page: int, tp: int, tokens: int):
    """(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs) of one chip's shard."""
    pps = context // page
    return (_sds((tokens, H // tp, D), DTYPE), _sds((BATCH * pps, page, 2 * KVH // tp, D), DTYPE),
            _sds((BATCH,)), _sds((BATCH, pps)), _sds((BATCH + 1,)), _sds((1,)))


def _compile(kernel: str, chip: str, context: int, page: int, tokens: int = BATCH) -> dict:
    key = (kernel, chip, context, page, tokens)
    if key not in _RESULTS:
        tp = _tp(chip, context, page)
        if kernel == "ragged":
            fn, args = pa.tpu_ragged_paged_attention, ragged_args(context, page, tp, tokens)
        else:
            fn = {"tpu": pa.tpu_paged_attention, "gpu": pa.gpu_paged_attention}[kernel]
            args = decode_args(context, page, tp)
        r = targets.compile_on(fn, args, chip, keep_hlo=True)
        pool_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in args[1:3]
                         if len(a.shape) == 4)
        _RESULTS[key] = dict(
            kernel=kernel, chip=chip, context=context, page_size=page, query_tokens=tokens,
            tp=tp, q_heads=H // tp, kv_heads=KVH // tp, pages=BATCH * context // page,
            ok=r.ok, error=r.error, custom_call=KERNEL_CALL[targets.chip(chip).platform]
            in r.hlo_text, pool_bytes=pool_bytes, argument_bytes=r.argument_bytes,
            output_bytes=r.output_bytes, temp_bytes=r.temp_bytes)
    return _RESULTS[key]


def _assert_ok(result: dict) -> None:
    where = {k: result[k] for k in ("kernel", "chip", "context", "page_size", "query_tokens")}
    assert result["ok"], f"{where}: {result['error']}"
    assert result["custom_call"], f"{where}: no kernel call in the compiled program"
    assert result["argument_bytes"] >= result["pool_bytes"] > 0
    assert result["argument_bytes"] <= targets.chip(result["chip"]).hbm_bytes


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("chip", TPU)
def test_tpu_decode_kernel_compiles(chip, context, page):
    _assert_ok(_compile("tpu", chip, context, page))


@pytest.mark.parametrize("tokens", RAGGED_TOKENS)
@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("chip", TPU)
def test_tpu_ragged_kernel_compiles(chip, context, page, tokens):
    result = _compile("ragged", chip, context, page, tokens)
    if 4 * BATCH * context // page > pa.TPU_SMEM_TABLE:
        # the kernel prefetches the whole page table into SMEM (1 MiB): 256 x 32k in pages of
        # 16 is 2 MiB, refused by the compiler (and by ragged_paged_attention's own check)
        assert not result["ok"] and "space=smem" in result["error"], result
        return
    _assert_ok(result)


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("chip", GPU)
def test_gpu_decode_kernel_compiles(chip, context, page):
    _assert_ok(_compile("gpu", chip, context, page))


def _auto_hlo(fn, args, chip: str) -> str:
    dispatch.clear_cache()
    r = targets.compile_on(fn, args, chip, keep_hlo=True)
    assert r.ok, f"auto on {chip}: {r.error}"
    return r.hlo_text


@pytest.mark.parametrize("chip", TPU + GPU)
def test_auto_takes_the_kernel(chip):
    """``auto`` picks the platform's kernel for the production decode (4k, the chip's largest
    page size here) and, on TPU, the ragged kernel; no warning (no fallback)."""
    platform = targets.chip(chip).platform
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # auto's fallback warns
        hlo = _auto_hlo(pa.paged_attention, decode_args(4096, 128, 1), chip)
        assert KERNEL_CALL[platform] in hlo
        if platform == "tpu":
            hlo = _auto_hlo(pa.ragged_paged_attention, ragged_args(4096, 128, 1, BATCH), chip)
            assert KERNEL_CALL[platform] in hlo


SMALL_HEADS = (32, 8, 64)  # Llama-3.2-1B's (H, KVH, head_dim): head_dim 64, which Mosaic's
# 128-lane blocks reject in upstream's decode kernel; it runs in the padded layout


def small_head_args(context: int, page: int):
    """(q, k_pages, v_pages, lengths, page_table) at ``SMALL_HEADS``, BATCH rows, bf16."""
    h, kvh, d = SMALL_HEADS
    pps = context // page
    pool = (kvh, BATCH * pps, page, d)
    return (_sds((BATCH, h, d), DTYPE), _sds(pool, DTYPE), _sds(pool, DTYPE), _sds((BATCH,)),
            _sds((BATCH, pps)))


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("chip", TPU)
def test_tpu_decode_kernel_at_head_dim_64_compiles(chip, page):
    """The padded layout compiles where the raw 64-lane kernel does not, and ``auto`` takes it
    (no fallback warning) at the largest page size."""
    args = small_head_args(4096, page)
    r = targets.compile_on(pa.tpu_paged_attention, args, chip, keep_hlo=True)
    assert r.ok, f"{chip} page {page}: {r.error}"
    assert KERNEL_CALL["tpu"] in r.hlo_text
    if page == max(PAGE_SIZES):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert KERNEL_CALL["tpu"] in _auto_hlo(pa.paged_attention, args, chip)


@pytest.mark.parametrize("chip", TPU)
def test_ragged_kernel_at_head_dim_64_compiles(chip):
    """The ragged kernel in the padded layout at ``SMALL_HEADS`` (16 sequences of 1k tokens in
    pages of 128, a chunk of 256 query tokens; small: the kernel's compile is what is checked)
    compiles, its q padded to 128 lanes. ``auto`` taking it in an engine's prefill:
    ``tests/aot/test_rollout_pool_layout_gate.py``."""
    h, kvh, d = SMALL_HEADS
    seqs, pps, tokens = 16, 1024 // 128, 256
    args = (_sds((tokens, h, d), DTYPE), _sds((seqs * pps, 128, 2 * kvh, d), DTYPE),
            _sds((seqs,)), _sds((seqs, pps)), _sds((seqs + 1,)), _sds((1,)))
    r = targets.compile_on(pa.tpu_ragged_paged_attention, args, chip, keep_hlo=True)
    assert r.ok, f"{chip}: {r.error}"
    assert KERNEL_CALL["tpu"] in r.hlo_text
    assert f"bf16[{tokens},{h},128]" in r.hlo_text, "the kernel's q is not padded to 128 lanes"


MESHES = {"v5p": ("v5p:2x2x1", 4), "h100": ("1x1x8", 8)}  # chip: (topology, model axis)


@pytest.mark.parametrize("chip", sorted(MESHES))
def test_auto_under_a_tensor_parallel_mesh(chip):
    """Under a mesh of abstract chips with heads over "model", ``auto`` takes the kernel in a
    shard_map: each device holds 1/tp of the pool (XLA's per-device argument bytes say so)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    topology, tp = MESHES[chip]
    mesh = targets.mesh(chip, (1, tp), ("data", "model"), topology)
    platform = targets.chip(chip).platform
    specs = (P(None, "model"), P("model"), P("model"), P(), P())
    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))
                 for a, sp in zip(decode_args(4096, 128, 1), specs))
    cases = [(pa.paged_attention, args)]
    if platform == "tpu":
        rspecs = (P(None, "model"), P(None, None, "model"), P(), P(), P(), P())
        cases.append((pa.ragged_paged_attention, tuple(
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))
            for a, sp in zip(ragged_args(4096, 128, 1, BATCH), rspecs))))
    for fn, a in cases:
        dispatch.clear_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            r = targets.compile_on(fn, a, chip, mesh=mesh, keep_hlo=True)
        assert r.ok, f"{fn.__name__} on {chip} x{tp}: {r.error}"
        assert KERNEL_CALL[platform] in r.hlo_text, fn.__name__
        pool = 2 * BATCH * 4096 * KVH * D * 2
        assert pool // tp <= r.argument_bytes < pool // tp + 2**20, (fn.__name__, r.argument_bytes)
        _RESULTS[("mesh", fn.__name__, chip)] = dict(
            kernel=fn.__name__, chip=chip, mesh=f"{topology} model={tp}", context=4096,
            page_size=128, per_device_argument_bytes=r.argument_bytes,
            per_device_temp_bytes=r.temp_bytes)


@functools.cache
def _weight_bytes() -> int:
    model = nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0)))
    return param_count(model) * jnp.dtype(MODEL.param_dtype).itemsize


def roofline(chip: str, context: int) -> dict:
    """Pool bytes and roofline decode tokens/s per chip for BATCH sequences at ``context``."""
    spec = targets.chip(chip)
    kv_per_token = 2 * MODEL.n_layers * KVH * D * jnp.dtype(DTYPE).itemsize
    pool = BATCH * context * kv_per_token  # every layer, every sequence at the full context
    weights = _weight_bytes()
    tp = KVH  # the widest head split: one K/V head per chip
    free = spec.hbm_bytes - weights / tp
    return dict(
        chip=chip, context=context, batch=BATCH, hbm_bytes=spec.hbm_bytes,
        hbm_bandwidth=spec.hbm_bandwidth, kv_bytes_per_token=kv_per_token,
        pool_bytes_all_chips=pool, tp=tp, pool_bytes_per_chip=pool // tp,
        weight_bytes_per_chip=weights // tp,
        pool_fits_per_chip=pool / tp + weights / tp <= spec.hbm_bytes,
        max_sequences_at_context_per_tp_group=int(free * tp // (context * kv_per_token)),
        decode_tokens_per_s_per_chip_kv_only=spec.hbm_bandwidth / (context * kv_per_token),
        decode_tokens_per_s_per_chip=spec.hbm_bandwidth / (context * kv_per_token
                                                           + weights / BATCH))


def test_report():
    """Every compiled case ran above; the roofline is self-consistent; the JSON when asked."""
    rows = [roofline(c, ctx) for c in TPU + GPU for ctx in CONTEXTS]
    for r in rows:  # the analytic pool is the compiled one-layer pool (tp = 1) times the layers
        one_layer = _compile("gpu" if r["chip"] in GPU else "tpu", r["chip"], 4096, 128)
        per_layer = one_layer["pool_bytes"] * one_layer["tp"] * r["context"] // 4096
        assert r["pool_bytes_all_chips"] == per_layer * MODEL.n_layers
        assert r["decode_tokens_per_s_per_chip"] < r["decode_tokens_per_s_per_chip_kv_only"]
    path = os.environ.get("JAXFLOW_ROLLOUT_REPORT")
    if not path:
        pytest.skip("set JAXFLOW_ROLLOUT_REPORT=<path> to write the report")
    compiled = [_compile(k, c, ctx, p, t) for k, chips, toks in (
        ("tpu", TPU, (BATCH,)), ("ragged", TPU, RAGGED_TOKENS), ("gpu", GPU, (BATCH,)))
        for c in chips for ctx in CONTEXTS for p in PAGE_SIZES for t in toks]
    report = dict(
        model=dict(name="Qwen3-8B", layers=MODEL.n_layers, q_heads=H, kv_heads=KVH,
                   head_dim=D, dtype=jnp.dtype(DTYPE).name, weight_bytes=_weight_bytes()),
        jax=jax.__version__, note=__doc__.split("With ``JAXFLOW")[0].strip(),
        roofline_note="tokens/s per chip = HBM bandwidth / (context * kv_bytes_per_token + "
                      "weight_bytes / batch); kv_only without the weights; at the full context",
        compiled=compiled, tensor_parallel=[v for k, v in _RESULTS.items() if k[0] == "mesh"],
        roofline=rows)
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
