"""Compile gate: the flowtrain ViT encoder's attention is the platform's Pallas kernel.

The decoupled encoder programs as the run builds them (:func:`jaxflow.flow.steps.make_encoder_fns`
on :func:`jaxflow.flow.steps.build_sides` with the run-level backend ``auto``): ``forward``
(embeddings + vjp residuals) and ``update`` (the vjp applied, AdamW), compiled for a data-parallel
encoder mesh of abstract TPU v5e (``v5e:2x2``, data 4; bf16, as the full variant runs) and H100s
(``1x1x2``, data 2; f32, so ``auto`` passes cuDNN over for the Triton kernel). A 2-layer ViT at
head dim 64 (the full variant's), 64-patch rows (max_grid 8), 8 rows.

Checked on the compiled HLO (:func:`jaxflow.compile_only.hlo.summarize`), per target:

* no ``auto`` fallback to XLA was recorded while tracing;
* forward: the bidirectional kernel's forward exactly once per layer (splash ``splash_mha_fwd``
  on TPU, the Triton ``mha_forward`` on GPU), and no other Pallas call;
* update: the kernel's backward calls once per layer each (splash: dq and dkv; Triton: its
  preprocess (delta) and backward kernels), no forward kernel (no remat: the residuals came
  from ``forward``), and no other Pallas call.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxflow.compile_only import hlo
from jaxflow.compile_only.program import Program, compile_ahead
from jaxflow.flow.decoupled import abstract_replicated, abstract_rows
from jaxflow.flow.steps import build_sides, make_encoder_fns
from jaxflow.flow.vit import ViTConfig
from jaxflow.flow.vlm import AttentionBackend, abstract_side_state
from jaxflow.mesh import make_mesh
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig
from pallas_kernels import dispatch, targets

LAYERS, ROWS = 2, 8
#: target: (chip, topology, encoder data axis size, ViT dtype, kernel name prefixes:
#: forward, backward)
TARGETS = {
    "v5e-2x2": ("v5e", "v5e:2x2", 4, "bfloat16", ("splash_mha_fwd",),
                ("splash_mha_dq", "splash_mha_dkv")),
    "h100x2": ("h100", "1x1x2", 2, "float32", ("mha_forward",),
               ("mha_preprocess_backward", "mha_backward")),
}


def _sides(chip: str, topology: str, data: int, dtype: str):
    vit = ViTConfig(patch_size=4, max_grid=8, d_model=128, n_layers=LAYERS, n_heads=2, d_ff=256,
                    out_dim=64, dtype=dtype)
    lm = TransformerConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2,
                           d_ff=128, max_seq_len=64)  # built (abstract) by the sides, not compiled
    mesh = make_mesh({"data": data}, targets.devices(chip, topology)[:data])
    return build_sides(vit, lm, mesh, mesh, OptimConfig(), 10, AttentionBackend.AUTO), mesh


def _kernels(program: Program) -> dict[str, int]:
    assert program.compiled is not None, f"{program.name} did not compile"
    assert not program.fallbacks, program.fallbacks
    return hlo.summarize(program.compiled.as_text()).pallas_kernels


def _count(kernels: dict[str, int], prefix: str) -> int:
    return sum(n for name, n in kernels.items() if name.startswith(prefix))


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_vit_encoder_attention_is_the_kernel_forward_and_backward(target):
    chip, topology, data, dtype, fwd, bwd = TARGETS[target]
    dispatch.clear_cache()
    sides, mesh = _sides(chip, topology, data, dtype)
    encode, update = make_encoder_fns(sides)
    L, P = sides.vit.row_len, sides.vit.patch_dim
    patches = {"patches": np.zeros((ROWS, L, P), np.float32),
               **{k: np.zeros((ROWS, L), np.int32) for k in ("segment_ids", "rows", "cols")}}
    forward, (flat, vjp_fn) = compile_ahead(Program(
        "encoder/forward", encode, (sides.enc.abstract_params(), abstract_rows(patches, mesh)),
        mesh, "forward"))
    kernels = _kernels(forward)
    assert [_count(kernels, p) for p in fwd] == [LAYERS] * len(fwd), kernels
    assert sum(kernels.values()) == LAYERS * len(fwd), kernels  # nothing else
    updated, _ = compile_ahead(Program(
        "encoder/update", update, (abstract_side_state(sides.enc, sides.enc_tx), vjp_fn,
                                   abstract_replicated(flat.shape, np.float32, mesh)),
        mesh, "train"))
    kernels = _kernels(updated)
    assert [_count(kernels, p) for p in bwd] == [LAYERS] * len(bwd), kernels
    assert sum(kernels.values()) == LAYERS * len(bwd), kernels
