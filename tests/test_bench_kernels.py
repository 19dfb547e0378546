"""bench_kernels quick (interpret mode, the kernel tests' shapes): the JSON schema, every max
error within its kernel's tolerance, and sides that cannot build recorded instead of raising."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from configs import bench_kernels as cfg
from jaxflow import run as runner
from jaxflow.bench import kernel_cases as bk
from jaxflow.bench.kernels import run_case

ROW_KEYS = {"kernel", "name", "shape", "dtype", "tolerance", "status", "reference_status",
            "max_error", "within_tolerance", "kernel_temp_bytes", "reference_temp_bytes",
            "throughput_model", "bytes_moved", "flops"}


@pytest.fixture(scope="module")
def quick_summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_kernels") / "run"
    assert runner.main(["--exp=bench_kernels", "--variant=quick", "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


def test_quick_rows_schema_and_tolerances(quick_summary):
    s = quick_summary
    assert s["interpret"] is True and s["times_meaningful"] is False and s["size"] == "test"
    rows = s["rows"]
    families = {r["kernel"] for r in rows}
    assert families == set(cfg.KERNELS)
    for r in rows:
        assert ROW_KEYS <= set(r), (r["name"], ROW_KEYS - set(r))
        assert r["status"] == "ok" or r["status"].startswith("unavailable"), r["status"]
        assert r["tolerance"] == bk.TOLERANCE[r["kernel"]][r["dtype"]]
        if r["status"] == "ok" and r["reference_status"] == "ok":
            assert r["within_tolerance"] is True and r["max_error"] <= r["tolerance"], r
            assert r["pairs"] == 10 and r["kernel_s"] > 0 and r["reference_s"] > 0
            assert r["speedup_spread"][0] <= r["speedup_vs_reference"] <= r["speedup_spread"][1]
            assert r["kernel_temp_bytes"] is None or r["kernel_temp_bytes"] >= 0
            assert (r.get("kernel_GBps") or r.get("kernel_TFLOPps")) > 0
            if r.get("kernel_GBps"):
                assert r["kernel_fraction_of_copy_bandwidth"] == pytest.approx(
                    r["kernel_GBps"] / s["copy_GBps"])
    # every Pallas kernel family runs here (interpret mode); attention needs its module
    for fam in ("fused_logprobs", "embedding_bag", "sync_diff_compact", "sync_scatter_apply"):
        (row,) = [r for r in rows if r["kernel"] == fam]
        assert row["status"] == "ok" and row["within_tolerance"], row
    assert s["all_within_tolerance"] is True and s["copy_GBps"] > 0
    fused = next(r for r in rows if r["kernel"] == "fused_logprobs")
    assert fused["kernel_temp_over_naive_logits"] == pytest.approx(
        fused["kernel_temp_bytes"] / fused["naive_logits_bytes"])
    diff = next(r for r in rows if r["kernel"] == "sync_diff_compact")
    assert not diff["overflow"] and diff["changed"] > 0
    scatter = next(r for r in rows if r["kernel"] == "sync_scatter_apply")
    assert scatter["reconstructs_new_version"] and scatter["updates"] == diff["changed"]
    attention = [r for r in rows if r["kernel"] == "attention"]
    assert [r["backend"] for r in attention] == list(cfg.get_config("quick").attention.backends)
    if bk.attention_module() is None:
        assert all(r["status"].startswith("unavailable: module missing") for r in attention)
    else:  # splash and flash run in interpret mode on the CPU; cuDNN needs a GPU
        by = {r["backend"]: r for r in attention}
        for b in ("auto", "splash", "flash"):
            assert by[b]["status"] == "ok" and by[b]["within_tolerance"], by[b]
        assert by["cudnn"]["status"].startswith("unavailable: build failed")
        assert by["cudnn"]["reference_status"] == "ok"


def _fake_attention_module():
    """Stands in for jaxflow.models.attention_backends: xla == flash (a jnp causal attention
    with segment ids and GQA); "broken" raises at trace time, like a kernel that cannot build."""

    def attention(q, k, v, segment_ids, *, backend="auto", interpret=False):
        if backend == "broken":
            raise NotImplementedError("no lowering for this platform")
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        t = q.shape[1]
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = same & (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :])
        p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    mod = types.ModuleType("jaxflow.models.attention_backends")
    mod.attention = attention
    mod.ATTENTION_BACKENDS = ("auto", "xla", "flash", "broken")
    return mod


def test_attention_rows_light_up_with_the_module_and_record_what_cannot_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "jaxflow.models.attention_backends",
                        _fake_attention_module())
    a = dataclasses.replace(cfg.get_config("quick").attention,
                            backends=("flash", "broken", "splash"), tokens=(16,))
    references = {}  # the XLA reference is built once and compared with every backend
    rows = [run_case(c, pairs=2, warmup=0, references=references)
            for c in bk.attention_cases(a, True, jax.random.key(0))]
    assert list(references) == [("attention", "xla", 16)]
    by = {r["backend"]: r for r in rows}
    assert by["flash"]["status"] == "ok" and by["flash"]["max_error"] == 0.0
    assert by["flash"]["kernel_TFLOPps"] > 0
    assert by["broken"]["status"].startswith("unavailable: build failed: NotImplementedError")
    assert by["broken"]["reference_status"] == "ok" and by["broken"]["reference_s"] > 0
    assert by["splash"]["status"].startswith("unavailable: 'splash' not in ATTENTION_BACKENDS")


def test_accelerator_inputs_match_the_host_inputs_in_shape_and_dtype(monkeypatch):
    """On a GPU / TPU the inputs are drawn by one jitted program; that path, traced here, gives
    the same arguments (shapes, dtypes) as the numpy path the CPU uses."""
    config = dataclasses.replace(cfg.get_config("quick"),
                                 kernels=("fused_logprobs", "embedding_bag", "sync_diff_compact"))

    def signature():
        return [(c.name, [(a.shape, a.dtype) for a in c.args])
                for c in bk.iter_cases(config, True)]

    host = signature()
    monkeypatch.setattr(bk, "on_accelerator", lambda: True)
    assert signature() == host


def test_a_wrong_kernel_fails_its_tolerance():
    x = jnp.arange(8.0)
    case = bk.Case("embedding_bag", "wrong", "8", "float32", lambda x: x + 1e-3,
                   lambda x: x, (x,))
    row = run_case(case, pairs=1, warmup=0)
    assert row["within_tolerance"] is False
    assert row["max_error"] == pytest.approx(1e-3 / 7, rel=1e-3)


def test_config_rejects_unknown_kernels_and_sizes():
    from jaxflow.config import ConfigError, apply_overrides

    with pytest.raises(ConfigError, match="kernels"):
        apply_overrides(cfg.get_config("quick"), ["kernels=fused_logprobs,bogus"])
    with pytest.raises(ConfigError, match="size"):
        apply_overrides(cfg.get_config("quick"), ["size=huge"])
