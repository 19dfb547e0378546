"""The compile report's efficiency figures (roofline MFU bound, MFU estimate), its MaxText
comparison, and the kernel fall-backs it lists: hand-made inputs, one tiny CPU compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxflow.compile_only import Program, efficiency, report
from jaxflow.compile_only.compile import compile_program
from pallas_kernels import dispatch, targets

V5P = targets.CHIPS["v5p"]  # 459e12 FLOP/s, 600e9 B/s ICI
NONE = {k: {"count": 0, "bytes": 0} for k in ("all-reduce", "all-gather", "reduce-scatter",
                                               "all-to-all", "collective-permute")}


def test_wire_bytes_follow_the_ring_algorithm_of_each_kind():
    coll = {"all-reduce": {"count": 1, "bytes": 100}, "all-gather": {"count": 2, "bytes": 80},
            "reduce-scatter": {"count": 1, "bytes": 10}, "all-to-all": {"count": 1, "bytes": 40},
            "collective-permute": {"count": 3, "bytes": 7}}
    # g = 4: 2 x 3/4 x 100 + 3/4 x 80 + 3 x 10 + 3/4 x 40 + 7
    assert efficiency.wire_bytes(coll, 4) == pytest.approx(150 + 60 + 30 + 30 + 7)
    assert efficiency.wire_bytes(coll, 1) == 0.0
    with pytest.raises(ValueError, match="group=0; valid"):
        efficiency.wire_bytes(coll, 0)
    with pytest.raises(ValueError, match=r"\['all-scatter'\]; valid"):
        efficiency.wire_bytes({"all-scatter": {"count": 1, "bytes": 1}}, 2)


def test_bound_and_estimate_on_hand_made_times():
    """model compute 1 s; compute 1.25 s, memory 0.5 s, an all-reduce on 8 devices whose ring
    takes 0.4 s: bound 1 / 1.25, estimate 1 / (1.25 + 0.4); half hidden: 1 / (1.25 + 0.2)."""
    all_reduce = 0.4 * V5P.ici_bandwidth / (2 * 7 / 8)
    coll = {**NONE, "all-reduce": {"count": 1, "bytes": all_reduce}}
    args = dict(model_flops=8 * V5P.peak_flops, n_devices=8, compute_seconds=1.25,
                memory_seconds=0.5, collectives=coll, chip=V5P)
    got = efficiency.figures(**args)
    assert got["model_compute_seconds"] == pytest.approx(1.0)
    assert got["interconnect_seconds"] == pytest.approx(0.4)
    assert got["roofline_mfu_bound"] == pytest.approx(0.8)
    assert got["mfu_estimate"] == pytest.approx(1 / 1.65)
    assert efficiency.figures(**args, overlap=0.5)["mfu_estimate"] == pytest.approx(1 / 1.45)
    # interconnect the longest: the bound is set by it, the estimate adds it whole
    slow = {**NONE, "all-reduce": {"count": 1, "bytes": 5 * all_reduce}}
    got = efficiency.figures(**{**args, "collectives": slow})
    assert got["roofline_mfu_bound"] == pytest.approx(1 / 2.0)
    assert got["mfu_estimate"] == pytest.approx(1 / 3.25)
    with pytest.raises(ValueError, match="overlap=1.5; valid"):
        efficiency.figures(**args, overlap=1.5)


def _report(chip: str, target: str, mfu_inputs: dict) -> dict:
    entry = {"name": "train/step", "kind": "train", "status": "ok", "n_devices": 8,
             "model_flops": 8 * targets.CHIPS[chip].peak_flops, "collectives": NONE,
             "roofline": mfu_inputs}
    return {"chip": {"name": chip}, "target": {"text": target}, "git_commit": "abc",
            "programs": [entry, {**entry, "name": "eval", "kind": "forward"}]}


def test_comparison_sits_beside_maxtexts_published_figure_for_the_chip():
    times = {"compute_seconds": 2.0, "memory_seconds": 1.0}
    rows = efficiency.comparison_rows([_report("v6e", "tpu-v6e:16x16", times),
                                       _report("h100", "gpu-h100x8", times)])
    assert [r["target"] for r in rows] == ["tpu-v6e:16x16", "gpu-h100x8"]  # train steps only
    v6e, h100 = rows
    assert v6e["roofline_mfu_bound"] == v6e["mfu_estimate"] == pytest.approx(0.5)
    assert v6e["maxtext"]["model"] == "Llama-3.1-8B" and v6e["maxtext"]["mfu"] == 0.4546
    assert h100["maxtext"] is None and h100["maxtext_other"] == []
    text = efficiency.comparison_table(rows).splitlines()
    assert "roofline MFU bound" in text[0] and "MFU estimate" in text[0]
    assert "50.0%" in text[1] and "45.5% (Llama-3.1-8B, 256 chips" in text[1]
    assert text[2].endswith("none published")
    assert efficiency.missing_chips(rows) == [
        "v5p: no compile report given (MaxText: none published)"]
    assert efficiency.missing_chips([])[1] == (
        "v6e: no compile report given (MaxText: Llama-3.1-8B 45.46% on 256 chips, SL 8192)")
    seventy = efficiency.comparison_rows([_report("v5p", "tpu-v5p:8x8x8", times)],
                                         model="Llama-3-70B")
    assert seventy[0]["maxtext"] is None  # v5p: MaxText publishes Llama-2-70B, not Llama-3
    assert [m["model"] for m in seventy[0]["maxtext_other"]] == ["Llama-2-70B"]


def test_report_keys_are_renamed_for_what_they_are():
    assert "mfu" not in report.formulas()
    assert {"roofline_mfu_bound", "mfu_estimate", "compile_seconds"} <= set(report.formulas())
    assert report.chip_figures(V5P)["ici_source"].startswith("ICI 1,200 GB/s")


# ---- kernel fall-backs -------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.clear_cache()  # the one-warning-per-shape memory
    yield
    dispatch.clear_cache()


def _with_refused_kernel(x):
    """A traced program whose ``auto`` kernel is refused (a reason known without building)."""
    use = dispatch.choose_kernel("tiny_kernel", "auto", lambda v: v, (x,),
                                 blocked="needs 99 MiB of VMEM (budget 16 MiB)")
    assert use is False
    return jnp.sin(x) * 2.0


def test_recorders_nest_and_leave_by_identity(monkeypatch):
    monkeypatch.setattr(dispatch, "backend_platform", lambda: "tpu")
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.warns(RuntimeWarning, match="tiny_kernel unavailable on tpu"):
        with dispatch.recording_fallbacks() as outer:
            with dispatch.recording_fallbacks() as inner:  # both empty: equal lists
                pass
            _with_refused_kernel(x)
    assert inner == [] and len(outer) == 1
    assert outer[0] == {"kernel": "tiny_kernel", "platform": "tpu", "shapes": "float32[4,8]",
                        "reason": "needs 99 MiB of VMEM (budget 16 MiB)"}
    _with_refused_kernel(x)  # no block open: nothing recorded, nothing raised
    assert len(outer) == 1


def test_a_refused_kernel_shows_in_the_report(monkeypatch):
    """A tiny program compiled for the CPU stand-ins, its kernel refused while traced: the
    entry lists the fall-back (once), the table names it, the summary names the program."""
    monkeypatch.setattr(dispatch, "backend_platform", lambda: "tpu")
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)

    def twice(v):
        return _with_refused_kernel(_with_refused_kernel(v))

    program = Program("rollout/prefill", jax.jit(twice), (x,), mesh, kind="forward")
    with pytest.warns(RuntimeWarning):
        entry = compile_program(program, V5P)
    assert entry["status"] == "ok" and entry["seconds"]["compile"] > 0
    assert entry["kernel_fallbacks"] == [{
        "kernel": "tiny_kernel", "platform": "tpu", "shapes": "float32[4,8]",
        "reason": "needs 99 MiB of VMEM (budget 16 MiB)"}]
    header, row = report.table([entry]).splitlines()
    assert "XLA fallbacks" in header and "compile s" in header
    assert row.split()[6] == "tiny_kernel"
    summary = report.fallback_summary([entry], [{"kernel": "other", "platform": "gpu",
                                                 "shapes": "", "reason": "r"}])
    assert [(s["kernel"], s["programs"]) for s in summary] == [
        ("tiny_kernel", ["rollout/prefill"]), ("other", [])]
