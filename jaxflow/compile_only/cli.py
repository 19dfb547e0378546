"""``python -m jaxflow.run --exp=NAME --variant=V [--set k=v] [--out DIR] --compile-only
--target=T``: every jitted program the experiment would run, compiled for ``T``'s abstract
chips (:mod:`jaxflow.compile_only.target`); nothing is allocated or executed.

In order: the flags (:func:`flag_problem`: ``--target`` and ``--compile-only`` go together and
exclude ``--resume``, ``--dry-run``, ``--devices`` and the multi-process flags), the driver
(it must define ``compile_programs``: :class:`jaxflow.contract.CompilesAhead`), the compiler
for the target's platform (``pallas_kernels.targets.require``), the compile environment set
before jax starts a backend (``targets.compile_env``), a ``full`` variant's layout for the
target (:func:`resolve_layout`: it fits, or one line naming the smallest target it fits), the
target's devices, the experiment's
meshes on them (``jaxflow.run_meshes.resolve_meshes``), ``compile_programs(config, meshes)``;
each failure there is a user error: exit 2, one line, nothing written. Then the programs are
compiled two at a time (:mod:`jaxflow.compile_only.compile`), the table
(:func:`jaxflow.compile_only.report.table`) is printed and ``config.json`` and
``compile_report.json`` are written in the run directory (``--out``, default
``runs/NAME/<timestamp>``); the report holds each program's lower and compile seconds
(``compile_seconds``) and every kernel whose ``auto`` dispatch fell back to XLA while the
programs were built and traced (``kernel_fallbacks``, with the programs it hit). jax's
persistent compilation cache lives in ``$JAXFLOW_COMPILATION_CACHE`` (default
``~/.cache/jaxflow/xla``); see
:mod:`jaxflow.compile_only.compile` for why it does not yet save deviceless compiles.

Exit codes: 0 when every program compiles and fits the chip's HBM; 2 when one does not fit
(the report is written; one line ``... error: PROGRAM needs X GiB per device on CHIP;
capacity Y GiB``); 1 when a compile fails for another reason (report written, one line).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import time

from jaxflow import contract
from jaxflow.compile_only.target import Target, TargetError, parse_target, valid_forms

REPORT = "compile_report.json"
#: Flags --compile-only does not combine with: (attribute, flag).
INCOMPATIBLE = (("resume", "--resume"), ("dry_run", "--dry-run"), ("devices", "--devices"),
                ("coordinator", "--coordinator"), ("distributed_auto", "--distributed-auto"),
                ("kill_after_checkpoint", "--kill-after-checkpoint"))


class CompileOnlyUsageError(Exception):
    """A user error of ``--compile-only`` (the runner prints it as one line, exit 2)."""


def flag_problem(args) -> str | None:
    """What is wrong with the ``--compile-only`` / ``--target`` flags of ``args``, as one
    sentence naming the valid choices, or None."""
    if args.target is not None and not args.compile_only:
        return "--target needs --compile-only (compile for that target, run nothing)"
    if not args.compile_only:
        return None
    if args.target is None:
        return f"--compile-only needs --target=T; valid: {valid_forms()}"
    for attr, flag in INCOMPATIBLE:
        if getattr(args, attr, None) not in (None, False):
            return (f"--compile-only does not combine with {flag}: it compiles for --target's "
                    "chips and runs, resumes and spawns nothing")
    try:
        parse_target(args.target)
    except TargetError as e:
        return str(e)
    return None


def _driver(spec):
    return importlib.import_module(spec.entry.partition(":")[0])


def compiling_experiments() -> list[str]:
    """The registered experiments whose driver defines ``compile_programs``."""
    from jaxflow.config import experiments

    names = []
    for name, spec in experiments().items():
        try:
            driver = _driver(spec)
        except ImportError:  # an optional extra missing: that driver cannot compile here
            continue
        if isinstance(driver, contract.CompilesAhead):
            names.append(name)
    return names


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def prepare(plan) -> tuple[Target, object]:
    """(target, driver module) once the driver and the compiler are known to be there, with
    the compile environment set; CompileOnlyUsageError otherwise."""
    from pallas_kernels import targets

    target = parse_target(plan.args.target)
    driver = _driver(plan.spec)
    if not isinstance(driver, contract.CompilesAhead):
        have = ", ".join(compiling_experiments()) or "none"
        raise CompileOnlyUsageError(
            f"--compile-only: experiment {plan.name!r} cannot compile ahead ({driver.__name__} "
            f"defines no compile_programs); valid: {have}")
    try:
        targets.require(target.platform)
    except targets.CompilerMissing as e:
        raise CompileOnlyUsageError(f"--target {target.text}: {e}") from None
    if not _backends_initialized():
        for key, value in targets.compile_env().items():
            os.environ.setdefault(key, value)
    return target, driver


def build_programs(plan, target: Target, driver) -> tuple[list, int]:
    """(the driver's programs on the target's meshes, the target's device count); ``plan``'s
    config as :func:`resolve_layout` lays it out."""
    from jaxflow.config import ConfigError
    from jaxflow.mesh import MeshError
    from jaxflow.run_meshes import resolve_meshes

    try:
        devices = target.devices()
    except TargetError as e:
        raise CompileOnlyUsageError(str(e)) from None
    where = f"on --target {target.text} ({len(devices)} {target.chip.name} devices)"
    try:
        meshes = resolve_meshes(plan.spec, plan.config, devices)
    except (MeshError, ValueError) as e:
        raise CompileOnlyUsageError(f"{e} {where}; set --set mesh.shape=... or another "
                                    "--target") from None
    try:
        programs = list(driver.compile_programs(plan.config, meshes))
    except (MeshError, ConfigError) as e:
        raise CompileOnlyUsageError(f"{e} {where}") from None
    names = [p.name for p in programs]
    if not programs or len(set(names)) != len(names):
        raise RuntimeError(f"{driver.__name__}.compile_programs returned programs {names}; "
                           "it must return at least one, each with its own name")
    return programs, len(devices)


def resolve_layout(plan, target: Target):
    """(``plan`` with its config laid out for ``target``, the layout as one line or "") by
    :func:`jaxflow.compile_only.variants.resolve_for_target` (a ``full`` variant's mesh, roles
    and micro-batches from the target); CompileOnlyUsageError (exit 2, one line) when no
    layout fits, naming the smallest target that does."""
    import dataclasses

    from jaxflow.compile_only.resolve import DoesNotFit
    from jaxflow.compile_only.variants import resolve_for_target

    if target.n_devices is None:
        return plan, ""
    try:
        config, text = resolve_for_target(plan.name, plan.variant, plan.config, target.chip,
                                          target.n_devices, plan.overrides,
                                          host_block=target.host_block)
    except DoesNotFit as e:
        raise CompileOnlyUsageError(f"{plan.name} [{plan.variant}] on --target {target.text} "
                                    f"({target.n_devices} x {target.chip.name}): {e}") from None
    return dataclasses.replace(plan, config=config), text


def run(plan, out, *, git_commit: str, prog: str) -> int:
    """Compiles ``plan``'s experiment for ``plan.args.target`` into the run directory
    ``out`` (an ``epath.Path``, checked fresh); the exit code (see the module docstring)."""
    target, driver = prepare(plan)
    plan, layout = resolve_layout(plan, target)
    import jax

    from jaxflow.compile_only import compile as compile_lib
    from jaxflow.compile_only import report as report_lib

    try:
        workers = compile_lib.parallel_compiles()
    except ValueError as e:
        raise CompileOnlyUsageError(str(e)) from None
    from pallas_kernels import dispatch

    cache = compile_lib.cache_dir()
    start, load_start = time.time(), os.getloadavg()[0]
    with compile_lib.persistent_cache(cache) as events:
        with dispatch.recording_fallbacks() as building:
            programs, n_devices = build_programs(plan, target, driver)
        print(f"[jaxflow] {plan.name} [{plan.variant}] --compile-only for {target.text} "
              f"({n_devices} x {target.chip.device_kind}): {len(programs)} program(s), "
              f"{workers} compile(s) at a time -> {out}", flush=True)
        if layout:
            print(f"[jaxflow] {layout}", flush=True)
        entries, notes, unreadable = compile_lib.compile_all(programs, target.chip,
                                                             workers=workers)
    chip = target.chip
    report = {
        "experiment": plan.name, "variant": plan.variant, "overrides": plan.overrides,
        "argv": [prog, *plan.argv], "git_commit": git_commit,
        "target": {"text": target.text, "chip": chip.name, "platform": chip.platform,
                   "topology": target.topology, "n_devices": n_devices},
        "chip": report_lib.chip_figures(chip),
        "versions": {"jax": jax.__version__, "jaxlib": _version("jaxlib"),
                     "libtpu": _version("libtpu"),
                     "jax_cuda12_plugin": _version("jax-cuda12-plugin")},
        "formulas": report_lib.formulas(),
        "layout": layout,
        "compilation_cache": {
            "dir": cache, "events": dict(events), "unreadable_entries": unreadable,
            "note": "jax's persistent cache; deviceless executables are written but, with jax "
                    "0.10.2, cannot be read back (unreadable_entries), so each run compiles"},
        "wall_seconds": time.time() - start,
        "host": {"cpus": os.cpu_count(), "load_1min": [load_start, os.getloadavg()[0]],
                 "note": "the compiling host's 1-minute load average at the start and the end "
                         "(the end's counts this run's own compiles)"},
        "compile_seconds": {e["name"]: e["seconds"] for e in entries},
        "kernel_fallbacks": report_lib.fallback_summary(entries, building),
        "warnings": notes,
        "programs": entries,
        "config": plan.config,
    }
    _write(out, plan, report)
    print(report_lib.table(entries))
    print(f"[jaxflow] wrote {out}/{REPORT}", flush=True)
    return _verdict(entries, chip, target, out, prog)


def _write(out, plan, report: dict) -> None:
    import json

    from jaxflow.experiment import to_jsonable

    out.mkdir(parents=True, exist_ok=True)
    saved = {"experiment": plan.name, "variant": plan.variant, "overrides": plan.overrides,
             "devices": None, "compile_only": {"target": plan.args.target},
             "config": plan.config}
    (out / "config.json").write_text(json.dumps(to_jsonable(saved), indent=2), encoding="utf-8")
    (out / REPORT).write_text(json.dumps(to_jsonable(report), indent=2), encoding="utf-8")


def _verdict(entries: list[dict], chip, target: Target, out, prog: str) -> int:
    from jaxflow.compile_only.report import not_fitting_line

    failed = [e for e in entries if e["status"] == "failed"]
    if failed:
        e = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        print(f"{prog}: error: compiling {e['name']} for {target.text} failed{more}: "
              f"{e['error'][:300]}; report: {out}/{REPORT}", file=sys.stderr, flush=True)
        return 1
    too_big = [e for e in entries if e["status"] == "does_not_fit"]
    if too_big:
        more = f" (and {len(too_big) - 1} more program(s))" if len(too_big) > 1 else ""
        print(f"{prog}: error: {not_fitting_line(too_big[0], chip)}{more}", file=sys.stderr,
              flush=True)
        return 2
    return 0
