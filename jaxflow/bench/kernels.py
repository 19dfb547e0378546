"""Measuring one kernel case (``jaxflow.bench.kernel_cases``) against its reference: the
``bench_kernels`` experiment's harness.

Every case is a pair of functions on the same device arrays, ``kernel`` and ``reference``, each
returning its outputs and gradients. Each side is compiled alone (``jit(...).lower().compile()``,
temporary bytes from its ``memory_analysis()``) and run once; a side that fails to build or to
run (no lowering on this platform, out of memory) gets ``status = "unavailable: <reason>"`` and
the other side still runs. With both up: the max error (``max |a - b| / max(1, max |b|)`` over
all outputs; exact kernels count mismatching elements) against the case's tolerance, then
``pairs`` alternated (kernel, reference) timings after ``warmup`` more untimed calls each
(CONVENTIONS: median of per-pair ratios, side by side). Throughput: bytes read + written / time
for the memory-bound kernels (and as a fraction of ``copy_GBps``, an elementwise read + write
pass over ``copy_bytes`` timed in the same run), FLOP/s for the matmul ones, each from the model
in the row's ``throughput_model``; fused log-prob rows add ``kernel_temp_over_naive_logits``.

Tolerances (per dtype): fused log-probs f32 1e-5 / bf16 1e-2 (the kernel reorders the vocab
sums), embedding bag f32 1e-6 / bf16 1e-2, attention f32 1e-5 / bf16 2e-2 (online softmax in
blocks vs one softmax), sync kernels exact (0 mismatches).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.bench.kernel_cases import TOLERANCE, Case, on_accelerator, one_line

__all__ = ["alternate", "copy_bandwidth", "max_error", "run_case"]


def _block(tree) -> None:
    for x in jax.tree.leaves(tree):
        if hasattr(x, "block_until_ready"):
            x.block_until_ready()


def _build(fn: Callable, args: tuple) -> dict:
    """{"compiled", "temp_bytes", "out"} or {"status": "unavailable: ..."}; never raises."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - any build failure is a recorded verdict
        return {"status": f"unavailable: build failed: {one_line(e)}"}
    temp = None
    try:
        mem = compiled.memory_analysis()
        temp = None if mem is None else int(mem.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    try:
        out = compiled(*args)
        _block(out)
    except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED at run time
        return {"status": f"unavailable: run failed: {one_line(e)}", "temp_bytes": temp}
    return {"status": "ok", "compiled": compiled, "temp_bytes": temp, "out": out}


@jax.jit
def _device_error(a, b):
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.max(jnp.abs(a32 - b32)), jnp.max(jnp.abs(b32))


def _leaf_error(a, b, exact: bool) -> float:
    if a.shape != b.shape:
        raise ValueError(f"output shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if exact:
        if a.size < 2**24:
            return float(np.sum(np.asarray(a) != np.asarray(b)))
        return float(jax.jit(lambda x, y: jnp.sum(x != y))(a, b))
    if a.size < 2**24:  # small: on the host, no per-shape compilation
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        diff, scale = float(np.max(np.abs(a32 - b32))), float(np.max(np.abs(b32)))
    else:
        diff, scale = map(float, _device_error(a, b))
    return diff / max(1.0, scale)


def max_error(got, want, *, exact: bool) -> float:
    """Mismatching elements (``exact``) or max |a - b| / max(1, max |b|), over all leaves
    (the sum of mismatches, the max of errors)."""
    g, w = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(g) != len(w):
        raise ValueError(f"kernel returned {len(g)} outputs, reference {len(w)}")
    errs = [_leaf_error(a, b, exact) for a, b in zip(g, w)]
    return float(sum(errs)) if exact else max(errs, default=0.0)


def _time(fn, args) -> float:
    t0 = time.perf_counter()
    _block(fn(*args))
    return time.perf_counter() - t0


def alternate(kernel, reference, args, pairs: int, warmup: int) -> dict:
    """Median seconds of each side over ``pairs`` alternated pairs (order flips every pair) and
    the median per-pair ratio reference / kernel; either side may be None (timed alone)."""
    sides = {k: f for k, f in (("kernel", kernel), ("reference", reference)) if f is not None}
    for _ in range(warmup):
        for f in sides.values():
            _block(f(*args))
    times = {k: [] for k in sides}
    for i in range(pairs):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for k in order:
            times[k].append(_time(sides[k], args))
    out = {f"{k}_s": float(np.median(v)) for k, v in times.items()}
    if len(sides) == 2:
        r = np.asarray(times["reference"]) / np.asarray(times["kernel"])
        out["speedup_vs_reference"] = float(np.median(r))
        out["speedup_spread"] = [float(r.min()), float(r.max())]
    out["pairs"] = pairs
    return out


def run_case(case: Case, pairs: int, warmup: int, references: dict | None = None) -> dict:
    """The row of one case (never raises). ``references`` caches reference builds by
    ``case.reference_key`` (e.g. XLA attention, compared with every backend)."""
    tol = TOLERANCE[case.kernel][case.dtype]
    row: dict[str, Any] = {"kernel": case.kernel, "name": case.name, "shape": case.shape,
                           "dtype": case.dtype, "tolerance": tol,
                           "throughput_model": case.throughput_model,
                           "bytes_moved": case.bytes_moved, "flops": case.flops, **case.extra}
    if case.unavailable is not None or case.kernel_fn is None:
        k = {"status": case.unavailable or "unavailable"}
    else:
        k = _build(case.kernel_fn, case.args)
    if case.reference_fn is None:
        r = {"status": case.unavailable or "unavailable"}
    elif references is not None and case.reference_key is not None:
        if case.reference_key not in references:
            references[case.reference_key] = _build(case.reference_fn, case.args)
        r = dict(references[case.reference_key])
    else:
        r = _build(case.reference_fn, case.args)
    row.update(status=k["status"], reference_status=r["status"],
               kernel_temp_bytes=k.get("temp_bytes"), reference_temp_bytes=r.get("temp_bytes"))
    row["max_error"] = row["within_tolerance"] = None
    if k["status"] == "ok" and r["status"] == "ok":
        try:
            err = max_error(k["out"], r["out"], exact=case.exact)
            row["max_error"], row["within_tolerance"] = err, bool(err <= tol)
        except Exception as e:  # noqa: BLE001 - a mismatch in structure is a failed check
            row["status"] = f"error check failed: {one_line(e)}"
            row["within_tolerance"] = False
    k.pop("out", None), r.pop("out", None)
    if "compiled" in k or "compiled" in r:
        try:
            row.update(alternate(k.get("compiled"), r.get("compiled"), case.args, pairs, warmup))
        except Exception as e:  # noqa: BLE001
            row["timing_status"] = f"timing failed: {one_line(e)}"
    for side in ("kernel", "reference"):
        secs = row.get(f"{side}_s")
        if secs:
            if case.bytes_moved:
                row[f"{side}_GBps"] = case.bytes_moved / secs / 1e9
            if case.flops:
                row[f"{side}_TFLOPps"] = case.flops / secs / 1e12
    return row


def copy_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a jitted elementwise pass (read + write) over ``nbytes`` of f32 on the default
    device, median of ``repeats``: the memory-bandwidth yardstick of the throughput rows."""
    n = max(1, nbytes // 4)
    x = (jax.jit(lambda: jnp.ones((n,), jnp.float32))() if on_accelerator()
         else jnp.asarray(np.ones((n,), np.float32)))
    f = jax.jit(lambda x: x * 2.0).lower(x).compile()
    _block(f(x))
    times = [_time(f, (x,)) for _ in range(repeats)]
    return 2.0 * x.size * 4 / float(np.median(times))


def _reference_only(row: dict) -> bool:
    return row["status"] != "ok" or row["reference_status"] != "ok"
