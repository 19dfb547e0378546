"""The bench_sync_codec entry on a tiny config (contract and summary keys, not timings)."""

import dataclasses

import pytest

from configs import bench_sync_codec
from jaxflow.bench import sync_codec as bench
from jaxflow.experiment import standalone_context
from jaxflow.main import bench_sync_codec as driver


def test_configs():
    for variant in bench_sync_codec.VARIANTS:
        assert isinstance(bench_sync_codec.get_config(variant), bench_sync_codec.Config)
    with pytest.raises(ValueError, match="unknown variant"):
        bench_sync_codec.get_config("huge")
    default = bench_sync_codec.get_config("default")
    shapes = bench.transformer_shapes(default.d_model, default.n_layers, default.vocab)
    assert sum(int(__import__("math").prod(s)) for s in shapes.values()) >= 100_000_000


def test_entry_on_tiny_tree():
    config = dataclasses.replace(bench_sync_codec.get_config("quick"), d_model=64, n_layers=1,
                                 vocab=512, densities=(0.006, 0.2), timing_rounds=2,
                                 timing_rounds_other=1, tight_rounds=3)
    summary = driver.main(config, standalone_context("bench_sync_codec"))
    codecs = ("dense", "coo", "gap", "entropy", "auto", "auto_sender", "auto_device", "pulse")
    for key in ("encode_gbps", "apply_gbps", "ratio_vs_dense", "bytes_over_entropy_bound"):
        assert set(summary[key]) == set(codecs), key
    assert summary["memcpy_gbps"] > 0
    assert summary["bit_exact"] is True
    assert len(summary["by_density"]) == 2 * len(codecs) - 2  # senders: headline only
    row = summary["by_density"][0]
    assert {"density", "codec", "ratio_vs_dense", "bytes_over_entropy_bound",
            "encode_gbps"} <= set(row)
    assert summary["ratio_vs_dense"]["auto"] > summary["ratio_vs_dense"]["coo"]
    assert 0.9 < summary["ratio_vs_dense"]["dense"] <= 1.0
    # both sender paths made the stateless auto payload (bit_exact covers the byte equality)
    assert summary["ratio_vs_dense"]["auto_sender"] == summary["ratio_vs_dense"]["auto"]
    assert summary["ratio_vs_dense"]["auto_device"] == summary["ratio_vs_dense"]["auto"]
    paths = summary["paths"]
    assert paths["host"]["host_bytes_over_dense_bf16"] == 1.0  # pulled whole
    assert 0 < paths["device"]["host_bytes_over_dense_bf16"] < 0.5  # only the changes
    for key in ("encode_speedup_auto_vs_pulse", "encode_speedup_auto_device_vs_pulse",
                "encode_speedup_auto_stateless_vs_pulse"):
        assert summary[key]["pairs"] == 2 and summary[key]["median"] > 0
    tight = summary["encode_tight_auto_vs_pulse"]
    assert tight["pairs"] == 3 and 0 < tight["sender_ms_min"] <= tight["sender_ms_median"]
