"""Compile gate for the engine's prefill attention through the ragged paged-attention kernel.

``jaxflow.rollout.prefill_attention.prefill_attention`` with ``auto`` is compiled by XLA:TPU
(Mosaic) for an abstract v5p at Qwen3-8B's heads (32 query heads, 8 K/V heads, head_dim 128),
bf16, a chunk of 8 rows x 256 tokens over 4k-token page tables (pages of 128): ``auto`` must
take the ragged kernel (no fallback warning), and its temporaries must undercut the XLA
attention's (which holds [R, H, C, W * S] f32 logits) at the same shapes.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxflow.rollout import prefill_attention as pf
from pallas_kernels import dispatch, targets

R, C, H, KVH, D, S, W = 8, 256, 32, 8, 128, 128, 32


def _sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_auto_prefill_takes_the_ragged_kernel_on_v5p():
    pool = (KVH, R * W + 1, S, D)  # every row's pages and the null page
    args = (_sds((R, C, H, D), jnp.bfloat16), _sds(pool, jnp.bfloat16), _sds(pool, jnp.bfloat16),
            _sds((R, W)), _sds((R,)), _sds((R,)))
    dispatch.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # auto's fallback warns
        kernel = targets.compile_on(pf.prefill_attention, args, "v5p", keep_hlo=True)
    assert kernel.ok, kernel.error
    assert "tpu_custom_call" in kernel.hlo_text
    xla = targets.compile_on(pf.xla_prefill_attention, args, "v5p")
    assert xla.ok, xla.error
    logits = R * H * C * W * S * 4  # the XLA attention's f32 logits alone
    assert xla.temp_bytes >= logits > kernel.temp_bytes, (xla.temp_bytes, kernel.temp_bytes)
