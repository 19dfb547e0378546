"""The layout rule for flowtrain full (ViT encoder + LM backbone: :func:`resolve_flow.flow_layout`)
and bench_embedding full (tables row-wise, the ``jnp.take`` baselines' tables replicated where
the rows do not divide the devices) on tpu-v5p:4x4x4, tpu-v6e:16x16, gpu-h100x8 and
gpu-h200x8: pure functions of the config and the target, nothing compiled."""

from __future__ import annotations

import dataclasses

import pytest

import configs.bench_embedding as bench_embedding_config
import configs.flowtrain as flowtrain_config
from jaxflow.compile_only import resolve, resolve_flow
from jaxflow.compile_only.target import parse_target
from jaxflow.compile_only.variants import flow_step, resolve_for_target, vit_shape

TARGETS = ("tpu-v5p:4x4x4", "tpu-v6e:16x16", "gpu-h100x8", "gpu-h200x8")
#: flowtrain full: (monolithic mesh, encoder counts, backbone model width), or None where it
#: exits 2 (the padded step's 256 rows of up to 2,560 tokens over at most 8-way TP: the
#: smallest target its estimate fits is v5p:4x4x4).
FLOW = {"tpu-v5p:4x4x4": ((16, 4), (4, 8), 2), "tpu-v6e:16x16": None, "gpu-h100x8": None,
        "gpu-h200x8": None}
#: bench_embedding full: fits (tables row-wise), or None: v6e:16x16's 256 devices do not divide
#: every table's rows, so the baselines' tables are replicated (528 GB per chip).
TABLES = {"tpu-v5p:4x4x4": True, "tpu-v6e:16x16": None, "gpu-h100x8": True, "gpu-h200x8": True}


def _resolve(name, config, text, overrides=()):
    target = parse_target(text)
    return resolve_for_target(name, "full", config, target.chip, target.n_devices, overrides)


@pytest.mark.parametrize("text", TARGETS)
def test_flowtrain_full_meshes_come_from_the_target_or_exit_naming_where(text):
    from jaxflow.flow.meshes import candidate_splits

    base = flowtrain_config.get_config("full")
    if FLOW[text] is None:
        with pytest.raises(resolve.DoesNotFit) as err:
            _resolve("flowtrain", base, text)
        message = str(err.value)
        assert "\n" not in message and "do not fit the monolithic padded step" in message
        assert "256 padded rows of 2560 tokens" in message
        assert message.endswith("the smallest target this estimate fits: tpu-v5p:4x4x4"), message
        return
    config, line = _resolve("flowtrain", base, text)
    mesh, counts, width = FLOW[text]
    n = parse_target(text).n_devices
    assert config.mesh.axes == ("data", "model") and config.mesh.shape == mesh
    assert config.allocator.encoder_candidates == counts
    assert config.allocator.backbone_model_degrees == (width,)
    splits = [(e.devices, b.model) for e, b in candidate_splits(config, n)]
    assert splits == [(e, width) for e in counts]  # every split the run profiles was laid out
    assert config.model == base.model and config.vit == base.vit and config.train == base.train
    for e in counts:
        assert f"{e} + {(n - e) // width}x{width}" in line and f"backbone/{e} params" in line


def test_flowtrain_keys_the_user_set_are_kept_and_quick_passes_through():
    base = flowtrain_config.get_config("full")
    for key in ("mesh.shape=8,8", "allocator.encoder_candidates=4", "flow.encoder_devices=4"):
        config, line = _resolve("flowtrain", base, "tpu-v5p:4x4x4", [key])
        assert config is base and "as set" in line
    quick = flowtrain_config.get_config("quick")
    target = parse_target("gpu-h100x8")
    assert resolve_for_target("flowtrain", "quick", quick, target.chip, 8) == (quick, "")


def test_resolved_flowtrain_full_scans_both_block_stacks_and_quick_does_not():
    config, _ = _resolve("flowtrain", flowtrain_config.get_config("full"), "tpu-v5p:4x4x4")
    assert config.vit.scan_layers and config.model.scan_layers
    assert config.vit.remat and config.model.remat
    quick = flowtrain_config.get_config("quick")  # recorded numbers: left as they were
    assert not quick.vit.scan_layers and not quick.model.scan_layers


def test_vit_shape_counts_the_encoders_parameters():
    from flax import nnx

    from jaxflow.flow.vit import ViTEncoder
    from jaxflow.models.transformer import param_count

    for vit in (flowtrain_config.get_config("quick").vit, flowtrain_config.get_config("full").vit):
        abstract = nnx.eval_shape(lambda v=vit: ViTEncoder(v, rngs=nnx.Rngs(0)))
        assert vit_shape(vit).params == param_count(nnx.state(abstract, nnx.Param))


def test_flow_step_bounds_the_shapes_the_programs_compile():
    from jaxflow.flow.batching import encoder_patches, layout_rows, pooled_image_base
    from jaxflow.flow.digits_data import step_samples
    from jaxflow.flow.system import cost_model

    config = flowtrain_config.get_config("full")
    step = flow_step(config)
    samples = step_samples(config.data, seed=config.seed, step=0, batch_size=256)
    base, _ = pooled_image_base(samples)
    packed = layout_rows(samples, "packed", base, packing=config.packing,
                         cost=cost_model(config), row_multiple=1).rows["tokens"].shape
    patches = encoder_patches(samples, config.vit, 1).patches.shape
    assert step.samples == 256 and step.padded_len == 2560  # 4 images of 24 x 24 patches + text
    assert step.padded_len >= max(s.length for s in samples)
    assert packed[1] == step.packed_len and packed[0] <= step.packed_rows <= 1.25 * packed[0]
    assert patches[1] == step.patch_len and patches[0] <= step.patch_rows <= 1.25 * patches[0]


def test_flow_layout_takes_the_smallest_widths_that_fit():
    config = flowtrain_config.get_config("full")
    enc, bb, step = vit_shape(config.vit), resolve.ModelShape.of(config.model), flow_step(config)
    chip = parse_target("tpu-v5p:4x4x4").chip
    lay = resolve_flow.flow_layout(enc, bb, step, encoder_counts=(4, 8, 64), chip=chip, n_devices=64)
    assert (lay.monolithic_model, lay.encoder_counts, lay.backbone_model) == (4, (4, 8), 2)

    def mono(m):
        parts = [resolve.train_estimate(enc, -(-step.patch_rows // (64 // m)), step.patch_len,
                                        shards=m, model_width=m, capacity=chip.hbm_bytes),
                 resolve.train_estimate(bb, -(-step.samples // (64 // m)), step.padded_len,
                                        shards=m, model_width=m, capacity=chip.hbm_bytes)]
        return sum(p.needed for p in parts)

    assert lay.estimates["monolithic"].needed == pytest.approx(mono(4))
    assert mono(2) > resolve.HEADROOM * chip.hbm_bytes  # 2 would not fit: 4 is the smallest
    backbone_at_1 = resolve.train_estimate(bb, 1, step.packed_len, shards=1, model_width=1,
                                           capacity=chip.hbm_bytes)
    assert not backbone_at_1.fits and lay.estimates["backbone/4"].fits
    tiny = dataclasses.replace(step, samples=10 ** 6)
    with pytest.raises(resolve.DoesNotFit, match="do not fit the monolithic padded step: .* "
                                                 "none of gpu-h100x8, .* fits it$"):
        resolve_flow.flow_layout(enc, bb, tiny, encoder_counts=(4,), chip=chip, n_devices=64)


@pytest.mark.parametrize("text", TARGETS)
def test_bench_embedding_full_fits_row_wise_or_exits_naming_where(text):
    base = bench_embedding_config.get_config("full")
    n = parse_target(text).n_devices
    if TABLES[text] is None:
        with pytest.raises(resolve.DoesNotFit) as err:
            _resolve("bench_embedding", base, text)
        message = str(err.value)
        assert "\n" not in message
        assert f"(replicated: not every table's rows divide {n} devices)" in message
        assert message.endswith("the smallest target this estimate fits: gpu-h100x8"), message
        return
    config, line = _resolve("bench_embedding", base, text)
    assert config is base and f"mesh data {n} (tables row-wise, batch {65536 // n} " in line


def test_table_layout_replicates_uneven_rows_only_when_asked():
    chip = parse_target("gpu-h100x8").chip
    kw = dict(batch=8, ids_per_row=1, dense_params=0, optimizer="sgd", chip=chip)
    even = resolve.table_layout((16, 8), 4, n_devices=8, replicate_uneven=True, **kw)
    uneven = resolve.table_layout((16, 12), 4, n_devices=8, replicate_uneven=True, **kw)
    sharded = resolve.table_layout((16, 12), 4, n_devices=8, **kw)
    assert even.params == (2 + 1) * 4 * 4 and uneven.params == (16 + 12) * 4 * 4
    assert sharded.params == (2 + 2) * 4 * 4  # ceil(12 / 8) rows of the second table
