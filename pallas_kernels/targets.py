"""Abstract TPU and GPU chips for deviceless ahead-of-time compilation (the compile gate).

On a host without the hardware, the real XLA:TPU compiler (Mosaic for Pallas) comes with libtpu
(``pip install "jax[tpu]==<jax>"``) and the real XLA:GPU compiler (Triton for Pallas) with the
CUDA PJRT plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at the jax version). Both give
abstract devices through ``jax.experimental.topologies.get_topology_desc``; programs lowered
with shardings on those devices ``.compile()`` for that chip, with its VMEM / shared-memory
checks and HBM planning, and nothing runs.

``CHIPS`` names the five chips the gate compiles for, each with the figures the roofline of
``--compile-only`` and the HBM checks use (peak dense bf16 FLOP/s, HBM bytes and bandwidth per
chip, on-chip memory per core). GPU chips are described by the XLA device specs kept beside this
file in ``gpu_specs/`` (the fields jaxlib 0.10 parses, from openxla/xla's
``xla/backends/gpu/target_config/specs``); H200 is sm_90 like H100, only HBM differs.

* ``available(platform)``: whether this process can compile for "tpu" / "gpu" (the compiler is
  installed); ``require(platform)`` raises ``CompilerMissing`` naming the install command.
* ``devices(chip, topology=None)``: the abstract devices of a topology ("v5p:4x4x4", or "1x1x8"
  GPUs); ``mesh(chip, shape, names, topology=None)`` a ``Mesh`` of them.
* ``compile_on(fn, args, chip)``: compile ``jax.jit(fn)`` for one device of ``chip`` (args are
  ShapeDtypeStructs; placed replicated on that device unless they carry a sharding) and return a
  ``CompileResult`` (ok, error text and kind, per-device memory, cost analysis).
* ``min_vmem_limit(fn, args, chip)`` / ``min_smem(fn, args, chip)``: the smallest scoped VMEM
  limit (TPU) or shared memory per block (GPU) with which a kernel compiles, searched by
  compiles: the compilers report no VMEM figure on success and only the first allocation's
  overrun on failure.

Environment: the CUDA plugin must be allowed to load without a GPU
(``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``; ``JAX_PLATFORMS=cpu``: the topologies need no backend), and
libtpu more than once per machine (``ALLOW_MULTIPLE_LIBTPU_LOAD=1``); ``compile_env()`` returns these, and the compile
tests and ``--compile-only`` set them before jax starts. The main test environment has neither
plugin (with them every jax process prints extra stderr lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

SPEC_DIR = pathlib.Path(__file__).with_name("gpu_specs")
MiB = 2**20
GiB = 2**30
INSTALL = {
    "tpu": 'pip install "jax[tpu]=={v}"',
    "gpu": "pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}",
}


class CompilerMissing(RuntimeError):
    """The compiler for a target platform is not installed in this environment."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator generation as the compiler and the roofline see it.

    name: short name ("v5e", "v5p", "v6e", "h100", "h200"); platform: "tpu" | "gpu";
    topology: the smallest topology the compiler accepts (TPU "v5e:2x2"; GPU "1x1x1");
    device_kind: what its devices report; hbm_bytes: HBM per chip; onchip_bytes: VMEM per
    TensorCore (TPU) or opt-in shared memory per block (GPU); peak_flops: dense bf16 FLOP/s per
    chip; hbm_bandwidth: bytes/s per chip; spec: GPU target-description file in ``gpu_specs``;
    source: where the figures come from."""

    name: str
    platform: str
    topology: str
    device_kind: str
    hbm_bytes: int
    onchip_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    spec: str | None = None
    source: str = ""


CHIPS: dict[str, Chip] = {
    c.name: c for c in (
        Chip("v5e", "tpu", "v5e:2x2", "TPU v5 lite", 16 * GiB, 128 * MiB, 197e12, 819e9,
             200e9, source="cloud.google.com/tpu/docs/v5e; VMEM: jax tpu_info"),
        Chip("v5p", "tpu", "v5p:2x2x1", "TPU v5", 95 * GiB, 64 * MiB, 459e12, 2765e9,
             600e9, source="cloud.google.com/tpu/docs/v5p; VMEM: jax tpu_info"),
        Chip("v6e", "tpu", "v6e:2x2", "TPU v6 lite", 32 * GiB, 128 * MiB, 918e12, 1640e9,
             448e9, source="cloud.google.com/tpu/docs/v6e; VMEM: jax tpu_info"),
        Chip("h100", "gpu", "1x1x1", "NVIDIA H100 80GB HBM3", 84_942_979_072, 232_448, 989e12,
             3.35e12, 450e9, spec="h100_sxm.txtpb",
             source="NVIDIA H100 SXM datasheet (dense bf16); XLA spec h100_sxm.txtpb"),
        Chip("h200", "gpu", "1x1x1", "NVIDIA H200 141GB HBM3e", 151_397_597_184, 232_448,
             989e12, 4.8e12, 450e9, spec="h200.txtpb",
             source="NVIDIA H200 datasheet (dense bf16); XLA spec h200.txtpb"),
    )
}
TPU_CHIPS = tuple(n for n, c in CHIPS.items() if c.platform == "tpu")
GPU_CHIPS = tuple(n for n, c in CHIPS.items() if c.platform == "gpu")


def chip(name: str) -> Chip:
    """The ``Chip`` named ``name``; ValueError naming the valid ones."""
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(f"unknown chip {name!r}; valid: {', '.join(CHIPS)}") from None


def chip_for_device_kind(kind: str) -> Chip | None:
    """The ``Chip`` whose devices report ``kind`` ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), or
    None for a device kind outside the table."""
    for c in CHIPS.values():
        if c.device_kind == kind:
            return c
    low = kind.lower()
    for c in CHIPS.values():  # e.g. "NVIDIA H100 SXM5 80GB" on real hardware
        if c.platform == "gpu" and c.name in low:
            return c
    return None


def compile_env() -> dict[str, str]:
    """Environment variables a process needs before jax starts to compile for both targets."""
    return {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1"}


def available(platform: str) -> bool:
    """Whether this environment has the compiler for ``platform`` ("tpu" or "gpu")."""
    modules = {"tpu": "libtpu", "gpu": "jax_plugins.xla_cuda12"}
    if platform not in modules:
        raise ValueError(f"platform {platform!r}; valid: tpu, gpu")
    try:
        return importlib.util.find_spec(modules[platform]) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def require(platform: str) -> None:
    """Raises ``CompilerMissing`` naming the install command when ``platform``'s compiler is
    not installed."""
    if not available(platform):
        raise CompilerMissing(
            f"no {platform.upper()} compiler in this environment; install it with: "
            f"{INSTALL[platform].format(v=jax.__version__)} (or pip install -e '.[aot]')")


@functools.cache
def _gpu_topology(spec_text: str, topology: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", topology_name="gpu",
                                        target_config=spec_text, topology=topology)


@functools.cache
def _tpu_topology(name: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def spec_text(name: str, *, smem_per_block: int | None = None) -> str:
    """The GPU chip's target description, optionally with another opt-in shared memory per
    block (for ``min_smem``)."""
    c = chip(name)
    if c.spec is None:
        raise ValueError(f"{name} is a {c.platform} chip: no GPU target description")
    text = (SPEC_DIR / c.spec).read_text()
    if smem_per_block is not None:
        text = re.sub(r"shared_memory_per_block_optin: \d+",
                      f"shared_memory_per_block_optin: {int(smem_per_block)}", text)
    return text


def devices(name: str, topology: str | None = None, *, smem_per_block: int | None = None):
    """Abstract devices of ``topology`` for chip ``name``: TPU topologies as libtpu names them
    after the chip ("2x2x1", "4x4x4"; or the full "v5p:4x4x4"), GPU ones as "1x1xN" (N GPUs)."""
    c = chip(name)
    require(c.platform)
    topology = topology or c.topology
    if c.platform == "tpu":
        full = topology if ":" in topology else f"{c.name}:{topology}"
        return list(_tpu_topology(full).devices)
    return list(_gpu_topology(spec_text(name, smem_per_block=smem_per_block),
                              topology).devices)


def mesh(name: str, shape: tuple[int, ...], axis_names: tuple[str, ...],
         topology: str | None = None) -> Mesh:
    """A ``Mesh`` of ``prod(shape)`` abstract devices of chip ``name`` (the first ones of
    ``topology``)."""
    import numpy as np

    devs = devices(name, topology)
    n = int(np.prod(shape))
    if n > len(devs):
        raise ValueError(f"mesh {shape} needs {n} devices; topology "
                         f"{topology or chip(name).topology} of {name} has {len(devs)}")
    return Mesh(np.asarray(devs[:n], dtype=object).reshape(shape), axis_names)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """What the compiler said of one program on one chip (bytes per device)."""

    chip: str
    ok: bool
    error: str = ""
    error_kind: str = ""  # "vmem", "smem", "hbm", "other" when not ok
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    hlo_text: str = dataclasses.field(default="", repr=False)

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs + temporaries, less donated (aliased) bytes."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def fits(self) -> bool:
        """Whether the program's per-device bytes fit the chip's HBM."""
        return self.ok and self.total_bytes <= chip(self.chip).hbm_bytes


def error_kind(text: str) -> str:
    """Classifies a compile error: "vmem" (Mosaic scoped VMEM), "smem" (Triton shared
    memory), "hbm" (XLA's HBM planning), else "other"."""
    if "ScopedVmemOom" in text or "vmem" in text.lower() and "exceed" in text.lower():
        return "vmem"
    if "Shared memory size limit exceeded" in text or "shared memory" in text.lower():
        return "smem"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "hbm"
    return "other"


def _placed(args, device_mesh: Mesh):
    def one(a):
        if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is not None:
            return a
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(device_mesh, P()))

    return jax.tree.map(one, args)


def compile_result(name: str, compiled, *, keep_hlo: bool = False) -> CompileResult:
    """A ``CompileResult`` from a ``jax.stages.Compiled`` for chip ``name``."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return CompileResult(
        name, True,
        argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(mem, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
        alias_bytes=int(getattr(mem, "alias_size_in_bytes", 0)),
        flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        hlo_text=compiled.as_text() if keep_hlo else "")


def _inside_trace() -> bool:
    from jax._src import core

    return not isinstance(core.trace_ctx.trace, core.EvalTrace)


def compile_on(fn: Callable, args: Any, name: str, *, mesh: Mesh | None = None,
               smem_per_block: int | None = None, keep_hlo: bool = False) -> CompileResult:
    """Compiles ``jax.jit(fn)(*args)`` for chip ``name`` and never raises for a compile failure.

    args: a tuple of ``jax.ShapeDtypeStruct`` (nothing is allocated); those without a sharding
    are placed replicated on ``mesh`` (default: one device of the chip's smallest topology).
    The trace runs under ``jax.set_mesh(mesh)``, so kernel dispatch sees the chip
    (``pallas_kernels.dispatch.target``). smem_per_block: GPU only, another opt-in shared
    memory per block in the target description (``min_smem``)."""
    if _inside_trace():
        # A kernel verdict taken while an enclosing program traces (inside its shard_map or
        # jit): jax's trace and mesh contexts are per thread, so compile from a fresh one.
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(compile_on, fn, args, name, mesh=mesh,
                               smem_per_block=smem_per_block, keep_hlo=keep_hlo).result()
    if mesh is None:
        mesh = Mesh(devices(name, smem_per_block=smem_per_block)[:1], ("_chip",))
    placed = _placed(args, mesh)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        with jax.set_mesh(mesh):
            compiled = jitted.lower(*placed).compile()
    except Exception as err:  # noqa: BLE001 - the compiler's refusal is the result
        text = str(err).strip()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        first = lines[0] if lines else type(err).__name__
        detail = lines[1] if len(lines) > 1 else ""
        return CompileResult(name, False, f"{type(err).__name__}: {first} {detail}"[:600],
                             error_kind(text))
    return compile_result(name, compiled, keep_hlo=keep_hlo)


@contextlib.contextmanager
def vmem_limit_override(limit: int):
    """Every TPU ``pallas_call`` traced inside gets ``vmem_limit_bytes=limit`` in its compiler
    params (trace caches cleared on entry and exit, so no program traced with another limit is
    reused): how ``min_vmem_limit`` asks the compiler about one kernel without changing it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    original = pl.pallas_call

    def patched(*args, compiler_params=None, **kwargs):
        if compiler_params is None:
            compiler_params = pltpu.CompilerParams(vmem_limit_bytes=int(limit))
        elif isinstance(compiler_params, pltpu.CompilerParams):
            compiler_params = dataclasses.replace(compiler_params, vmem_limit_bytes=int(limit))
        return original(*args, compiler_params=compiler_params, **kwargs)

    jax.clear_caches()
    pl.pallas_call = patched
    try:
        yield
    finally:
        pl.pallas_call = original
        jax.clear_caches()


_OVERRUN = re.compile(r"exceeded scoped vmem limit by ([0-9.]+)([KMG])")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30}


def min_vmem_limit(fn: Callable, args: tuple, name: str, *, lo: int = MiB,
                   hi: int | None = None, step: int = MiB) -> int | None:
    """Smallest ``vmem_limit_bytes`` (a multiple of ``step``) with which ``fn(*args)``'s Pallas
    calls compile on TPU chip ``name``; None when they fail even at ``hi`` (default the chip's
    VMEM per core). Every compile has each pallas_call's limit overridden
    (``vmem_limit_override``). A compile refused for scoped VMEM names only its first
    allocation's overrun ("exceeded scoped vmem limit by X"), so the search climbs from ``lo``
    by each overrun (rounded up to ``step``; 2-3 compiles for most kernels) and bisects
    between the last refusal and ``hi`` where a refusal names no overrun."""
    hi = hi or chip(name).onchip_bytes

    def attempt(limit):
        with vmem_limit_override(limit):
            return compile_on(fn, args, name)

    limit, refused = max(step, -(-lo // step) * step), 0
    for _ in range(16):
        if limit > hi:
            break
        result = attempt(limit)
        if result.ok:
            return limit
        if result.error_kind != "vmem":
            return None  # refused for something a larger limit cannot fix
        refused = limit
        m = _OVERRUN.search(result.error)
        if m is None:
            break
        over = float(m.group(1)) * _UNIT[m.group(2)]
        limit = refused + max(step, -(-int(over) // step) * step)
    if not attempt(hi).ok:
        return None
    lo_k, hi_k = refused // step, hi // step  # lo_k refused, hi_k compiles
    while hi_k - lo_k > 1:
        mid = (lo_k + hi_k) // 2
        if attempt(mid * step).ok:
            hi_k = mid
        else:
            lo_k = mid
    return hi_k * step


def min_smem(fn: Callable, args: tuple, name: str, *, lo: int = 16 * 2**10,
             step: int = 4 * 2**10) -> int | None:
    """Smallest opt-in shared memory per block (a multiple of ``step``) with which ``fn(*args)``
    compiles on GPU chip ``name``; None when it fails at the chip's own limit. Bisected over
    target descriptions that differ only in ``shared_memory_per_block_optin``."""
    hi = chip(name).onchip_bytes

    def ok(smem):
        return compile_on(fn, args, name, smem_per_block=smem).ok

    if not ok(hi):
        return None
    lo_k, hi_k = lo // step, -(-hi // step)
    if ok(lo_k * step):
        return lo_k * step
    while hi_k - lo_k > 1:
        mid = (lo_k + hi_k) // 2
        if ok(mid * step):
            hi_k = mid
        else:
            lo_k = mid
    return min(hi_k * step, hi)
