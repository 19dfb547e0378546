"""``--compile-only --target=T`` in the main environment (no TPU / GPU compiler): the flag, target,
driver and compiler checks (exit 2, one line, nothing written), target parsing, the HLO reader on
a sharded program compiled for the session's 8 fake CPU devices, the roofline / efficiency arithmetic,
and lm_pretrain's programs. The end-to-end runs here compile for CPU devices standing in for
the target's (``Target.devices`` patched); tests/aot/test_compile_only.py compiles for the real
chips."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import run as runner
from jaxflow.compile_only import Program, hlo, report, transformer_train_flops
from jaxflow.compile_only.target import Target, TargetError, parse_target
from jaxflow.config import get_experiment
from jaxflow.main import lm_pretrain
from jaxflow.run_meshes import resolve_meshes
from pallas_kernels import targets
from tests._cli import TINY_LM

LM = ["--exp=lm_pretrain", "--variant=quick", *TINY_LM]


def one_line_error(capsys, argv, code=2) -> str:
    got = runner.main(argv)
    err = capsys.readouterr().err.strip()
    assert got == code, (got, err[-2000:])
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


# ---- target parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("text,chip,topology,n", [
    ("tpu-v5e:2x2", "v5e", "v5e:2x2", 4),
    ("tpu-v5p:4x4x4", "v5p", "v5p:4x4x4", 64),
    ("tpu-v6e:4x4", "v6e", "v6e:4x4", 16),
    ("gpu-h100x8", "h100", "1x1x8", 8),
    ("gpu-h200x8", "h200", "1x1x8", 8),
    ("gpu-h100x2", "h100", "1x1x2", 2),
])
def test_targets_parse(text, chip, topology, n):
    t = parse_target(text)
    assert (t.text, t.chip.name, t.topology, t.n_devices) == (text, chip, topology, n)
    assert t.chip is targets.CHIPS[chip] and t.platform == targets.CHIPS[chip].platform


@pytest.mark.parametrize("text,says", [
    ("tpu-v5p", "valid: tpu-v5e:TOPOLOGY"), ("tpu-v7:2x2", "unknown TPU chip 'v7'"),
    ("gpu-a100x8", "unknown GPU chip 'a100'"), ("gpu-h100x0", "0 GPUs"),
    ("h100x8", "gpu-h100xN"), ("", "valid:"), ("tpu-v5p:0x4x4", "no chips"),
])
def test_bad_targets_name_the_valid_forms(text, says):
    with pytest.raises(TargetError, match="valid") as e:
        parse_target(text)
    assert says in str(e.value)


# ---- the CLI's user errors: exit 2, one line, nothing written ---------------------------------

@pytest.mark.parametrize("flags,says", [
    (["--compile-only"], "--compile-only needs --target=T; valid: tpu-v5e:TOPOLOGY"),
    (["--target=tpu-v5e:2x2"], "--target needs --compile-only"),
    (["--compile-only", "--target=tpu-v9:2x2"], "unknown TPU chip 'v9'"),
    (["--compile-only", "--target=gpu-h100"], "--target 'gpu-h100'; valid:"),
    (["--compile-only", "--target=tpu-v5e:2x2", "--dry-run"], "does not combine with --dry-run"),
    (["--compile-only", "--target=tpu-v5e:2x2", "--resume"], "does not combine with --resume"),
    (["--compile-only", "--target=tpu-v5e:2x2", "--devices=4"], "does not combine with --devices"),
    (["--compile-only", "--target=tpu-v5e:2x2", "--coordinator=127.0.0.1:1234",
      "--num-processes=2", "--process-id=0"], "does not combine with --coordinator"),
])
def test_flag_errors(capsys, tmp_path, flags, says):
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LM, f"--out={out}", *flags])
    assert says in err
    assert not out.exists()


@pytest.mark.parametrize("target,install", [
    ("tpu-v5e:2x2", 'pip install "jax[tpu]=='), ("gpu-h100x8", "pip install jax-cuda12-plugin==")])
def test_missing_compiler_names_the_install_command(capsys, tmp_path, monkeypatch, target,
                                                    install):
    monkeypatch.setattr(targets, "available", lambda platform: False)  # as in this env
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LM, f"--out={out}", "--compile-only", f"--target={target}"])
    assert install in err and f"--target {target}" in err
    assert not out.exists()


def test_experiment_without_compile_programs(capsys, tmp_path, monkeypatch):
    monkeypatch.delattr(lm_pretrain, "compile_programs")
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LM, f"--out={out}", "--compile-only", "--target=tpu-v5e:2x2"])
    assert "experiment 'lm_pretrain' cannot compile ahead" in err and "valid:" in err
    assert "jaxflow.main.lm_pretrain defines no compile_programs" in err
    assert not out.exists()


@pytest.fixture
def cpu_target(monkeypatch, tmp_path):
    """``--target=tpu-v5e:2x2`` compiled for 4 of the session's CPU devices standing in for
    the chips (the compilers are not installed here); the persistent cache in tmp_path."""
    monkeypatch.setattr(targets, "require", lambda platform: None)
    monkeypatch.setattr(Target, "devices", lambda self: jax.devices()[: self.n_devices])
    monkeypatch.setenv("JAXFLOW_COMPILATION_CACHE", str(tmp_path / "xla-cache"))


@pytest.mark.parametrize("sets,says", [
    (["mesh.shape=3,1"], "mesh {'data': 3, 'model': 1} needs 3 devices but 4"),
    (["train.batch_size=6"], "train.batch_size=6 is not divisible by 4 devices"),
])
def test_meshes_the_target_cannot_form(capsys, tmp_path, cpu_target, sets, says):
    out = tmp_path / "run"
    argv = [*LM, f"--out={out}", "--compile-only", "--target=tpu-v5e:2x2"]
    for s in sets:
        argv += ["--set", s]
    err = one_line_error(capsys, argv)
    assert says in err and "tpu-v5e:2x2 (4 v5e devices)" in err
    assert not out.exists()


# ---- end to end on stand-in CPU devices -------------------------------------------------------

def test_compile_only_writes_the_report(capsys, tmp_path, cpu_target):
    out = tmp_path / "run"
    assert runner.main([*LM, f"--out={out}", "--compile-only", "--target=tpu-v5e:2x2"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["compile_report.json", "config.json"]
    rep = json.loads((out / "compile_report.json").read_text())
    assert rep["target"] == {"text": "tpu-v5e:2x2", "chip": "v5e", "platform": "tpu",
                             "topology": "v5e:2x2", "n_devices": 4}
    assert rep["chip"]["hbm_bytes"] == targets.CHIPS["v5e"].hbm_bytes and rep["chip"]["source"]
    assert rep["versions"]["jax"] == jax.__version__ and rep["argv"][0] == runner.PROG
    assert rep["config"]["model"]["d_model"] == 32
    (step,) = rep["programs"]
    assert step["name"] == "train/step" and step["status"] == "ok" and step["kind"] == "train"
    mem = step["memory"]
    assert mem["total_bytes"] == (mem["argument_bytes"] + mem["output_bytes"]
                                  + mem["temp_bytes"] - mem["alias_bytes"]) > 0
    assert mem["fits"] and mem["total_bytes"] <= mem["capacity_bytes"]
    assert step["cost"]["flops"] > 0 and step["cost"]["scope"] == "per device"
    # data parallel on 4 devices: one gradient all-reduce of every (f32) parameter at least
    assert step["collectives"]["all-reduce"]["count"] >= 1
    assert step["collectives"]["all-reduce"]["bytes"] >= 4 * _tiny_params()
    assert step["kernels"]["pallas_count"] == 0  # CPU: attention auto is the XLA reference
    assert "mfu" not in step  # renamed: it is a bound, beside an estimate
    assert 0 < step["mfu_estimate"] <= step["roofline_mfu_bound"] <= 1
    assert step["seconds"]["compile"] > 0 and step["seconds"]["lower"] > 0
    assert rep["compile_seconds"] == {"train/step": step["seconds"]}
    assert rep["kernel_fallbacks"] == [] and step["kernel_fallbacks"] == []  # CPU: XLA by design
    assert "train/step" in printed and "roofline MFU bound" in printed
    events = rep["compilation_cache"]["events"]
    assert rep["compilation_cache"]["dir"] == str(tmp_path / "xla-cache")
    assert events.get("compile_requests_use_cache", 0) >= 1
    # the CPU executable is cached and read back by a second run (deviceless ones are not)
    assert runner.main([*LM, f"--out={tmp_path / 'again'}", "--compile-only",
                        "--target=tpu-v5e:2x2"]) == 0
    again = json.loads((tmp_path / "again" / "compile_report.json").read_text())
    assert again["compilation_cache"]["events"].get("cache_hits", 0) >= 1
    assert jax.config.jax_compilation_cache_dir != str(tmp_path / "xla-cache")  # restored


def _tiny_params() -> int:
    config = get_experiment("lm_pretrain").get_config("quick")
    from jaxflow.config import apply_overrides

    config = apply_overrides(config, TINY_LM[1::2])
    from jaxflow.train.lm_state import lm_functions

    fns = lm_functions(config.model, Mesh(np.array(jax.devices()[:1]), ("data",)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(fns.abstract_params()))


def test_a_program_that_does_not_fit_exits_2_with_the_report(capsys, tmp_path, cpu_target,
                                                             monkeypatch):
    small = dataclasses.replace(targets.CHIPS["v5e"], hbm_bytes=2**10)
    monkeypatch.setitem(targets.CHIPS, "v5e", small)
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LM, f"--out={out}", "--compile-only", "--target=tpu-v5e:2x2"])
    assert "error: train/step needs " in err and " GiB per device on v5e; capacity 0.00 GiB" in err
    (step,) = json.loads((out / "compile_report.json").read_text())["programs"]
    assert step["status"] == "does_not_fit" and not step["memory"]["fits"]
    assert step["memory"]["total_bytes"] > 2**10


def test_a_failing_compile_exits_1_with_the_report(capsys, tmp_path, cpu_target, monkeypatch):
    def broken(x):
        raise RuntimeError("no lowering for this op")

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    arg = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    monkeypatch.setattr(lm_pretrain, "compile_programs", lambda config, meshes: [
        Program("broken/step", jax.jit(broken), (arg,), mesh, kind="forward")])
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LM, f"--out={out}", "--compile-only", "--target=tpu-v5e:2x2"],
                         code=1)
    assert "compiling broken/step for tpu-v5e:2x2 failed" in err and "no lowering" in err
    (entry,) = json.loads((out / "compile_report.json").read_text())["programs"]
    assert entry["status"] == "failed" and entry["error_kind"] == "lowering"


def test_compile_ahead_gives_the_compiled_output_shardings_and_is_reused():
    from jaxflow.compile_only import compile as compile_lib
    from jaxflow.compile_only.program import compile_ahead

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    arg = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P()))
    fn = jax.jit(lambda x: (x * 2, x.sum()), out_shardings=(NamedSharding(mesh, P("data")),
                                                             NamedSharding(mesh, P())))
    program, (doubled, total) = compile_ahead(Program("a/step", fn, (arg,), mesh, "forward"))
    assert program.compiled is not None and set(program.seconds) == {"lower", "compile"}
    assert (doubled.shape, total.shape) == ((8, 4), ())
    assert doubled.sharding.spec == P("data") and total.sharding.spec == P()

    class NoLowering:  # the compile step must reuse the executable, not lower again
        def lower(self, *args, **kwargs):
            raise AssertionError("lowered twice")

    entry = compile_lib.compile_program(dataclasses.replace(program, fn=NoLowering()),
                                        targets.CHIPS["v5p"])
    assert entry["status"] == "ok" and entry["seconds"] == program.seconds

    bad = Program("b/step", _RefusesToCompile(jax.jit(lambda x: x + 1)), (arg,), mesh, "forward")
    same, out = compile_ahead(bad)  # refused: uncompiled, outputs replicated by default
    assert same is bad and same.compiled is None
    assert out.shape == (8, 4) and out.sharding == NamedSharding(mesh, P())
    _, got = compile_ahead(bad, fallback=lambda shapes: ("fallback", shapes.shape))
    assert got == ("fallback", (8, 4))


class _RefusesToCompile:
    """A jitted function whose compile the compiler refuses (as when it does not fit)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def lower(self, *args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")


# ---- the HLO reader ---------------------------------------------------------------------------

def test_collectives_of_a_sharded_cpu_program():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    n = mesh.size

    def body(x):  # x: [8, 128] f32 per device
        return (jax.lax.psum(x, "d"), jax.lax.all_gather(x, "d", tiled=True),
                jax.lax.psum_scatter(x, "d", scatter_dimension=0, tiled=True),
                jax.lax.all_to_all(x, "d", 0, 0, tiled=True),
                jax.lax.ppermute(x, "d", perm=[(i, (i + 1) % n) for i in range(n)]))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                              out_specs=(P(), P(), P("d"), P("d"), P("d")), check_vma=False))
    x = jax.ShapeDtypeStruct((8 * n, 128), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    got = hlo.summarize(f.lower(x).compile().as_text())
    local = 8 * 128 * 4
    assert got.collectives == {
        "all-reduce": {"count": 1, "bytes": local},
        "all-gather": {"count": 1, "bytes": local * n},
        "reduce-scatter": {"count": 1, "bytes": local // 8},
        "all-to-all": {"count": 1, "bytes": local},
        "collective-permute": {"count": 1, "bytes": local}}
    assert got.collective_bytes == local * (3 + n) + local // 8
    assert got.pallas_kernels == {} and got.cudnn_calls == {}


# An excerpt in the form XLA:TPU / XLA:GPU print: tiled layouts, an async pair inside a while
# body with a known trip count, a multi-line frontend attribute, Pallas and cuDNN custom calls
# (long instructions are continued on lines starting with one space, as multi-line attributes
# continue in real dumps).
HLO_TEXT = r'''HloModule jit_step, entry_computation_layout={(f32[8,128]{1,0})->f32[8,128]{1,0}}

%body (p: (s32[], bf16[256,128])) -> (s32[], bf16[256,128]) {
  %p = (s32[], bf16[256,128]{1,0:T(8,128)(2,1)}) parameter(0)
  %x = bf16[256,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %all-gather-start = (bf16[32,128]{1,0:T(8,128)(2,1)}, bf16[256,128]{1,0:T(8,128)(2,1)})
 all-gather-start(%x), dimensions={0}
  %all-gather-done = bf16[256,128]{1,0:T(8,128)(2,1)} all-gather-done(%all-gather-start)
  %flash_fwd.3 = f32[8,128]{1,0} custom-call(%x), custom_call_target="tpu_custom_call",
 frontend_attributes={kernel_metadata={
"xprof_metadata":"{\"block_q\": 128}"
}}, metadata={op_name="jit(step)/shard_map/flash_fwd/flash_fwd/pallas_call" stack_frame_id=3},
 backend_config={"custom_call_config":{"body":"abc"}}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[256,128]{1,0:T(8,128)(2,1)}) tuple(%i, %all-gather-done)
}

%cond (p.1: (s32[], bf16[256,128])) -> pred[] {
  %p.1 = (s32[], bf16[256,128]{1,0}) parameter(0)
  %c = s32[] constant(32)
  %j = s32[] get-tuple-element(%p.1), index=0
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

ENTRY %main.9 (a: f32[8,128], b: bf16[256,128]) -> f32[8,128] {
  %a = f32[8,128]{1,0} parameter(0)
  %init = (s32[], bf16[256,128]{1,0}) parameter(1)
  %ar-start = f32[8,128]{1,0} all-reduce-start(%a), channel_id=2, to_apply=%add
  %ar-done = f32[8,128]{1,0} all-reduce-done(%ar-start)
  %w = (s32[], bf16[256,128]{1,0}) while(%init), condition=%cond, body=%body,
 backend_config={"known_trip_count":{"n":"32"}}
  %tr = (f32[16,128]{1,0}, f32[16,4]{1,0}) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton",
 backend_config={debug = false, name = "mha_forward", num_warps = 4 : i32}
  %cd = (bf16[8,128]{1,0}, u8[0]{0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  %cp = f32[8,128]{1,0} collective-permute(%a), source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[8,128]{1,0} add(%ar-done, %cp)
}
'''


def test_hlo_reader_on_async_loops_and_kernels():
    ins = hlo.instructions(HLO_TEXT)
    kernel = next(i for i in ins if i.name == "flash_fwd.3")
    assert kernel.computation == "body" and "xprof_metadata" in kernel.attrs  # lines joined
    assert {i.computation for i in ins} == {"body", "cond", "main.9"}
    got = hlo.summarize(HLO_TEXT)
    gathered = 256 * 128 * 2  # the -done's result, not the start's (operand, result) tuple
    assert got.collectives["all-gather"] == {"count": 32, "bytes": 32 * gathered}
    assert got.collectives["all-reduce"] == {"count": 1, "bytes": 8 * 128 * 4}
    assert got.collectives["collective-permute"] == {"count": 1, "bytes": 8 * 128 * 4}
    assert got.collectives["reduce-scatter"] == got.collectives["all-to-all"] == {
        "count": 0, "bytes": 0}
    assert got.pallas_kernels == {"flash_fwd": 32, "mha_forward": 1}
    assert got.kernel_count == 33
    assert got.cudnn_calls == {"__cudnn$fmhaSoftmax": 1}
    assert got.loop_trips == (32,)  # the compiler's cost counts that body once


def test_hlo_reader_reads_the_trip_count_of_a_tpu_loop_from_the_loop():
    """XLA:TPU leaves no known_trip_count on a compiled scan: the trip count is N - K from its
    condition (counter < constant N) and the counter's initial constant K (through a copy)."""
    text = HLO_TEXT.replace(',\n backend_config={"known_trip_count":{"n":"32"}}', "")
    text = text.replace("%init = (s32[], bf16[256,128]{1,0}) parameter(1)",
                        "%b = bf16[256,128]{1,0} parameter(1)\n  %k = s32[] constant(4)\n"
                        "  %k.copy = s32[] copy(%k)\n"
                        "  %init = (s32[], bf16[256,128]{1,0}) tuple(%k.copy, %b)")
    assert "known_trip_count" not in text
    got = hlo.summarize(text)
    assert got.loop_trips == (28,) and got.pallas_kernels["flash_fwd"] == 28
    # a loop whose counter does not start at a constant is counted once (unknown)
    unknown = text.replace("tuple(%k.copy, %b)", "tuple(%j.0, %b)").replace(
        "%k = s32[] constant(4)", "%j.0 = s32[] parameter(2)")
    assert hlo.summarize(unknown).loop_trips == ()


def test_a_program_with_loops_reports_its_bytes_as_a_lower_bound():
    chip = targets.CHIPS["v5p"]
    mesh = Mesh(np.array(jax.devices()), ("data",))
    program = Program("rollout/decode", jax.jit(lambda x: x), (), mesh, kind="sample")
    none = {k: {"count": 0, "bytes": 0} for k in hlo.COLLECTIVES}
    looped, flat = (report.program_entry(
        program, chip, memory=report.Memory(10, 20, 30, 5), hlo=hlo.HloSummary(none, {}, {}, t),
        cost=(1e12, 1e9, "compiled.cost_analysis()")) for t in ((63,), ()))
    assert looped["cost"]["bytes_lower_bound"] and looped["cost"]["loop_trips"] == [63]
    assert not flat["cost"]["bytes_lower_bound"]
    rows = [report.table([e]).splitlines()[1].split() for e in (looped, flat)]
    assert rows[0][7] == ">=" + rows[1][7]  # roofline ms, after the XLA fallbacks column


@pytest.mark.parametrize("shape,nbytes", [
    ("bf16[1024,2048]{1,0:T(8,128)(2,1)S(1)}", 1024 * 2048 * 2), ("f32[]", 4),
    ("(f32[8,128]{1,0}, s8[4]{0}, pred[2])", 8 * 128 * 4 + 4 + 2), ("s32[<=16,4]", 256),
    ("(bf16[2,2], (f32[3], u32[]))", 8 + 12 + 4), ("token[]", 0),
])
def test_shape_bytes(shape, nbytes):
    assert hlo.shape_bytes(shape) == nbytes


# ---- roofline and efficiency ----------------------------------------------------------------

def test_roofline_and_efficiency_arithmetic():
    chip = targets.CHIPS["v5p"]
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model_flops = 8 * 2e12  # 2e12 per device: more than the compiler's 1e12 (Pallas ~ 0)
    program = Program("trainer/step", jax.jit(lambda x: x), (), mesh, model_flops=model_flops)
    summary = hlo.HloSummary({**{k: {"count": 0, "bytes": 0} for k in hlo.COLLECTIVES},
                              "all-reduce": {"count": 2, "bytes": 6e8}}, {"splash": 3}, {})
    entry = report.program_entry(program, chip, memory=report.Memory(10, 20, 30, 5),
                                 cost=(1e12, 1e9, "compiled.cost_analysis()"), hlo=summary)
    compute, memory, collective = 2e12 / 459e12, 1e9 / 2765e9, 6e8 / 600e9
    line = entry["roofline"]
    assert line["compute_seconds"] == pytest.approx(compute)
    assert line["memory_seconds"] == pytest.approx(memory)
    assert line["collective_seconds"] == pytest.approx(collective)
    assert line["seconds"] == pytest.approx(max(compute, memory) + collective)
    assert line["bound"] == "compute"
    assert entry["cost"]["roofline_flops"] == 2e12 and entry["cost"]["flops"] == 1e12
    # the bound: everything overlapped; the estimate: collectives (ring, 2 x 7/8 of an
    # all-reduce's bytes on 8 devices) exposed after max(compute, memory)
    ring = 2 * 7 / 8 * 6e8 / 600e9
    assert entry["roofline_mfu_bound"] == pytest.approx((2e12 / 459e12) / compute)
    assert entry["mfu_estimate"] == pytest.approx((2e12 / 459e12) / (compute + ring))
    assert entry["memory"]["total_bytes"] == 55 and entry["memory"]["fits"]
    assert entry["kernels"]["pallas_count"] == 3 and entry["status"] == "ok"
    row = report.table([entry]).splitlines()[1].split()
    assert row[:7] == ["trainer/step", "0.00/95.0", "yes", "2.000", "572.2", "3", "-"]
    assert float(row[7]) == pytest.approx((compute + collective) * 1e3, abs=0.01)
    assert row[8:10] == [f"{100 * entry['roofline_mfu_bound']:.1f}%",
                         f"{100 * entry['mfu_estimate']:.1f}%"]
    assert row[10] == "-"  # no compile seconds given
    forward = report.program_entry(dataclasses.replace(program, kind="forward"), chip,
                                   memory=report.Memory(10, 20, 30, 5),
                                   cost=(1e12, 1e9, "x"), hlo=summary)
    assert forward["roofline_mfu_bound"] is None and forward["mfu_estimate"] is None


def test_hbm_refusals_are_read_for_their_bytes():
    chip = targets.CHIPS["v5e"]
    text = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
            "required for HLO temporaries (29.01G) exceeds available HBM (15.75G).")
    assert report.hbm_error_bytes(text) == (int(29.01 * 2**30), "HLO temporaries")
    assert report.hbm_error_bytes("Used 120.5G of 95.7G hbm") == (int(120.5 * 2**30),
                                                                  "everything")
    assert report.hbm_error_bytes("other") == (None, "")
    program = Program("big/step", jax.jit(lambda x: x), (), Mesh(np.array(jax.devices()), ("d",)))
    entry = report.program_entry(program, chip, error=text, error_kind="hbm")
    assert entry["status"] == "does_not_fit"
    assert report.not_fitting_line(entry, chip) == (
        "big/step needs 29.01 GiB per device on v5e (the compiler's figure for HLO "
        "temporaries); capacity 16.00 GiB")
    assert report.table([entry]).splitlines()[1].split()[:3] == ["big/step", ">29.01/16.0", "no"]


# ---- lm_pretrain's programs -------------------------------------------------------------------

def test_lm_pretrain_full_is_llama_3_8b_with_fsdp_over_every_device():
    spec = get_experiment("lm_pretrain")
    config = spec.get_config("full")
    meshes = resolve_meshes(spec, config, jax.devices())
    assert dict(meshes["mesh"].shape) == {"data": 1, "fsdp": 8, "model": 1}
    (step,) = lm_pretrain.compile_programs(config, meshes)
    state, batch = step.args
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    assert n_params == 8_030_261_248  # Meta-Llama-3-8B
    layer = state.params["layers"][0]
    assert layer["mlp"]["w_gate"].sharding.spec == P(None, "fsdp")  # the output dim
    assert layer["mlp"]["w_down"].sharding.spec == P("fsdp", None)
    assert state.params["lm_head"].sharding.spec == P(None, "fsdp")
    assert state.params["embedding"].sharding.spec == P("fsdp", None)
    assert layer["attn"]["wq"].sharding.spec == P("fsdp", None, None)  # attn_embed; heads: "model"
    assert layer["attn"]["wo"].sharding.spec == P(None, None, "fsdp")
    mu = state.opt_state[1][0].mu  # AdamW's first moment, sharded like the params
    assert mu["lm_head"].sharding.spec == P(None, "fsdp")
    assert all(x.shape == (256, 4096) and x.sharding.spec == P("fsdp", None)
               for x in batch.values())
    assert sorted(batch) == ["loss_mask", "positions", "segment_ids", "targets", "tokens"]
    tokens = 256 * 4096
    assert step.tokens == tokens and step.kind == "train" and step.mesh is meshes["mesh"]
    assert step.model_flops == transformer_train_flops(
        n_params - 128256 * 4096, tokens, n_layers=32, seq_len=4096, d_attn=32 * 128)
    # remat: the blocks' forward once more (not the embedding, not the head)
    assert step.recompute_flops == pytest.approx(transformer_train_flops(
        n_params - 2 * 128256 * 4096, tokens, n_layers=32, seq_len=4096, d_attn=32 * 128) / 3)
    assert "fsdp splits batch, vocab, mlp, attn_embed; the rest replicated" in step.note


@pytest.mark.parametrize("shape", [(8, 1), (4, 2)])
def test_default_rules_place_as_a_data_model_table_on_a_data_model_mesh(shape):
    """DEFAULT_RULES (the one table) put the batch, vocab and MLP hidden over "fsdp" too: on the
    ("data", "model") meshes of lm_pretrain's quick / default variants, and of every other
    experiment, they place every parameter and the batch as a table without "fsdp" does."""
    from jaxflow.mesh import MeshConfig
    from jaxflow.train.lm_state import lm_functions
    from jaxflow.train.pretrain import build_train_step

    without_fsdp = (("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
                    ("kv_heads", "model"), ("embed", None), ("head_dim", None), ("norm", None),
                    ("length", None))
    config = dataclasses.replace(get_experiment("lm_pretrain").get_config("quick"),
                                 mesh=MeshConfig(shape=shape))
    mesh = config.mesh.make(jax.devices())
    built = build_train_step(config, mesh)
    before = lm_functions(config.model, mesh, without_fsdp).param_shardings
    assert jax.tree.map(lambda s: s.spec, built.fns.param_shardings) == \
        jax.tree.map(lambda s: s.spec, before)
    assert built.batch_sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def test_compiles_at_a_time_from_the_environment(monkeypatch):
    from jaxflow.compile_only import compile as compile_lib

    monkeypatch.delenv(compile_lib.WORKERS_ENV, raising=False)
    assert compile_lib.parallel_compiles() == compile_lib.MAX_PARALLEL == 2
    monkeypatch.setenv(compile_lib.WORKERS_ENV, "1")
    assert compile_lib.parallel_compiles() == 1
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(compile_lib.WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=f"JAXFLOW_COMPILE_WORKERS={bad!r}; valid: an integer >= 1"):
            compile_lib.parallel_compiles()
