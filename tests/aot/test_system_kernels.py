"""Every system step that may use a Pallas kernel uses it under the pod meshes, with ``auto``.

Each step is built by its own builder (the function a run jits, ``jaxflow.mesh.jit_on``) for
a 64-chip TPU v5p topology (``v5p:4x4x4``, data 8 x model 8) and 8 H100s (model 8) at
production widths with 2 layers, traced and lowered with the target's abstract devices
(nothing is compiled but the kernels' build verdicts; the whole program's compile is
``--compile-only``), and its kernel calls are counted in the jaxpr (``pallas_calls``: every
call site, the backward pass included).

What each step should use, per decoder layer with ``remat=True``: the attention forward twice
(the forward pass and its recomputation in the backward pass) and the backward's kernels once
(splash: dq and dkv; Triton flash: a preprocessing pass and the backward); the fused log-probs
forward and its two backward kernels once per step. On the abstract H100 ``auto`` tries cuDNN
attention first, which needs the cuDNN library this host lacks, so it warns and takes the
Triton kernel (a real H100 with cuDNN takes cuDNN's fused attention, a custom call that is not
a Pallas kernel).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.kernels import pallas_calls
from jaxflow.mesh import make_mesh
from jaxflow.models.architectures import shipped_config
from pallas_kernels import dispatch, targets

LAYERS = 2
TARGETS = {
    "v5p-64": ("v5p", "v5p:4x4x4", {"data": 8, "model": 8}),
    "h100x8": ("h100", "1x1x8", {"data": 1, "model": 8}),
}
ATTENTION = {  # per layer, remat on
    "tpu": {"splash_mha_fwd_segmented_residuals": 2, "splash_mha_dq_segmented_no_residuals": 1,
            "splash_mha_dkv_segmented_no_residuals": 1},
    "gpu": {"mha_forward": 2, "mha_preprocess_backward": 1, "mha_backward": 1},
}
FUSED_LOGPROBS = {"fused_logprobs_fwd": 1, "fused_logprobs_bwd_dh": 1, "fused_logprobs_bwd_dw": 1}
CUSTOM_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


def _per_layer(platform: str, layers: int = LAYERS) -> collections.Counter:
    return collections.Counter({k: v * layers for k, v in ATTENTION[platform].items()})


def _mesh(name):
    chip, topology, axes = TARGETS[name]
    return targets.chip(chip), make_mesh(axes, targets.devices(chip, topology))


def _count(fn, args, kwargs=None):
    dispatch.clear_cache()
    traced = fn.trace(*args, **(kwargs or {}))
    return pallas_calls(traced), traced.lower().as_text()


def _lm_step(mesh, cfg, batch, seq):
    from jaxflow.train import lm_state
    from jaxflow.train.state import TrainState

    fns = lm_state.lm_functions(cfg, mesh)
    tx = lm_state.make_optimizer(lm_state.OptimConfig(), 100)
    params = fns.abstract_params()
    sh = TrainState.shardings(tx, params, fns.param_shardings)
    rows = NamedSharding(mesh, P("data"))
    step = lm_state.make_train_step(fns, tx, sh, rows)
    data = {k: jax.ShapeDtypeStruct((batch, seq), jnp.float32 if k == "loss_mask" else jnp.int32,
                                    sharding=rows)
            for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions")}
    return step, (TrainState.abstract(tx, params, fns.param_shardings), data)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_lm_train_step_uses_attention_kernels(target):
    """Llama-3-8B widths (32 heads, 8 kv heads, head_dim 128, d_ff 14336, vocab 128256),
    64 sequences of 4096 tokens."""
    chip, mesh = _mesh(target)
    cfg = shipped_config("llama-3-8b", n_layers=LAYERS, max_seq_len=4096, remat=True)
    step, args = _lm_step(mesh, cfg, 64, 4096)
    with pytest.warns() if chip.platform == "gpu" else _no_warning():
        calls, text = _count(step, args)
    assert calls == _per_layer(chip.platform), dict(calls)
    assert CUSTOM_CALL[chip.platform] in text


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_grpo_update_uses_attention_and_fused_logprob_kernels(target):
    """The flagship's full variant (Qwen3-8B widths, 1,024-token responses, SIS top-8) with 2
    layers: the update of one 128-row mini-batch, pi_old's statistics (forward only), and the
    sync's compaction of the largest leaf (the embedding, 151936 x 4096)."""
    import configs.flagship as flagship_config
    from jaxflow.main.flagship import compile_programs

    chip, topology, _ = TARGETS[target]
    cfg = flagship_config.get_config("full")
    model = dataclasses.replace(cfg.pretrain.model, n_layers=LAYERS)
    cfg = dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, model=model))
    if chip == "h100":  # 8 GPUs: trainer 4 (model 4) + rollout 4 (model 4)
        cfg = dataclasses.replace(cfg, roles=dataclasses.replace(
            cfg.roles, rollout_devices=4, trainer_model=4, rollout_model=4))
    from jaxflow.mesh import trainer_rollout_meshes

    meshes, _ = trainer_rollout_meshes(cfg.roles, targets.devices(chip, topology))
    programs = {p.name: p for p in compile_programs(cfg, meshes)}
    platform = targets.chip(chip).platform
    update = programs["trainer/update"]
    calls, text = _count(update.fn, update.args, update.kwargs)
    assert calls == _per_layer(platform) + collections.Counter(FUSED_LOGPROBS), dict(calls)
    assert CUSTOM_CALL[platform] in text
    old = programs["trainer/old_stats"]
    calls, _ = _count(old.fn, old.args)
    forward = {"tpu": "splash_mha_fwd_segmented_no_residuals", "gpu": "mha_forward"}[platform]
    assert calls == {forward: LAYERS, "fused_logprobs_fwd": 1}, dict(calls)
    # SparseRL-Sync's device diff: each trainer device compacts its shard of the largest leaf
    # with the Pallas compaction inside the shard_map
    compact = programs["sync/compact_largest_leaf"]
    calls, text = _count(compact.fn, compact.args)
    assert calls == {"sync_diff_compact": 1}, dict(calls)
    assert CUSTOM_CALL[platform] in text


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_vlm_backbone_step_uses_attention_kernels(target):
    """FlowTrain's decoupled backbone step (``jaxflow.flow.steps.make_backbone_step``) with
    attention ``auto``: a Llama-3-8B-wide backbone with 2 layers on packed rows of 4096 tokens
    (64 rows), image embeddings [E, d] from a ViT-L-wide encoder."""
    from jaxflow.flow.steps import build_sides, make_backbone_step
    from jaxflow.flow.vit import ViTConfig
    from jaxflow.models.attention_backends import AttentionBackend
    from jaxflow.train.lm_state import OptimConfig
    from jaxflow.train.state import TrainState

    chip, mesh = _mesh(target)
    lm = shipped_config("llama-3-8b", n_layers=LAYERS, max_seq_len=4096, remat=True)
    vit = ViTConfig(patch_size=14, max_grid=24, d_model=1024, n_layers=LAYERS, n_heads=16,
                    d_ff=4096, out_dim=lm.d_model, dtype="bfloat16", remat=True)
    sides = build_sides(vit, lm, mesh, mesh, OptimConfig(), 100, backend=AttentionBackend.AUTO)
    step = make_backbone_step(sides)
    bb = sides.bb
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          _pure(bb.abstract_state), bb.param_shardings)
    state = TrainState.abstract(sides.bb_tx, params, bb.param_shardings)
    rows_sh, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    b, t, e = 64, 4096, 64 * 576
    rows = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "loss_mask" else jnp.int32,
                                    sharding=rows_sh)
            for k in ("tokens", "embed_index", "positions", "segment_ids", "targets", "loss_mask")}
    embeds = jax.ShapeDtypeStruct((e, lm.d_model), jnp.float32, sharding=rep)
    denom = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    with pytest.warns() if chip.platform == "gpu" else _no_warning():
        calls, text = _count(step, (state, embeds, rows, denom))
    assert calls == _per_layer(chip.platform), dict(calls)
    assert CUSTOM_CALL[chip.platform] in text


def _pure(state):
    from flax import nnx

    return nnx.to_pure_dict(state)


class _no_warning:
    """No kernel fell back to XLA (dispatch warns with a RuntimeWarning when it does)."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        fell_back = [str(w.message) for w in self._seen if "unavailable" in str(w.message)]
        assert not fell_back, fell_back
        return False
