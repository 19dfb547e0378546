"""The host kernels' guards (``embeddings.ffi_abi``, ``host_kernel.unavailable``): the FFI
header's layout checked at load, numba's threading layer started through its public API, a
fallback to XLA with one warning when either fails, and handlers that touch no buffer when a
call frame's structs are not the sizes they read."""

import ctypes
import warnings

import jax
import numba
import numpy as np
import pytest

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, ffi_abi, host_kernel, make_sparse_optimizer
from jaxflow.embeddings.step import make_train_step, step_backend
from jaxflow.mesh import make_mesh


@pytest.fixture
def fresh_verdict(monkeypatch):
    """A process whose host kernels have not been checked yet (restored afterwards)."""
    monkeypatch.setattr(host_kernel, "_verdict", [])


@pytest.fixture(scope="module")
def emb():
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    return ShardedEmbeddings([TableSpec("a", 20, 4, "row_wise", "sum")], mesh,
                             make_sparse_optimizer("sgd", 0.1), capacity=16)


def header_with(tmp_path, old: str, new: str) -> str:
    text = open(ffi_abi.header_path(), encoding="utf-8").read()
    assert old in text
    path = tmp_path / "c_api.h"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return str(path)


def test_installed_header_matches_the_offsets_the_handlers_read():
    assert ffi_abi.check_header() is None
    assert host_kernel.unavailable() is None  # header, threads and the jit probe all pass here


def test_header_checks_name_the_mismatch(tmp_path):
    major = header_with(tmp_path, "#define XLA_FFI_API_MAJOR 0", "#define XLA_FFI_API_MAJOR 1")
    assert ffi_abi.check_header(major).startswith("XLA FFI API major version 1 in ")
    moved = header_with(tmp_path, "  XLA_FFI_DataType dtype;\n  void* data;",
                        "  void* data;\n  XLA_FFI_DataType dtype;")
    reason = ffi_abi.check_header(moved)
    assert reason.startswith("XLA_FFI_Buffer in ") and "'data', 'dtype'" in reason
    assert "cannot read the XLA FFI header" in ffi_abi.check_header(str(tmp_path / "absent.h"))


def test_a_foreign_header_falls_back_to_xla_with_one_warning(tmp_path, monkeypatch, fresh_verdict, emb):
    path = header_with(tmp_path, "#define XLA_FFI_API_MAJOR 0", "#define XLA_FFI_API_MAJOR 1")
    monkeypatch.setattr(ffi_abi, "header_path", lambda: path)
    with pytest.warns(RuntimeWarning, match=r"^embedding host kernels disabled, the embedding steps run in "
                                            r"XLA: XLA FFI API major version 1 in "):
        assert "major version 1" in host_kernel.unavailable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once: no second warning
        assert step_backend(emb) == "xla"
        with pytest.raises(ValueError, match=r"^embedding step backend 'host_kernel' unavailable: XLA FFI API "
                                             r"major version 1 .*; valid: 'xla' or 'auto'$"):
            make_train_step(emb, lambda p, e, b: (0.0, {}), backend="host_kernel")


def test_a_threading_layer_that_does_not_start_falls_back(monkeypatch, fresh_verdict, emb):
    def broken():
        raise RuntimeError("no threading layer could be loaded")

    monkeypatch.setattr(numba, "get_num_threads", broken)
    with pytest.warns(RuntimeWarning, match="numba's threading layer did not start"):
        reason = host_kernel.unavailable()
    assert reason == "numba's threading layer did not start (RuntimeError: no threading layer could be loaded)"
    assert step_backend(emb) == "xla"


def pool_frame(table, keys, desc, out, buffer_size=48):
    """A hand-built XLA_FFI_CallFrame (execute stage) for the pool handler: (frame words,
    everything it points to, kept alive)."""
    keep = []

    def buffer(arr, dtype):
        dims = np.asarray(arr.shape, np.int64)
        words = np.asarray([buffer_size, 0, dtype, arr.ctypes.data, arr.ndim, dims.ctypes.data], np.int64)
        keep.extend((dims, words))
        return words.ctypes.data

    args = np.asarray([buffer(table, 11), buffer(keys, 4), buffer(desc, 4)], np.int64)
    rets = np.asarray([buffer(out, 11)], np.int64)
    kinds = np.ones(3, np.int32)
    frame = np.zeros(21, np.int64)  # 168 bytes
    frame[0], frame[4] = 168, 3
    frame[5], frame[7], frame[8], frame[9] = 40, 3, kinds.ctypes.data, args.ctypes.data
    frame[10], frame[12], frame[13], frame[14] = 40, 1, kinds.ctypes.data, rets.ctypes.data
    return frame, keep + [args, rets, kinds]


def test_handler_touches_no_buffer_when_a_struct_size_differs():
    assert host_kernel.unavailable() is None  # registers the handlers
    call = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(host_kernel._handlers[0].address)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((6, 3)).astype(np.float32)
    keys = np.asarray([1, 5, 5, 0], np.int32)
    desc, n_bags = host_kernel.bag_layout([(2, 2, False)])
    want = np.zeros((n_bags, 3), np.float32)
    host_kernel.pool_numpy(table, keys, desc, want)
    for size, expect in ((48, want), (56, None)):
        out = np.full((n_bags, 3), np.nan, np.float32)
        frame, keep = pool_frame(table, keys, desc, out, buffer_size=size)
        assert call(frame.ctypes.data) == 0 and keep
        if expect is None:
            assert np.isnan(out).all()  # a buffer struct of another size: nothing written
        else:
            np.testing.assert_array_equal(out, expect)
