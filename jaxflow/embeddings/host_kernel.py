"""Compiled host kernels for the CPU embedding step: pooling straight from the table, and a
fused sparse update (dedup + per-row gradient accumulation + row-wise optimizer, in place).

FBGEMM's CPU table-batched embedding (TBE) pools bags straight from the table and fuses the
row-gradient accumulation with the optimizer's row update in one multithreaded kernel; this is
that design for XLA:CPU. Two numba kernels (``parallel=True``: threads over bags / over unique
rows), each behind an XLA FFI handler (a numba ``cfunc`` that reads the FFI call frame), called
inside ``jit`` with :func:`jax.ffi.ffi_call`:

* :func:`pool_from_table`  table f32[R, D], keys int32[N] -> pooled f32[NB, D]: every bag sums
  (or averages) its rows in id order, read from the table (no gathered [N, D] buffer).
* :func:`fused_update`  (table, accumulator) aliased in -> out (updated in place; with donated
  buffers XLA copies nothing): dedup of the keys by direct addressing (a row-indexed slot map,
  O(R + N), no sort; a sort where the table is much larger than the batch), a stable counting
  sort of the occurrences by row, then per unique row (threads): the row gradient summed in
  id order and the optimizer (SGD or row-wise Adagrad) applied to the row and its state.

Keys are a group's packed rows (``routing.table_keys``; ``SENTINEL`` = padding). The bags are
described by ``desc`` int32[T, 5]: per table ``(first key, bag length, first bag, bags, mean)``.
The sums run in the same order as the XLA step's (bag: ids in order; row gradient: occurrences
in batch order), so pooling is bit-identical to it and SGD is the float32 loop bit for bit; XLA
may contract ``row - lr * g`` into an FMA and vectorises Adagrad's ``mean(g^2)``, so updated rows
can differ from its in the last bit, see ``tests/test_embedding_host_kernel.py``.

The handlers read the FFI call frame by fixed offsets (``ffi_abi``): :func:`unavailable` checks
the installed header's layout, numba's threading layer and a probe call once per process, and
the handlers compare every ``struct_size``, dtype and rank on each call (touching no buffer on a
mismatch); where anything fails, the embedding steps run in XLA after one warning.
The ``numba`` kernels compile on first use (cached on disk).
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import jax
import jax.numpy as jnp
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from jaxflow.embeddings import ffi_abi

__all__ = ["KIND_ADAGRAD", "KIND_SGD", "bag_layout", "fused_update", "pool_from_table",
           "update_numpy", "pool_numpy", "unavailable"]

#: optimizer kinds the fused update applies
KIND_SGD, KIND_ADAGRAD = 0, 1
_SENTINEL = np.int32(np.iinfo(np.int32).max)
#: ids x dim below which a kernel runs on the calling thread (a parallel region costs more)
_PARALLEL_WORK = 1 << 18
_POOL_TARGET, _UPDATE_TARGET = "jaxflow_embedding_pool", "jaxflow_embedding_fused_update"


def bag_layout(tables: list[tuple[int, int, bool]]) -> tuple[np.ndarray, int]:
    """``desc`` int32[T, 5] and the number of bags for tables given as ``(bags, bag length,
    mean)`` whose keys are concatenated in that order (each table's ``[bags, L]`` flattened)."""
    rows, key, bag = [], 0, 0
    for n_bags, length, mean in tables:
        rows.append((key, length, bag, n_bags, int(mean)))
        key += n_bags * length
        bag += n_bags
    return np.asarray(rows, np.int32).reshape(-1, 5), bag


# ---- the kernels (plain numba on numpy arrays: also callable from Python, as the tests do) ----

def _pool(table, keys, desc, out):
    """:func:`pool_numpy`'s body (compiled twice: with threads over bags, and serial)."""
    rows, dim = table.shape
    for b in numba.prange(out.shape[0]):
        t = 0
        while t + 1 < desc.shape[0] and desc[t + 1, 2] <= b:
            t += 1
        length, j = desc[t, 1], b - desc[t, 2]
        start = desc[t, 0] + j * length
        for d in range(dim):
            out[b, d] = np.float32(0.0)
        count = 0
        for pos in range(length):
            k = keys[start + pos]
            if k >= 0 and k < rows:
                count += 1
                for d in range(dim):
                    out[b, d] += table[k, d]
        if desc[t, 4]:
            den = np.float32(max(count, 1))
            for d in range(dim):
                out[b, d] = out[b, d] / den


_pool_threads = numba.njit(parallel=True, nogil=True, cache=True)(_pool)
_pool_serial = numba.njit(nogil=True, cache=True)(_pool)


@numba.njit(nogil=True, cache=True)
def pool_numpy(table, keys, desc, out):
    """``out`` f32[NB, D] <- every bag's sum (mean where ``desc`` says so) of ``table[k]`` over
    its keys k (SENTINEL / out of range = padding), in id order; threads over bags for a
    large batch."""
    if keys.shape[0] * table.shape[1] >= _PARALLEL_WORK:
        _pool_threads(table, keys, desc, out)
    else:
        _pool_serial(table, keys, desc, out)


@numba.njit(nogil=True, cache=True)
def _dedup(keys, rows):
    """(unique keys ascending int32[U], slot of every key int32[N] (-1 = padding))."""
    n = keys.shape[0]
    inv = np.full(n, -1, np.int32)
    if rows <= 4 * n + 65536:  # direct addressing: a row-indexed slot map, no sort
        slot = np.full(rows, -1, np.int32)
        for i in range(n):
            k = keys[i]
            if k >= 0 and k < rows:
                slot[k] = 0
        uniq = np.empty(min(n, rows), np.int32)
        u = 0
        for k in range(rows):
            if slot[k] == 0:
                slot[k] = u
                uniq[u] = k
                u += 1
        for i in range(n):
            k = keys[i]
            if k >= 0 and k < rows:
                inv[i] = slot[k]
        return uniq[:u], inv
    valid = keys[(keys >= 0) & (keys < rows)]
    uniq = np.unique(valid).astype(np.int32)
    for i in range(n):
        k = keys[i]
        if k >= 0 and k < rows:
            inv[i] = np.searchsorted(uniq, k)
    return uniq, inv


def _apply_rows(table, accum, keys, desc, grad, hyper, config, stats):
    """:func:`update_numpy`'s body (compiled twice: with threads over rows, and serial)."""
    rows, dim = table.shape
    n = keys.shape[0]
    bag_of = np.empty(n, np.int32)
    den = np.ones(grad.shape[0], np.float32)
    use_den = np.zeros(grad.shape[0], np.bool_)
    for t in range(desc.shape[0]):
        start, length, base, n_bags, mean = desc[t, 0], desc[t, 1], desc[t, 2], desc[t, 3], desc[t, 4]
        for j in range(n_bags):
            count = 0
            for pos in range(length):
                i = start + j * length + pos
                bag_of[i] = base + j
                if keys[i] >= 0 and keys[i] < rows:
                    count += 1
            if mean:
                den[base + j] = np.float32(max(count, 1))
                use_den[base + j] = True
    uniq, inv = _dedup(keys, rows)
    u = uniq.shape[0]
    # stable counting sort of the occurrences by row: each row's ids in batch order
    first = np.zeros(u + 1, np.int64)
    for i in range(n):
        if inv[i] >= 0:
            first[inv[i] + 1] += 1
    for s in range(u):
        first[s + 1] += first[s]
    fill = first[:u].copy()
    occ = np.empty(first[u], np.int32)
    for i in range(n):
        s = inv[i]
        if s >= 0:
            occ[fill[s]] = i
            fill[s] += 1
    lr, eps = np.float32(hyper[0]), np.float32(hyper[1])
    kind = config[0]
    chunk = 256
    for c in numba.prange((u + chunk - 1) // chunk):
        g = np.empty(dim, np.float32)
        for s in range(c * chunk, min(u, (c + 1) * chunk)):
            k = uniq[s]
            for d in range(dim):
                g[d] = np.float32(0.0)
            for o in range(first[s], first[s + 1]):
                b = bag_of[occ[o]]
                if use_den[b]:
                    for d in range(dim):
                        g[d] += grad[b, d] / den[b]
                else:
                    for d in range(dim):
                        g[d] += grad[b, d]
            if kind == 1:  # row-wise Adagrad: acc += mean(g^2); row -= lr * g / (sqrt(acc) + eps)
                ss = np.float32(0.0)
                for d in range(dim):
                    ss += g[d] * g[d]
                a = accum[k] + ss / np.float32(dim)
                accum[k] = a
                scale = np.sqrt(a) + eps
                for d in range(dim):
                    table[k, d] = table[k, d] - (lr * g[d]) / scale
            else:  # SGD
                for d in range(dim):
                    table[k, d] = table[k, d] - lr * g[d]
    stats[0] = u
    stats[1] = 1 if u > config[1] else 0


_apply_threads = numba.njit(parallel=True, nogil=True, cache=True)(_apply_rows)
_apply_serial = numba.njit(nogil=True, cache=True)(_apply_rows)


@numba.njit(nogil=True, cache=True)
def update_numpy(table, accum, keys, desc, grad, hyper, config, stats):
    """In place: ``table[k]`` (and ``accum[k]``) for every distinct key k of ``keys``, from the
    bag cotangents ``grad`` f32[NB, D]. ``hyper`` f32[2] = (learning rate, eps); ``config``
    int32[2] = (KIND_SGD | KIND_ADAGRAD, capacity); ``stats`` int32[2] <- (distinct keys,
    1 if more than capacity). Threads over the unique rows for a large batch."""
    if keys.shape[0] * table.shape[1] >= _PARALLEL_WORK:
        _apply_threads(table, accum, keys, desc, grad, hyper, config, stats)
    else:
        _apply_serial(table, accum, keys, desc, grad, hyper, config, stats)


# ---- XLA FFI handlers: numba cfuncs reading the call frame (xla/ffi/api/c_api.h) ----------------

def _pointer_cast(nbtype, irtype):
    @intrinsic
    def cast(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], irtype.as_pointer())
        return types.CPointer(nbtype)(types.int64), codegen
    return cast


_i64p = _pointer_cast(types.int64, ir.IntType(64))
_i32p = _pointer_cast(types.int32, ir.IntType(32))
_f32p = _pointer_cast(types.float32, ir.FloatType())

# int64 word offsets (``ffi_abi.FIELDS``): XLA_FFI_CallFrame {struct_size, extension_start, api,
# ctx, stage, args {struct_size, ext, size, types, args}, rets {...}, ...}; XLA_FFI_Buffer
# {struct_size, ext, dtype, data, rank, dims}
_FRAME_EXT, _FRAME_STAGE, _FRAME_ARGS, _FRAME_RETS = 1, 4, 9, 14
_BUF_DTYPE, _BUF_DATA, _BUF_RANK, _BUF_DIMS = 2, 3, 4, 5
_STAGE_EXECUTE, _EXT_METADATA = 3, 1
_API_VERSION_STRUCT_SIZE, _API_MINOR = 28, 3
_FRAME_SIZE = ffi_abi.STRUCT_SIZES["XLA_FFI_CallFrame"]
_LIST_SIZE = ffi_abi.STRUCT_SIZES["XLA_FFI_Args"]  # XLA_FFI_Rets has the same layout
_BUFFER_SIZE = ffi_abi.STRUCT_SIZES["XLA_FFI_Buffer"]
_EXT_SIZE = ffi_abi.STRUCT_SIZES["XLA_FFI_Metadata_Extension"]
_BUFFER_KIND, _F32, _S32 = 1, 11, 4  # XLA_FFI_ArgType / RetType BUFFER, XLA_FFI_DataType codes
#: (dtype, rank) of every argument and result of the two handlers
_POOL_ARGS, _POOL_RETS = ((_F32, 2), (_S32, 1), (_S32, 2)), ((_F32, 2),)
_UPDATE_ARGS = ((_F32, 2), (_F32, 1), (_S32, 1), (_S32, 2), (_F32, 2), (_F32, 1), (_S32, 1))
_UPDATE_RETS = ((_F32, 2), (_F32, 1), (_S32, 1))


@numba.njit(nogil=True)
def _handle_metadata(ext):
    """Fills XLA_FFI_Metadata (api version 0.3, no traits) when XLA asks for it; 1 if it did."""
    e = numba.carray(_i64p(ext), 4)
    if e[0] != _EXT_SIZE or (e[1] & 0xFFFFFFFF) != _EXT_METADATA:
        return 0
    m = numba.carray(_i64p(e[3]), 6)
    m[1] = _API_VERSION_STRUCT_SIZE
    m[2] = 0
    m[3] = np.int64(_API_MINOR) << 32  # major 0 (low word), minor (high word)
    m[4] = 0  # traits
    m[5] = 0  # state type id: none
    return 1


@numba.njit(nogil=True)
def _buffers_fit(frame, list_at, specs):
    """Whether the frame's argument (``list_at`` 5) or result (10) list is ``len(specs)``
    buffers of the ``(dtype, rank)`` in ``specs``, every struct of the size this code reads."""
    if frame[list_at] != _LIST_SIZE or frame[list_at + 2] != len(specs):
        return False
    kinds = numba.carray(_i32p(frame[list_at + 3]), len(specs))
    ptrs = numba.carray(_i64p(frame[list_at + 4]), len(specs))
    for i in range(len(specs)):
        buf = numba.carray(_i64p(ptrs[i]), 6)
        if kinds[i] != _BUFFER_KIND or buf[0] != _BUFFER_SIZE:
            return False
        if (buf[_BUF_DTYPE] & 0xFFFFFFFF) != specs[i][0] or buf[_BUF_RANK] != specs[i][1]:
            return False
    return True


@numba.njit(nogil=True)
def _execute_frame(frame_address, arg_specs, ret_specs):
    """Whether the frame is an execute call whose structs and buffers have the sizes, dtypes and
    ranks the handler reads (False: metadata answered, another stage, or a layout this code
    does not know, and then no buffer may be touched)."""
    frame = numba.carray(_i64p(frame_address), 16)
    if frame[0] != _FRAME_SIZE:
        return False
    if frame[_FRAME_EXT] != 0 and _handle_metadata(frame[_FRAME_EXT]):
        return False
    if (frame[_FRAME_STAGE] & 0xFFFFFFFF) != _STAGE_EXECUTE:
        return False
    return _buffers_fit(frame, _FRAME_ARGS - 4, arg_specs) and _buffers_fit(frame, _FRAME_RETS - 4, ret_specs)


@numba.njit(nogil=True)
def _buffer(frame, which, i):
    """(data address, dims address) of argument / result ``i``."""
    ptrs = numba.carray(_i64p(frame[which]), i + 1)
    buf = numba.carray(_i64p(ptrs[i]), 6)
    return buf[_BUF_DATA], buf[_BUF_DIMS]


@numba.njit(nogil=True)
def _f32_2d(frame, which, i):
    data, dims = _buffer(frame, which, i)
    shape = numba.carray(_i64p(dims), 2)
    return numba.carray(_f32p(data), (shape[0], shape[1]))


@numba.njit(nogil=True)
def _1d(frame, which, i, ptr_of):
    data, dims = _buffer(frame, which, i)
    return numba.carray(ptr_of(data), numba.carray(_i64p(dims), 1)[0])


def _pool_handler(frame_address):
    """XLA FFI handler: :func:`pool_numpy` on the frame's buffers."""
    if not _execute_frame(frame_address, _POOL_ARGS, _POOL_RETS):
        return 0
    frame = numba.carray(_i64p(frame_address), 16)
    table = _f32_2d(frame, _FRAME_ARGS, 0)
    keys = _1d(frame, _FRAME_ARGS, 1, _i32p)
    d_data, d_dims = _buffer(frame, _FRAME_ARGS, 2)
    desc = numba.carray(_i32p(d_data), (numba.carray(_i64p(d_dims), 2)[0], 5))
    pool_numpy(table, keys, desc, _f32_2d(frame, _FRAME_RETS, 0))
    return 0


def _update_handler(frame_address):
    """XLA FFI handler: :func:`update_numpy` on the frame's buffers."""
    if not _execute_frame(frame_address, _UPDATE_ARGS, _UPDATE_RETS):
        return 0
    frame = numba.carray(_i64p(frame_address), 16)
    # results 0 and 1 alias arguments 0 and 1 (the table and accumulator): updated in place
    table = _f32_2d(frame, _FRAME_RETS, 0)
    accum = _1d(frame, _FRAME_RETS, 1, _f32p)
    keys = _1d(frame, _FRAME_ARGS, 2, _i32p)
    d_data, d_dims = _buffer(frame, _FRAME_ARGS, 3)
    desc = numba.carray(_i32p(d_data), (numba.carray(_i64p(d_dims), 2)[0], 5))
    grad = _f32_2d(frame, _FRAME_ARGS, 4)
    hyper = _1d(frame, _FRAME_ARGS, 5, _f32p)
    config = _1d(frame, _FRAME_ARGS, 6, _i32p)
    update_numpy(table, accum, keys, desc, grad, hyper, config, _1d(frame, _FRAME_RETS, 2, _i32p))
    return 0


_registered = False
_handlers: list = []
_lock = threading.Lock()
_verdict: list = []  # [why the kernels cannot run, or None], once checked
_verdict_lock = threading.Lock()


def _start_threads() -> None:
    """Starts numba's threading layer through its public API (``get_num_threads`` launches it):
    the parallel runtime's symbols (allocate_sched, ...) must be loaded before a cached cfunc
    that calls a parallel kernel is linked. Raises when no layer started."""
    numba.get_num_threads()
    numba.threading_layer()  # ValueError when no threading layer was started


def _register() -> None:
    """Registers both handlers with XLA:CPU once (PyCapsules of the cfuncs' addresses)."""
    global _registered
    with _lock:
        if _registered:
            return
        _start_threads()
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        for name, fn in ((_POOL_TARGET, _pool_handler), (_UPDATE_TARGET, _update_handler)):
            handler = numba.cfunc(types.int64(types.int64), nogil=True, cache=True)(fn)
            _handlers.append(handler)  # the address must outlive the registration
            jax.ffi.register_ffi_target(name, new(handler.address, b"xla._CUSTOM_CALL_TARGET", None),
                                        platform="cpu")
        _registered = True


def _probe() -> str | None:
    """Both ops once through ``jit`` on tiny inputs against the same kernels called on numpy
    (exact: the same code on the same values); why they differ, or None."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((7, 3)).astype(np.float32)
    accum = rng.random(7).astype(np.float32)
    keys = np.array([3, 1, 3, _SENTINEL, 6, 0, 1, 1], np.int32)
    desc, n_bags = bag_layout([(2, 2, False), (2, 2, True)])
    grad = rng.standard_normal((n_bags, 3)).astype(np.float32)
    want_pool = np.zeros((n_bags, 3), np.float32)
    pool_numpy(table, keys, desc, want_pool)
    want_table, want_accum, want_stats = table.copy(), accum.copy(), np.zeros(2, np.int32)
    update_numpy(want_table, want_accum, keys, desc, grad, np.array([0.1, 1e-8], np.float32),
                 np.array([KIND_ADAGRAD, 8], np.int32), want_stats)
    cpu = jax.local_devices(backend="cpu")[0]  # this process's own (a multi-process job's first is not)
    args = jax.device_put((table, accum, keys, grad), cpu)
    got_pool = jax.jit(lambda t, k: pool_from_table(t, k, desc, n_bags))(args[0], args[2])
    got = jax.jit(lambda t, a, k, g: fused_update(t, a, k, desc, g, KIND_ADAGRAD, 0.1, 1e-8, 8))(*args)
    for what, have, want in (("pooled bags", got_pool, want_pool), ("updated table", got[0], want_table),
                             ("accumulator", got[1], want_accum), ("stats", got[2], want_stats)):
        if not np.array_equal(np.asarray(have), want):
            return f"the FFI probe's {what} differ from the kernel's own (the call frame is not read as laid out)"
    return None


def _check() -> str | None:
    reason = ffi_abi.check_header()
    if reason is not None:
        return reason
    try:
        _start_threads()
    except Exception as e:  # noqa: BLE001 - any failure means: no threads, run in XLA
        return f"numba's threading layer did not start ({type(e).__name__}: {e})"
    try:
        _register()
        return _probe()
    except Exception as e:  # noqa: BLE001 - a handler that cannot be built or called: run in XLA
        return f"the FFI handlers failed to build or run ({type(e).__name__}: {e})"


def unavailable() -> str | None:
    """Why the host kernels cannot run in this process, or None when they can. Checked once
    (then cached): the installed XLA FFI header declares the call-frame layout the handlers
    read (``ffi_abi.check_header``), numba's threading layer starts, and both ops called
    through ``jit`` on a tiny probe return exactly what the kernels return on numpy. The
    first failure warns once (RuntimeWarning); the embedding steps then run in XLA."""
    with _verdict_lock:
        if not _verdict:
            reason = _check()
            if reason is not None:
                warnings.warn(f"embedding host kernels disabled, the embedding steps run in XLA: {reason}",
                              RuntimeWarning, stacklevel=2)
            _verdict.append(reason)
        return _verdict[0]


# ---- the JAX ops ------------------------------------------------------------------------------

def pool_from_table(table: jax.Array, keys: jax.Array, desc: np.ndarray, n_bags: int) -> jax.Array:
    """table f32[R, D], keys int32[N] (SENTINEL = padding), ``desc`` from :func:`bag_layout`
    -> pooled f32[n_bags, D] (sum or mean per bag, in id order). CPU only."""
    _register()
    out = jax.ShapeDtypeStruct((n_bags, table.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(_POOL_TARGET, out)(table, keys, jnp.asarray(desc, jnp.int32))


def fused_update(table: jax.Array, accum: jax.Array, keys: jax.Array, desc: np.ndarray,
                 grad: jax.Array, kind: int, learning_rate: float, eps: float, capacity: int):
    """(new table f32[R, D], new accumulator f32[R] (or the f32[1] placeholder for SGD), stats
    int32[2] = (distinct keys, overflow 0/1 against ``capacity``)); the table and accumulator
    are updated in place when their buffers are donated. ``grad`` f32[NB, D] is d loss /
    d pooled bag. CPU only."""
    _register()
    outs = (jax.ShapeDtypeStruct(table.shape, jnp.float32), jax.ShapeDtypeStruct(accum.shape, jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.int32))
    hyper = jnp.asarray([learning_rate, eps], jnp.float32)
    config = jnp.asarray([kind, capacity], jnp.int32)
    return jax.ffi.ffi_call(_UPDATE_TARGET, outs, input_output_aliases={0: 0, 1: 1})(
        table, accum, keys, jnp.asarray(desc, jnp.int32), grad, hyper, config)
