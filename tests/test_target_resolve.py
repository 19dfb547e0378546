"""The layout rule (:mod:`jaxflow.compile_only.resolve`) and its application to ``full``
variants (:mod:`jaxflow.compile_only.variants`) on tpu-v5p:4x4x4, tpu-v6e:16x16, gpu-h100x8 and
gpu-h200x8: pure functions of the config and the target, nothing compiled."""

from __future__ import annotations

import dataclasses

import pytest

import configs.bench_rollout as bench_rollout_config
import configs.dlrm_train as dlrm_config
import configs.flagship as flagship_config
import configs.flexmarl as flexmarl_config
import configs.lm_pretrain as lm_config
import configs.nestpipe as nestpipe_config
import configs.rl as rl_config
from jaxflow.compile_only import resolve
from jaxflow.compile_only.target import parse_target
from jaxflow.compile_only.variants import resolve_for_target

TARGETS = ("tpu-v5p:4x4x4", "tpu-v6e:16x16", "gpu-h100x8", "gpu-h200x8")
#: lm_pretrain full (Llama-3-8B, 256 x 4096): (fsdp, micro-batches) per target.
LM = {"tpu-v5p:4x4x4": (64, 1), "tpu-v6e:16x16": (256, 1), "gpu-h100x8": (8, 4),
      "gpu-h200x8": (8, 2)}
#: flagship full (Qwen3-8B GRPO, 128-row updates): (rollout devices, trainer model, rollout
#: model, trainer micro-batches). 8 x H100 fits with gradient accumulation: model 4 and 4
#: micro-batches of 32 rows (at M = 1, model 4: 128.3 GiB of 79.1).
#: The sampler holds the published f32 params and the bf16 copy it casts them to (45.8 GiB at
#: model 1): on v6e and H100 that takes rollout model 2 (flagship's rollout/sample compiled at
#: model 1 for v6e:16x16 needs 47.1 GiB of 32).
RL = {"tpu-v5p:4x4x4": (32, 2, 1, 1), "tpu-v6e:16x16": (128, 8, 2, 1),
      "gpu-h100x8": (4, 4, 2, 4), "gpu-h200x8": (4, 2, 1, 1)}

#: rl full (Qwen3-8B GRPO, 2,048 tokens, the paged engine): as RL, or None where it exits 2.
#: The engine is one replica holding all 1,024 rows' KV (309 GiB) split over "model" only: v5p
#: takes model 4 (at model 1 its compiled prefill needed 320 GiB per device); on v6e (even at
#: model 8) and 8 x H100 the KV does not fit (the smallest target its estimate fits: 8 x H200).
RL_EXP = {"tpu-v5p:4x4x4": (32, 2, 4, 1), "tpu-v6e:16x16": None, "gpu-h100x8": None,
          "gpu-h200x8": (4, 4, 4, 4)}
#: flexmarl full (Qwen3-8B solver + 4B-shaped verifier): (trainer model, rollout model), or
#: None where it exits 2 (the smallest target: 8 x H200).
MARL = {"tpu-v5p:4x4x4": (4, 1), "tpu-v6e:16x16": (8, 2), "gpu-h100x8": None,
        "gpu-h200x8": (2, 1)}


def _resolve(name, config, text, overrides=()):
    target = parse_target(text)
    return resolve_for_target(name, "full", config, target.chip, target.n_devices, overrides)


@pytest.mark.parametrize("text", TARGETS)
def test_lm_pretrain_full_is_fsdp_with_accumulation_where_needed(text):
    config, line = _resolve("lm_pretrain", lm_config.get_config("full"), text)
    fsdp, micro = LM[text]
    n = parse_target(text).n_devices
    assert dict(zip(config.mesh.axes, config.mesh.shape)) == {"data": 1, "fsdp": fsdp, "model": 1}
    assert config.train.microbatches == micro
    assert config.train.batch_size == 256 and config.train.seq_len == 4096  # stated, unchanged
    assert (config.train.batch_size // n) % micro == 0
    assert f"{micro} micro-batch(es) of {256 // n // micro} row(s)" in line


@pytest.mark.parametrize("text", TARGETS)
def test_flagship_full_roles_come_from_the_target(text):
    base = flagship_config.get_config("full")
    config, line = _resolve("flagship", base, text)
    roles, micro = config.roles, config.rl.microbatches
    assert (roles.rollout_devices, roles.trainer_model, roles.rollout_model, micro) == RL[text]
    assert config.rl == dataclasses.replace(base.rl, microbatches=micro)  # nothing else changed
    n = parse_target(text).n_devices
    rows = base.rl.minibatch_size
    said = "" if micro == 1 else f", {micro} micro-batch(es) of {rows // micro} row(s) per update"
    assert f"trainer {n - roles.rollout_devices} (model {roles.trainer_model}{said})" in line
    # the rule's estimate at that layout: fits, and with one micro-batch fewer it would not
    shape = resolve.ModelShape.of(base.pretrain.model)
    tokens = base.task.max_prompt_len + base.rl.max_new_tokens
    lay = resolve.rl_layout(shape, train_rows=rows, sample_rows=base.rl.rollout_size,
                            tokens=tokens, chip=parse_target(text).chip, n_devices=n)
    assert lay.microbatches == micro and lay.estimates["trainer"].fits
    if micro > 1:
        smaller = max(k for k in range(1, micro) if rows % k == 0)
        with pytest.raises(resolve.DoesNotFit, match="do not fit the trainer"):
            resolve.rl_layout(shape, train_rows=rows, sample_rows=base.rl.rollout_size,
                              tokens=tokens, chip=parse_target(text).chip, n_devices=n,
                              microbatches=smaller)


def test_keys_the_user_set_are_kept():
    base = flagship_config.get_config("full")
    config, line = _resolve("flagship", base, "gpu-h100x8", ["roles.rollout_devices=4"])
    assert config is base and "as set" in line
    # rl.microbatches as set: kept, and the layout checked at it
    eight = dataclasses.replace(base, rl=dataclasses.replace(base.rl, microbatches=8))
    config, line = _resolve("flagship", eight, "gpu-h100x8", ["rl.microbatches=8"])
    assert config.rl.microbatches == 8 and config.roles.trainer_model == 4
    assert "8 micro-batch(es) of 16 row(s) per update (as set)" in line
    with pytest.raises(resolve.DoesNotFit, match="do not fit the trainer"):
        _resolve("flagship", base, "gpu-h100x8", ["rl.microbatches=1"])
    lm = lm_config.get_config("full")
    config, _ = _resolve("lm_pretrain", lm, "gpu-h100x8", ["train.microbatches=2"])
    assert config is lm


def test_other_variants_and_experiments_pass_through():
    quick = lm_config.get_config("quick")
    target = parse_target("gpu-h100x8")
    assert resolve_for_target("lm_pretrain", "quick", quick, target.chip, 8) == (quick, "")
    assert resolve_for_target("decoratelm", "full", quick, target.chip, 8) == (quick, "")


def test_the_estimate_counts_state_over_shards_and_logits_per_row():
    model = resolve.ModelShape(params=1000, n_layers=1, d_model=4, d_ff=8, vocab=16, n_heads=2,
                               n_kv_heads=2, head_dim=2, param_bytes=4, compute_bytes=2)
    one = resolve.train_estimate(model, 1, 4, shards=1, model_width=1, capacity=10 ** 9)
    two = resolve.train_estimate(model, 2, 4, shards=2, model_width=1, capacity=10 ** 9)
    assert two.params == one.params / 2 and two.optimizer == one.optimizer / 2
    assert one.optimizer == 12 * 1000 and one.params == 4 * 1000
    assert two.activations == 2 * one.activations
    fused = resolve.train_estimate(model, 1, 4, shards=1, model_width=1, capacity=10 ** 9,
                                   fused_logprobs=True)
    assert one.activations - fused.activations == 2 * 4 * 16 * 4  # f32 logits and their grad


def test_a_model_no_candidate_holds_says_so():
    huge = resolve.ModelShape(params=10 ** 14, n_layers=1, d_model=8, d_ff=8, vocab=8,
                              n_heads=1, n_kv_heads=1, head_dim=8)
    chip = parse_target("gpu-h100x8").chip
    with pytest.raises(resolve.DoesNotFit, match=r"none of gpu-h100x8, .* fits it$"):
        resolve.lm_train_layout(huge, 8, 8, chip, 8)


def test_llama_8b_shape_is_counted_from_the_config():
    shape = resolve.ModelShape.of(lm_config.get_config("full").model)
    assert 8.0e9 < shape.params < 8.1e9 and shape.param_bytes == 2  # Llama-3-8B: 8.03B


@pytest.mark.parametrize("text", TARGETS)
def test_rl_full_roles_come_from_the_target_or_exit_naming_where(text):
    base = rl_config.get_config("full")
    if RL_EXP[text] is None:
        with pytest.raises(resolve.DoesNotFit) as err:
            _resolve("rl", base, text)
        message = str(err.value)
        assert "\n" not in message and "of 2048 tokens do not fit the rollout" in message
        assert message.endswith("the smallest target this estimate fits: gpu-h200x8"), message
        return
    config, line = _resolve("rl", base, text)
    roles, micro = config.roles, config.rl.microbatches
    assert (roles.rollout_devices, roles.trainer_model, roles.rollout_model, micro) == RL_EXP[text]
    # the stated run, unchanged but for the trainer's gradient accumulation
    assert config.rl == dataclasses.replace(base.rl, microbatches=micro) and config.model == base.model


@pytest.mark.parametrize("text", TARGETS)
def test_flexmarl_full_model_degrees_come_from_the_target_or_exit_naming_where(text):
    base = flexmarl_config.get_config("full")
    if MARL[text] is None:
        with pytest.raises(resolve.DoesNotFit) as err:
            _resolve("flexmarl", base, text)
        message = str(err.value)
        assert "\n" not in message and "do not fit the trainer/solver" in message
        assert message.endswith("the smallest target this estimate fits: gpu-h200x8"), message
        return
    config, line = _resolve("flexmarl", base, text)
    assert (config.trainer_model, config.rollout_model) == MARL[text]
    assert config.solver == base.solver and config.n_inputs == base.n_inputs
    for role in ("trainer/solver", "trainer/verifier", "rollout"):
        assert role + " params" in line
    config, line = _resolve("flexmarl", base, text, ["trainer_model=4"])
    assert config is base and "as set" in line


def test_rl_samplers_hold_the_published_params_and_the_static_ones_a_cast_copy():
    f32 = resolve.ModelShape(params=1000, n_layers=1, d_model=4, d_ff=8, vocab=16, n_heads=2,
                             n_kv_heads=2, head_dim=2, param_bytes=4, compute_bytes=2)
    assert resolve.rl_sampler_weight_bytes(f32, "static") == 6
    assert resolve.rl_sampler_weight_bytes(f32, "static_per_row") == 6
    assert resolve.rl_sampler_weight_bytes(f32, "engine") == 4
    bf16 = dataclasses.replace(f32, param_bytes=2)
    assert resolve.rl_sampler_weight_bytes(bf16, "static") == 2  # nothing to cast


def test_marl_layout_splits_trainers_like_the_meshes_and_sums_the_samplers():
    small = resolve.ModelShape(params=10 ** 6, n_layers=2, d_model=64, d_ff=128, vocab=256,
                               n_heads=4, n_kv_heads=4, head_dim=16)
    big = dataclasses.replace(small, params=3 * 10 ** 6)
    chip = parse_target("gpu-h100x8").chip
    lay = resolve.marl_layout({"a": big, "b": small}, train_rows=8, sample_rows=8, tokens=16,
                              chip=chip, n_devices=8)
    assert (lay.rollout_devices, lay.trainer_model, lay.rollout_model) == (4, 1, 1)
    # 4 trainer devices split 3:1 by parameters (allocate_workers): 8 rows over 3 and over 1
    a = resolve.marl_train_estimate(big, 8 / 3, 16, model_width=1, capacity=chip.hbm_bytes)
    assert lay.estimates["trainer/a"] == a
    # accumulate_apply: f32 weights + their bf16 copy, gradient, gradient sum, AdamW's moments
    assert (a.params, a.optimizer) == (big.params * 6, big.params * 16)
    assert a.activations == resolve.train_estimate(big, 8 / 3, 16, shards=1, model_width=1,
                                                   capacity=chip.hbm_bytes,
                                                   fused_logprobs=True).activations
    # the engine: one replica with all 8 rows' pages, holding the published f32 params
    parts = [resolve.sample_estimate(m, 8, 16, model_width=1, capacity=chip.hbm_bytes,
                                     weight_bytes=4)
             for m in (big, small)]
    assert lay.estimates["rollout"].params == sum(p.params for p in parts)
    assert lay.estimates["rollout"].activations == sum(p.activations for p in parts)
    # per-agent token budgets: each agent's trainer and KV cache at its own length
    own = resolve.marl_layout({"a": big, "b": small}, train_rows=8, sample_rows=8,
                              tokens={"a": 16, "b": 64}, chip=chip, n_devices=8)
    assert own.estimates["trainer/a"] == a
    kv = [resolve.sample_estimate(m, 8, t, model_width=1, capacity=chip.hbm_bytes, weight_bytes=4)
          for m, t in ((big, 16), (small, 64))]
    assert own.estimates["rollout"].activations == sum(p.activations for p in kv)
    assert own.estimates["rollout"].activations > lay.estimates["rollout"].activations
    with pytest.raises(resolve.DoesNotFit, match="trainer/a"):  # 3 devices: a shared trainer
        resolve.marl_layout({"a": big, "b": small}, train_rows=10 ** 7, sample_rows=8,
                            tokens=16, chip=chip, n_devices=3)


@pytest.mark.parametrize("name,module", [("dlrm_train", dlrm_config),
                                         ("nestpipe", nestpipe_config)])
def test_recsys_full_keeps_its_data_mesh_on_every_target_and_says_the_fit(name, module):
    base = module.get_config("full")
    for text in TARGETS:
        config, line = _resolve(name, base, text)
        n = parse_target(text).n_devices
        assert config is base and f"mesh data {n} (tables row-wise, batch {65536 // n} " in line
    with pytest.raises(resolve.DoesNotFit) as err:  # 4 v5p: 123 GiB of table rows per chip
        _resolve(name, base, "tpu-v5p:2x2x1")
    message = str(err.value)
    assert "\n" not in message and "26 tables of 1,032,000,000 rows x 128" in message
    assert message.endswith("the smallest target this estimate fits: gpu-h100x8"), message


def test_the_table_estimate_counts_rows_per_shard_optimizer_state_and_ids():
    kw = dict(local_ids=10, dense_params=100, n_devices=4, capacity=10 ** 9)
    sgd = resolve.table_estimate((10, 7), 8, optimizer="sgd", **kw)
    assert sgd.params == (3 + 2) * 8 * 4 + 100 * 4  # ceil(10/4) + ceil(7/4) rows of each shard
    assert sgd.optimizer == 100 * 12 and sgd.activations == 2 * 10 * 8 * 4
    ada = resolve.table_estimate((10, 7), 8, optimizer="rowwise_adagrad", **kw)
    adam = resolve.table_estimate((10, 7), 8, optimizer="adam", **kw)
    assert ada.optimizer - sgd.optimizer == 5 * 4 and adam.optimizer - sgd.optimizer == 5 * 8 * 8
    with pytest.raises(ValueError, match="sparse optimizer 'lamb'; valid: sgd, rowwise_adagrad"):
        resolve.table_estimate((10,), 8, optimizer="lamb", **kw)
    chip = parse_target("gpu-h100x8").chip
    with pytest.raises(resolve.DoesNotFit, match=r"batch 10 \(not divisible by 8 devices\)"):
        resolve.table_layout((10,), 8, batch=10, ids_per_row=1, dense_params=1,
                             optimizer="sgd", chip=chip, n_devices=8)


#: bench_rollout full (one Qwen3-8B engine, 256 slots of 4,096 tokens): model_parallel.
SERVE = {"tpu-v5p:4x4x4": 2, "tpu-v6e:16x16": 8, "gpu-h100x8": 4, "gpu-h200x8": 2}


@pytest.mark.parametrize("text", TARGETS)
def test_bench_rollout_full_engine_width_comes_from_the_target(text):
    base = bench_rollout_config.get_config("full")
    config, line = _resolve("bench_rollout", base, text)
    assert config.serve.model_parallel == SERVE[text]
    assert dataclasses.replace(config.serve, model_parallel=8) == base.serve  # nothing else
    assert f"one engine on {SERVE[text]} chip(s)" in line


def test_serve_layout_takes_the_smallest_width_that_fits_or_names_where():
    model = resolve.ModelShape(params=10 ** 9, n_layers=4, d_model=64, d_ff=64, vocab=64,
                               n_heads=8, n_kv_heads=8, head_dim=128)
    chip = parse_target("gpu-h100x8").chip
    width, est = resolve.serve_layout(model, slots=4, tokens=64, chip=chip, n_devices=8)
    assert width == 1 and est.fits
    kv_one = resolve.sample_estimate(model, 8192, 4096, model_width=1, capacity=chip.hbm_bytes)
    width, est = resolve.serve_layout(model, slots=8192, tokens=4096, chip=chip, n_devices=8)
    assert width == 8 and est.activations == pytest.approx(kv_one.activations / 8)
    base = bench_rollout_config.get_config("full")
    with pytest.raises(resolve.DoesNotFit, match="256 slots of 4096 tokens do not fit one "
                                                 "engine: .* fits: gpu-h100x8$"):
        _resolve("bench_rollout", base, "tpu-v6e:2x2")
    config, line = _resolve("bench_rollout", base, "gpu-h100x8", ["serve.model_parallel=8"])
    assert config is base and "as set" in line


@pytest.mark.parametrize("loads,units", [({"a": 3.0, "b": 1.0}, 4), ({"a": 1.0, "b": 1.0}, 5),
                                         ({"s": 8.0e9, "v": 4.0e9}, 16),
                                         ({"x": 0.0, "y": 0.0, "z": 0.0}, 7),
                                         ({"p": 2.0, "q": 5.0, "r": 1.0}, 11)])
def test_split_units_is_the_meshes_allocation(loads, units):
    from jaxflow.marl.balance import allocate_workers

    assert resolve.split_units(loads, units) == allocate_workers(loads, units)


def test_host_block_of_a_pod_slice_is_whole_hosts_in_id_order():
    """Pure rule (``Target.host_block``) and the device-derived one (``mesh.host_block``) on a
    fake 4x4x1 slice of 2x2-chip hosts in id order (x fastest): the first 8 ids are hosts 0
    and 1, a 4x2x1 box; one host, or devices without coordinates, give 1."""
    import types

    from jaxflow.mesh import host_block

    assert [parse_target(t).host_block for t in ("tpu-v5p:4x4x4", "tpu-v6e:16x16",
                                                  "tpu-v5p:2x2x2", "tpu-v5e:2x2",
                                                  "gpu-h100x8")] == [8, 32, 4, 1, 1]
    fake = [types.SimpleNamespace(id=4 * y + x, coords=(x, y, 0),
                                  process_index=2 * (y // 2) + x // 2)
            for y in range(4) for x in range(4)]
    assert host_block(fake) == 8
    assert host_block([types.SimpleNamespace(id=d.id, coords=d.coords, process_index=0)
                       for d in fake]) == 1
    assert host_block([types.SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]) == 1


def test_marl_layout_splits_trainers_in_whole_host_blocks():
    """flexmarl full on v5p:4x4x4 in blocks of 8 chips: 32 trainer chips as 16 + 16 (model
    4: 4 data replicas each, 32 rows -> 8 per device), where blocks of the model degree alone
    give 20 + 12, and a 12-chip verifier mesh does not compile."""
    base = flexmarl_config.get_config("full")
    target = parse_target("tpu-v5p:4x4x4")
    agents = {"solver": resolve.ModelShape.of(base.solver),
              "verifier": resolve.ModelShape.of(base.verifier)}
    kw = dict(train_rows=base.micro_inputs * base.group_size,
              sample_rows=base.rollout_batch * base.group_size,
              tokens={"solver": base.solver_tokens, "verifier": base.verifier_tokens},
              chip=target.chip, n_devices=64)
    lay = resolve.marl_layout(agents, host_block=8, **kw)
    assert (lay.rollout_devices, lay.trainer_model) == (32, 4)
    assert lay.trainer_split == {"solver": 16, "verifier": 16}
    for name, m in agents.items():
        assert lay.estimates[f"trainer/{name}"] == resolve.marl_train_estimate(
            m, kw["train_rows"] / 4, kw["tokens"][name], model_width=4,
            capacity=target.chip.hbm_bytes)
    # at model 2 (what the estimate without the gradient sum and bf16 copy took) the solver's
    # accumulate_apply compiled to 96.8 GiB of 95; now the estimate refuses model 2
    two = resolve.marl_train_estimate(agents["solver"], kw["train_rows"] / 8, base.solver_tokens,
                                      model_width=2, capacity=target.chip.hbm_bytes)
    assert not two.fits
    old = resolve.marl_layout(agents, **kw)  # blocks of the model degree: 5 + 3 units of 4
    assert old.trainer_split == {"solver": 20, "verifier": 12}  # the 4x3x1 mesh again
