"""Lowering and per-program footprints of Pallas kernels for TPU and GPU, checked on any host.

``export_for(fn, *args, platform="tpu" | "cuda")`` lowers ``jax.jit(fn)`` with ``jax.export``
(Mosaic TPU for tpu; Triton or Mosaic GPU for cuda, whichever the kernel's compiler_params
ask for). On a host without a TPU, Mosaic's checks that query the chip (rank-1 blocks) need a
declared device kind: the export runs under an abstract mesh whose device is
``TPU_DEVICE_KIND``.

``pallas_footprints(fn, *args)`` traces ``fn`` and returns, for every ``pallas_call`` in it
(custom_vjp, jit and shard_map bodies included), its grid, block shapes and bytes:

* ``tpu_bytes``: in + out + scratch blocks, each x2 (double buffering; scratch counted twice
  as a conservative bound), refs with ``memory_space=pl.ANY`` excluded (they stay in HBM).
  Budget ``TPU_VMEM_BUDGET`` (16 MiB, the compiler's default scoped VMEM limit on v5e / v5p).
  This is an estimate, and the real compiler disagrees with it: Mosaic's internal scratch
  and relayout copies are not counted (fused log-probs' forward estimated at 10.6 MiB needs
  16.55 MiB on v5p), and a kernel may raise its own ``vmem_limit_bytes`` up to the chip's VMEM
  (128 MiB v5e / v6e, 64 MiB v5p). Where a compiler is available the verdicts and the compile
  gate use the compiler (``pallas_kernels.targets``, ``tests/aot/``); these estimates are the
  fallback for hosts without libtpu / the CUDA plugin.
* ``triton_bytes``: what a Triton program holds at once. A Triton block is a pointer with
  offsets, not a copy, so blocks themselves cost nothing; the program holds the values it
  loads from refs, the values it stores, its loop carries and its dot results, from the
  equation that makes each until its last use (a liveness scan per scope); while a loop
  runs, the peak of its body is added. Sibling loops therefore never count together (flash
  attention's backward runs a dK/dV loop and then a dQ loop). Elementwise temporaries are
  left out (Triton fuses them into registers). Budget
  ``GPU_SMEM_BUDGET`` (227 KiB per block on H100/H200).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax._src.mesh import AbstractDevice, AbstractMesh

TPU_DEVICE_KIND = "TPU v5p"
TPU_VMEM_BUDGET = 16 * 2**20
GPU_SMEM_BUDGET = 227 * 2**10
PLATFORMS = ("tpu", "cuda")
_TRITON_CALL = "__gpu$xla.gpu.triton"
_MOSAIC_GPU_CALL = "mosaic_gpu_v2"


def _nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * jnp.dtype(dtype).itemsize


@contextlib.contextmanager
def declared_tpu(args: Any = ()):
    """An abstract mesh whose device kind is a real TPU, so Mosaic's chip queries answer.

    Its axes are those of the current abstract mesh (inside a shard_map body or under
    ``jax.set_mesh``), else of the first NamedSharding among ``args``, else one device."""
    device = AbstractDevice(TPU_DEVICE_KIND, 1, "tpu")
    current = jax.sharding.get_abstract_mesh()
    meshes = [getattr(getattr(a, "sharding", None), "mesh", None) for a in jax.tree.leaves(args)]
    meshes = [m for m in meshes if m is not None]
    if current is not None and not current.empty:
        mesh = current.update(abstract_device=device)
    elif meshes:
        mesh = meshes[0].abstract_mesh.update(abstract_device=device)
    else:
        mesh = AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def export_for(fn: Callable, *args: Any, platform: str, declare_device: bool = True):
    """``jax.export`` of ``jax.jit(fn)(*args)`` for ``platform`` ("tpu" or "cuda").

    ``args`` may be ``jax.ShapeDtypeStruct``s (with shardings for sharded programs). Raises
    whatever the lowering raises. ``declare_device=False`` skips the abstract TPU mesh (for
    programs whose arguments carry a concrete mesh of their own).
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}; valid: {', '.join(PLATFORMS)}")
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL),
              jax.export.DisabledSafetyCheck.custom_call(_MOSAIC_GPU_CALL)]
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    ctx = declared_tpu(args) if platform == "tpu" and declare_device else contextlib.nullcontext()
    with ctx:
        return jax.export.export(jitted, platforms=[platform], disabled_checks=checks)(*args)


@dataclasses.dataclass(frozen=True)
class KernelFootprint:
    """One pallas_call's grid and block bytes (see the module docstring)."""

    name: str
    grid: tuple[int, ...]
    blocks: tuple[tuple[str, tuple[int, ...], str, bool], ...]  # (role, shape, dtype, in_hbm)
    tpu_bytes: int
    triton_bytes: int
    vmem_limit_bytes: int | None = None  # the kernel's own scoped VMEM limit (TPU), if set

    @property
    def tpu_budget(self) -> int:
        """The VMEM the TPU estimate is held to: the kernel's own ``vmem_limit_bytes`` where it
        raises the limit, else ``TPU_VMEM_BUDGET`` (the compilers' default scoped limit)."""
        return self.vmem_limit_bytes or TPU_VMEM_BUDGET

    def blocks_text(self) -> str:
        parts = []
        for role, shape, dtype, in_hbm in self.blocks:
            where = " HBM" if in_hbm else ""
            parts.append(f"{role} {dtype}{list(shape)}{where}")
        return "; ".join(parts)


def _is_any(aval) -> bool:
    space = getattr(aval, "memory_space", None)
    return space is not None and "any" in str(space).lower()


def _sub_jaxprs(params):
    for v in params.values():
        items = v if isinstance(v, (tuple, list)) else (v,)
        for x in items:
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


_LOADS = ("get", "load", "masked_load")
_STORES = ("swap", "store", "masked_swap")
_HELD = (*_LOADS, "dot_general", "while", "scan")


def _body_values(jaxpr) -> int:
    """Peak bytes held by a kernel scope (see the module docstring): a linear liveness scan
    over its loads, stored values, loop carries and dot results, where an equation with
    nested scopes (a loop body) adds the largest of them while it runs."""
    eqns = jaxpr.eqns
    stored = {eqn.invars[1] for eqn in eqns
              if eqn.primitive.name in _STORES and len(eqn.invars) > 1}
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if hasattr(v, "aval") and not hasattr(v, "val"):  # a Var, not a Literal
                last_use[v] = i
    for v in jaxpr.outvars:
        if hasattr(v, "aval") and not hasattr(v, "val"):
            last_use[v] = len(eqns)
    live: dict = {}
    peak = 0
    for i, eqn in enumerate(eqns):
        held = eqn.primitive.name in _HELD
        outs = {v: _nbytes(v.aval.shape, v.aval.dtype) for v in eqn.outvars
                if hasattr(v.aval, "shape") and (held or v in stored)}
        nested = max((_body_values(sub) for sub in _sub_jaxprs(eqn.params)), default=0)
        peak = max(peak, sum(live.values()) + nested + sum(outs.values()))
        live.update(outs)
        for v in [v for v in live if last_use.get(v, -1) <= i]:
            del live[v]
    return peak


def _footprint(eqn) -> KernelFootprint:
    gm = eqn.params["grid_mapping"]
    blocks, tpu = [], 0
    n_in, n_out = gm.num_inputs, gm.num_outputs
    for k, bm in enumerate(gm.block_mappings):
        role = "in" if k < n_in else "out"
        aval = bm.block_aval
        shape = tuple(int(s) for s in bm.block_aval.shape)
        in_hbm = _is_any(bm.block_aval) or _is_any(getattr(bm, "ref_aval", None))
        blocks.append((role, shape, str(aval.dtype), in_hbm))
        if not in_hbm:
            tpu += 2 * _nbytes(shape, aval.dtype)
    assert len(blocks) == n_in + n_out
    for aval in gm.scratch_avals:
        inner = getattr(aval, "inner_aval", aval)
        shape = tuple(getattr(inner, "shape", ()))
        dtype = getattr(inner, "dtype", None)
        try:
            jnp.dtype(dtype)
        except TypeError:  # semaphores: no VMEM bytes
            continue
        in_hbm = _is_any(aval)
        blocks.append(("scratch", shape, str(dtype), in_hbm))
        if not in_hbm and hasattr(inner, "shape"):
            tpu += 2 * _nbytes(shape, dtype)
    kernel = eqn.params["jaxpr"]
    kernel = getattr(kernel, "jaxpr", kernel)
    triton = _body_values(kernel)
    name = eqn.params.get("name") or getattr(eqn.params.get("metadata"), "name", "")
    params = eqn.params.get("compiler_params")
    if isinstance(params, dict):  # older jax: {"mosaic_tpu": CompilerParams, ...}
        params = next(iter(params.values()), None)
    limit = getattr(params, "vmem_limit_bytes", None)
    return KernelFootprint(str(name or "pallas_call"), tuple(int(g) for g in gm.grid),
                           tuple(blocks), tpu, triton, int(limit) if limit else None)


def _walk(jaxpr, out: list) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(_footprint(eqn))
            continue
        for sub in _sub_jaxprs(eqn.params):
            _walk(sub, out)
        # custom_vjp / custom_jvp keep their callables in params; the fwd jaxpr is enough.


def pallas_footprints(fn: Callable, *args: Any) -> list[KernelFootprint]:
    """Footprints of every pallas_call traced by ``fn(*args)`` (args may be abstract)."""
    closed = jax.make_jaxpr(fn)(*args)
    out: list[KernelFootprint] = []
    _walk(closed.jaxpr, out)
    return out
