"""Kernel-or-XLA decisions that are made where a failure can still be caught.

A Pallas kernel that traces fine can still fail when the enclosing program compiles (Mosaic
tiling and VMEM checks, Triton shared memory, a missing lowering), which is too late to fall
back. ``kernel_verdict`` therefore builds the kernel alone for the concrete shapes first:

* for the chip of the mesh being traced (``target()``: the devices of the ``jax.set_mesh``
  context, abstract topology devices included, else this process's first device):
  ``jax.jit(fn).lower(*shapes).compile()`` by that chip's real compiler (XLA:TPU with Mosaic,
  XLA:GPU with Triton; ``pallas_kernels.targets`` compiles for chips this host lacks);
* otherwise (no compiler for that platform here, e.g. the lowering gate with
  ``backend_platform`` patched on a CPU-only host): ``jax.export`` lowering for that
  platform plus the block footprint estimates of ``pallas_kernels.lowering`` (TPU blocks x2
  <= 16 MiB, Triton loads and accumulators <= 227 KiB), a fallback only.

Verdicts are cached per (kernel, platform, device kind, shapes, options). A caller that traces its kernel
where an enclosing jit may split it over several devices (no mesh context, not inside
``shard_map``) passes ``auto_partition_problem(platform)`` as ``blocked``: Mosaic TPU refuses
automatic partitioning, an error that would otherwise surface only when the program lowers.
``choose_kernel`` turns the requested mode into a decision: ``"auto"`` uses the kernel only
on GPU/TPU and only where the verdict is good, otherwise warns once (naming kernel,
platform, shapes and reason) and returns False (use XLA); a forced kernel raises
``KernelUnavailable`` with that message.
(levanter's attention backend selection follows the same warn-or-raise pattern.)
Every ``"auto"`` fall-back to XLA is also handed to the :func:`recording_fallbacks` blocks
open in the tracing thread (each time, not once like the warning), so a compile report can
list them per program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pallas_kernels import lowering

ACCELERATORS = ("gpu", "tpu")
_VERDICTS: dict[tuple, str | None] = {}
_RECORDERS = threading.local()  # .logs: the lists of the recording_fallbacks blocks open here


class KernelUnavailable(RuntimeError):
    """A forced Pallas kernel cannot be built for this platform and these shapes."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What the program being traced is built for.

    platform: "cpu", "gpu" or "tpu"; device_kind: as its devices report it ("TPU v5 lite",
    "NVIDIA H100 80GB HBM3"); mesh: the concrete mesh of the ``jax.set_mesh`` context (its
    devices may be abstract topology devices), or None outside one."""

    platform: str
    device_kind: str
    mesh: Mesh | None = None


def _context_mesh() -> Mesh | None:
    from jax._src import mesh as mesh_lib

    try:
        mesh = mesh_lib.get_concrete_mesh()
    except Exception:  # noqa: BLE001 - no concrete mesh context in this jax
        return None
    return None if mesh is None or mesh.empty else mesh


def target() -> Target:
    """The platform and chip of the mesh being traced (``jax.set_mesh`` / the abstract mesh of
    an enclosing ``shard_map``), else of this process's first device - never
    ``jax.default_backend()`` alone, so a program built for abstract TPU or GPU devices on a
    CPU host decides its kernels for that chip."""
    mesh = _context_mesh()
    if mesh is not None:
        device = mesh.devices.flat[0]
        return Target(device.platform, device.device_kind, mesh)
    abstract_mesh = jax.sharding.get_abstract_mesh()
    device = getattr(abstract_mesh, "abstract_device", None)
    if not abstract_mesh.empty and device is not None and device.platform:
        return Target(device.platform, device.device_kind or "", None)
    device = jax.devices()[0]
    return Target(device.platform, device.device_kind, None)


def backend_platform() -> str:
    """The platform programs are being built for: "cpu", "gpu" or "tpu" (``target()``).

    The lowering gate patches this to build the programs another platform would run."""
    platform = target().platform
    return "gpu" if platform == "cuda" else platform


def target_chip() -> str | None:
    """The short name of the chip being built for ("v5e", "v5p", "v6e", "h100", "h200"), or
    None (CPU, or a chip outside ``pallas_kernels.targets.CHIPS``)."""
    from pallas_kernels import targets

    spec = targets.chip_for_device_kind(target().device_kind)
    return None if spec is None else spec.name


def _local_platforms() -> set[str]:
    return {d.platform for d in jax.devices()}


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype only (tracers and arrays alike; shardings are dropped)."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def describe(args) -> str:
    """'bfloat16[8192,4096], int32[8192]' for a pytree of arrays / ShapeDtypeStructs."""
    leaves = jax.tree.leaves(args)
    return ", ".join(f"{x.dtype}[{','.join(map(str, np.shape(x)))}]" for x in leaves)


def _check_footprints(fn, args, platform: str) -> str | None:
    for fp in lowering.pallas_footprints(fn, *args):
        if platform == "tpu" and fp.tpu_bytes > fp.tpu_budget:
            return (f"{fp.name} needs {fp.tpu_bytes / 2**20:.1f} MiB of double-buffered VMEM "
                    f"blocks (budget {fp.tpu_budget / 2**20:.0f} MiB)")
        if platform == "gpu" and fp.triton_bytes > lowering.GPU_SMEM_BUDGET:
            return (f"{fp.name} holds {fp.triton_bytes / 2**10:.0f} KiB per program (budget "
                    f"{lowering.GPU_SMEM_BUDGET / 2**10:.0f} KiB)")
    return None


def auto_partition_problem(platform: str) -> str | None:
    """The reason a kernel traced right here cannot run on ``platform``, if the enclosing jit
    may partition it automatically and the platform's kernels refuse that (Mosaic TPU)."""
    if platform == "tpu" and partition_context()[0] == "auto":
        return (f"Mosaic TPU kernels cannot be partitioned automatically over "
                f"{jax.device_count()} devices; call under jax.set_mesh(mesh) or inside "
                "jax.shard_map")
    return None


def _compile_for_target(fn: Callable, args, where: Target) -> str | None:
    """Compiles ``fn`` by the real compiler of ``where``'s chip (devices this host may lack):
    on the context mesh where one is set and the kernel is traced outside a shard_map (its
    caller's own shard_map names that mesh), else on one (abstract) device of the chip."""
    from pallas_kernels import targets

    spec = targets.chip_for_device_kind(where.device_kind)
    name = spec.name if spec else where.device_kind
    mesh = where.mesh
    if mesh is not None and partition_context()[0] == "manual":
        # Inside a shard_map over every axis the kernel sees its local shard: one device.
        mesh = Mesh(mesh.devices.flat[:1], ("_chip",))
    result = targets.compile_on(fn, args, name, mesh=mesh)
    return None if result.ok else result.error[:400]


def _compiler_for(where: Target) -> bool:
    """Whether this host can compile for ``where`` although it has no such devices: a context
    mesh of (abstract) accelerator devices, or a known chip whose compiler is installed."""
    if where.platform in ("cpu",) or where.platform in _local_platforms():
        return False
    if where.mesh is not None:
        return True
    from pallas_kernels import targets

    spec = targets.chip_for_device_kind(where.device_kind)
    return spec is not None and targets.available(spec.platform)


def _build(fn: Callable, args, platform: str) -> str | None:
    where = target()
    try:
        if backend_platform() == platform and _compiler_for(where):
            return _compile_for_target(fn, args, where)
        if platform in _local_platforms():
            jax.jit(fn).lower(*args).compile()
            return None
        too_big = _check_footprints(fn, args, platform)  # a trace: cheaper than a lowering
        if too_big:
            return too_big
        lowering.export_for(fn, *args, platform="cuda" if platform == "gpu" else platform)
        return None
    except Exception as err:  # noqa: BLE001 - any build failure is the verdict
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def kernel_verdict(kernel: str, fn: Callable, args, *, options: tuple = (),
                   platform: str | None = None) -> str | None:
    """None when ``fn(*args)`` builds and fits on ``platform``, else the reason (cached).

    fn: the kernel call alone, closed over its static options (also listed in ``options``
    for the cache key); args: arrays, tracers or ShapeDtypeStructs (only shapes are used)."""
    platform = platform or backend_platform()
    shapes = tuple(abstract(a) for a in args)
    where = target()
    mesh_key = None if where.mesh is None else (where.mesh.shape_tuple, where.mesh.devices.size)
    key = (kernel, platform, where.device_kind, mesh_key,
           tuple((s.shape, str(s.dtype)) for s in shapes), options)
    if key not in _VERDICTS:
        _VERDICTS[key] = _build(fn, shapes, platform)
    return _VERDICTS[key]


def unavailable_message(kernel: str, platform: str, args, reason: str) -> str:
    return (f"Pallas kernel {kernel} unavailable on {platform} for shapes ({describe(args)}): "
            f"{reason}")


_WARNED: set[tuple] = set()


def choose_kernel(kernel: str, mode: str, fn: Callable, args, *, options: tuple = (),
                  blocked: str | None = None) -> bool:
    """True to run the Pallas kernel, False for the XLA path.

    mode: "auto" (kernel on GPU/TPU where it builds, else XLA; one warning per kernel,
    platform and shapes when it does not), "pallas" (forced: raises KernelUnavailable when it
    does not build) or "xla". ``blocked``: a reason known without building (the verdict)."""
    if mode == "xla":
        return False
    platform = backend_platform()
    if mode == "auto" and platform not in ACCELERATORS:
        return False
    reason = blocked or kernel_verdict(kernel, fn, args, options=options, platform=platform)
    if reason is None:
        return True
    message = unavailable_message(kernel, platform, args, reason)
    if mode != "auto":
        raise KernelUnavailable(message)
    for log in getattr(_RECORDERS, "logs", ()):
        log.append({"kernel": kernel, "platform": platform, "shapes": describe(args),
                    "reason": reason})
    key = (kernel, platform, describe(args), options)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message + "; using XLA", RuntimeWarning, stacklevel=3)
    return False


@contextlib.contextmanager
def recording_fallbacks():
    """Yields a list that receives one dict {kernel, platform, shapes, reason} per ``"auto"``
    decision for XLA (:func:`choose_kernel`) traced in this thread while the block runs
    (nested blocks each receive it). A program whose trace jax has cached is not traced again,
    so a block around a second ``.lower()`` of the same function and shapes sees nothing."""
    logs = getattr(_RECORDERS, "logs", None)
    if logs is None:
        logs = _RECORDERS.logs = []
    log: list[dict] = []
    logs.append(log)
    try:
        yield log
    finally:  # by identity: an equal (e.g. empty) list of another block is not this one
        del logs[next(i for i, x in enumerate(logs) if x is log)]


def partition_context():
    """How a kernel traced here will be partitioned: ("manual", None) inside a shard_map over
    every mesh axis (the kernel sees local shards), ("mesh", abstract_mesh) under
    ``jax.set_mesh`` (a caller can wrap the kernel in its own shard_map), ("single", None)
    under a one-device mesh context or in a one-device process without one, else ("auto",
    None): an enclosing jit may split the kernel's operands over several devices, which Mosaic
    TPU kernels refuse to lower ("cannot be automatically partitioned") and Triton kernels
    lower replicated."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.are_all_axes_manual:
        return "manual", None
    if not mesh.empty and mesh.size == 1:
        return "single", None  # a one-device (role) mesh, whatever the host has
    if not mesh.empty:
        return "mesh", mesh
    if jax.device_count() == 1:
        return "single", None
    return "auto", None


def clear_cache() -> None:
    """Forgets verdicts and warnings (tests)."""
    _VERDICTS.clear()
    _WARNED.clear()
