"""Compile gate: an engine of 64-wide heads on TPU stores its pools padded and runs both kernels.

:func:`jaxflow.rollout.programs.engine_programs` for a 2-layer model of head_dim 64 (8 query
heads, 4 K/V heads, bf16) on an abstract v5e 2x2 (K/V heads over a model axis of 4), 8 slots of
512 tokens in pages of 16, compiled by XLA:TPU: the pools come out at 128 lanes
(:func:`jaxflow.rollout.pages.pool_head_dim`: decode runs the TPU kernel), the decode program
calls the paged-attention kernel once per layer and holds no pad of a pool (no array of a
pool's size or larger is padded: only the step's new K/V are), the prefill program calls the
ragged kernel once per layer (the padded layout) with no fallback. The same decode built over
unpadded pools (the kernel's wrapper padding them per call) does pad the whole pool: what the
padded layout removes.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest

import jaxflow.rollout.programs as rollout_programs
from jaxflow.compile_only.kernels import pallas_calls
from jaxflow.compile_only.program import compile_ahead
from jaxflow.models.sampler import SamplingConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rollout.engine import EngineConfig
from pallas_kernels import dispatch, targets

MODEL = TransformerConfig(vocab_size=256, d_model=512, n_layers=2, n_heads=8, n_kv_heads=4,
                          d_ff=1024, max_seq_len=512, dtype="bfloat16", param_dtype="bfloat16")
ENGINE = EngineConfig(slots=8, page_size=16, num_pages=8 * 32 + 1, prefill_chunk=64,
                      prefill_rows=2, max_seq_len=512)
TP = 4
POOL_SHARD = (MODEL.n_kv_heads // TP) * ENGINE.num_pages * ENGINE.page_size * 64  # elements
PAD = re.compile(r"=\s*\w+\[([\d,]*)\][^=]*?\bpad\(")


def _programs():
    mesh = targets.mesh("v5e", (1, TP), ("data", "model"), "v5e:2x2")
    dispatch.clear_cache()
    programs = rollout_programs.engine_programs(
        MODEL, mesh, ENGINE, SamplingConfig(max_new_tokens=448), prompt_len=64)
    return {p.name.rsplit("/", 1)[-1]: p for p in programs}


def _padded_sizes(compiled) -> list[int]:
    """Element counts of every pad's result in the compiled HLO."""
    text = compiled.compiled.as_text()
    return [math.prod(int(d) for d in dims.split(",") if d) for dims in PAD.findall(text)]


@pytest.fixture(scope="module")
def padded():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # auto's fallback warns
        programs = _programs()
        return {name: (p, *compile_ahead(p)) for name, p in programs.items()}


def test_decode_stores_the_pool_padded_and_pads_no_pool(padded):
    assert MODEL.head_dim == 64
    program, compiled, outputs = padded["decode"]
    assert compiled.compiled is not None and not compiled.fallbacks
    for pool in outputs[0].k + outputs[0].v:
        assert pool.shape == (MODEL.n_kv_heads, ENGINE.num_pages, ENGINE.page_size, 128)
    calls = pallas_calls(program.fn.trace(*program.args, **program.kwargs))
    assert sum(calls.values()) == MODEL.n_layers, calls
    assert all(k.startswith("paged_flash_attention_kernel") for k in calls), calls
    sizes = _padded_sizes(compiled)
    assert max(sizes, default=0) < POOL_SHARD, sizes  # only the new tokens' K/V are padded


def test_prefill_runs_the_ragged_kernel_at_head_dim_64(padded):
    program, compiled, outputs = padded["prefill"]
    assert compiled.compiled is not None and not compiled.fallbacks, compiled.fallbacks
    assert outputs.k[0].shape[-1] == 128
    calls = pallas_calls(program.fn.trace(*program.args, **program.kwargs))
    assert sum(calls.values()) == MODEL.n_layers, calls
    assert all(k.startswith("ragged_paged_attention_kernel") for k in calls), calls


def test_unpadded_pools_are_padded_per_call(monkeypatch):
    monkeypatch.setattr(rollout_programs, "pool_head_dim", lambda **kw: kw["head_dim"])
    program = _programs()["decode"]
    compiled, outputs = compile_ahead(program)
    assert compiled.compiled is not None and outputs[0].k[0].shape[-1] == 64
    assert max(_padded_sizes(compiled)) >= 2 * POOL_SHARD  # the pool at twice its width
