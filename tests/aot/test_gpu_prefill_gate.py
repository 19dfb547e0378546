"""Compile gate for the engine's GPU prefill kernel (:mod:`jaxflow.rollout.gpu_prefill_kernel`).

The Pallas kernel, lowered with Triton, is compiled by the real XLA:GPU compiler (CUDA PJRT
plugin) for an abstract H100 (nothing runs): at the interpret-mode test shapes
(``tests/test_gpu_prefill_kernel.py``) and at production shapes, Qwen3-0.6B's heads (16 query,
8 K/V heads of 128) and Qwen3-8B's (32 / 8 / 128), bf16 at pages of 16 and 64 tokens (f32 once;
Llama-3.2-1B's 64-wide heads once), a chunk of 8 rows x 512 tokens over 4k-token page tables;
every default tile must fit the H100's shared memory (an oversized one is refused: the compile
checks it). ``prefill_attention`` with ``auto`` must take the kernel there (no fall-back
warning: its verdict compiled for the chip), and its temporaries must undercut the XLA
attention's, which holds the [R, H, C, W * S] f32 logits. The engine's prefill program on two
H100s runs it once per layer (``test_rollout_engine_programs.py``).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxflow.rollout import prefill_attention as pf
from jaxflow.rollout.gpu_prefill_kernel import GpuPrefillBlockSizes, gpu_prefill_attention
from pallas_kernels import dispatch, targets

TRITON_CALL = "__gpu$xla.gpu.triton"
R, C, CONTEXT = 8, 512, 4096
HEADS = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128),  # (H, KVH, D)
         "llama-3.2-1b": (32, 8, 64)}  # 64-wide heads: no padded layout needed here
TEST = dict(r=4, c=6, h=4, kvh=2, d=16, s=4, w=5, pool=32)  # tests/test_gpu_prefill_kernel.py


def _sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _args(r, c, h, kvh, d, s, w, pool, dtype):
    pages = _sds((kvh, pool, s, d), dtype)
    return (_sds((r, c, h, d), dtype), pages, pages, _sds((r, w)), _sds((r,)), _sds((r,)))


def _production(model: str, page: int, dtype):
    h, kvh, d = HEADS[model]
    w = CONTEXT // page
    return _args(R, C, h, kvh, d, page, w, R * w + 1, dtype)  # every row's pages + the null page


def _assert_kernel(result, where) -> None:
    assert result.ok, f"{where}: {result.error}"
    assert TRITON_CALL in result.hlo_text, f"{where}: no Triton call in the compiled program"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_compiles_for_h100_at_the_test_shapes(dtype):
    args = _args(**TEST, dtype=dtype)
    _assert_kernel(targets.compile_on(gpu_prefill_attention, args, "h100", keep_hlo=True),
                   ("test", dtype))


PRODUCTION = [(m, p, jnp.bfloat16) for m in ("qwen3-0.6b", "qwen3-8b") for p in (16, 64)] + [
    ("llama-3.2-1b", 16, jnp.bfloat16),
    ("qwen3-8b", 16, jnp.float32)]  # f32 tiles: one case (Triton takes ~5 s per f32 compile)


@pytest.mark.parametrize(("model", "page", "dtype"), PRODUCTION)
def test_kernel_compiles_for_h100_at_production_shapes(model, page, dtype):
    """The default tiles (128 x 64 bf16, 64 x 64 f32) compile within H100 shared memory."""
    args = _production(model, page, dtype)
    blocks = GpuPrefillBlockSizes.get_default(HEADS[model][2], dtype)
    fn = functools.partial(gpu_prefill_attention, block_sizes=blocks)
    _assert_kernel(targets.compile_on(fn, args, "h100", keep_hlo=True), (model, page, dtype))


def test_oversized_tiles_are_refused_by_the_compiler():
    """The gate sees shared memory: 256 x 256 bf16 tiles do not fit an H100 block."""
    args = _production("qwen3-8b", 64, jnp.bfloat16)
    fn = functools.partial(gpu_prefill_attention,
                           block_sizes=GpuPrefillBlockSizes(256, 256, num_warps=8, num_stages=3))
    result = targets.compile_on(fn, args, "h100")
    assert not result.ok and "Shared memory size limit exceeded" in result.error, result.error


def test_auto_prefill_takes_the_gpu_kernel_on_h100():
    args = _production("qwen3-8b", 16, jnp.bfloat16)
    dispatch.clear_cache()
    with warnings.catch_warnings(), dispatch.recording_fallbacks() as fallbacks:
        warnings.simplefilter("error", RuntimeWarning)  # auto's fall-back warns
        kernel = targets.compile_on(pf.prefill_attention, args, "h100", keep_hlo=True)
    _assert_kernel(kernel, "auto")
    assert not fallbacks, fallbacks
    xla = targets.compile_on(pf.xla_prefill_attention, args, "h100")
    assert xla.ok, xla.error
    h = HEADS["qwen3-8b"][0]
    logits = R * h * C * CONTEXT * 4  # the XLA attention's f32 logits alone
    assert xla.temp_bytes >= logits > kernel.temp_bytes, (xla.temp_bytes, kernel.temp_bytes)
