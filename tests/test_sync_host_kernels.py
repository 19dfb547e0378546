"""The compiled host diff (jaxflow.sync.host_kernels) == the numpy diff (bits.diff_bits)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxflow.sync import bits, host_kernels
from jaxflow.sync.diff import diff_tree


def test_kernel_in_use():
    assert host_kernels.available()  # numba is a dependency (pyproject)


def _pair(rng, n, density):
    a = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    b = a.copy()
    k = int(round(n * density))
    if k:
        idx = rng.choice(n, k, replace=False)
        b[idx] ^= rng.integers(1, 1 << 16, k, dtype=np.uint16)
    return a, b


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 15, 16, 17, 63, 1000, 65_539])
@pytest.mark.parametrize("density", [0.0, 0.003, 0.05])
def test_kernel_matches_numpy(n, density):
    rng = np.random.default_rng(n * 7 + int(density * 1000))
    a, b = _pair(rng, n, density)
    got = host_kernels.diff_bf16(a, b)
    want = bits.diff_bits(a, b)
    assert got is not None
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)


def test_every_element_of_a_word_and_the_tail():
    # each of the 4 lanes of a word, and the 1-3 elements past the last whole word
    for n in (8, 9, 10, 11):
        for i in range(n):
            a = np.zeros(n, np.uint16)
            b = a.copy()
            b[i] = 0x8000  # -0.0 vs +0.0: a bit-pattern change
            pos, old, new = host_kernels.diff_bf16(a, b)
            assert pos.tolist() == [i] and old.tolist() == [0] and new.tolist() == [0x8000]


def test_dense_change_falls_back_instead_of_overflowing():
    rng = np.random.default_rng(0)
    a, b = _pair(rng, 4096, 0.5)
    assert host_kernels.diff_bf16(a, b) is None  # > 1/16 changed: the caller's numpy path
    scratch = {}
    import ml_dtypes
    old = {"w": a.view(ml_dtypes.bfloat16)}
    new = {"w": b.view(ml_dtypes.bfloat16)}
    _, _, diffs = diff_tree(old, new, scratch=scratch)
    want = bits.diff_bits(a, b)
    assert np.array_equal(diffs[0].positions, want[0])
    assert np.array_equal(diffs[0].new_bits, want[2])


_PAYLOAD = (
    "import hashlib, numpy as np, ml_dtypes\n"
    "from jaxflow.sync import host_kernels, encoder\n"
    "rng = np.random.default_rng(3)\n"
    "a = rng.integers(0, 1 << 16, 70_001, dtype=np.uint16)\n"
    "b = a.copy(); b[rng.choice(a.size, 700, replace=False)] += 1\n"
    "bf = lambda x: {'w': x.view(ml_dtypes.bfloat16), 'v': x[:999].view(ml_dtypes.bfloat16)}\n"
    "p = encoder.encode(bf(a), bf(b), base_version=0, version=1)\n"
    "print(host_kernels.available(), hashlib.sha256(p.to_bytes()).hexdigest())\n")


def test_numpy_fallback_makes_the_same_payload():
    outs = []
    for mode in ("auto", "numpy"):
        env = dict(os.environ, JAXFLOW_HOST_KERNELS=mode, JAX_PLATFORMS="cpu")
        outs.append(subprocess.run([sys.executable, "-c", _PAYLOAD], env=env, text=True,
                                   capture_output=True, check=True).stdout.split())
    assert [o[0] for o in outs] == ["True", "False"]
    assert outs[0][1] == outs[1][1]


def _numpy_twin(fn, *args):
    """Runs ``fn`` with the compiled kernels switched off (the numpy path)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(host_kernels, "_kernels", lambda: None)
        return fn(*args)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 5000])
def test_rice_and_value_streams_match_numpy(n):
    from jaxflow.sync import entropy
    rng = np.random.default_rng(n)
    for b in (0, 1, 5, 8, 9, 16, 17, 25):
        gaps = rng.integers(0, (1 << b) * 3 + 1, n).astype(np.int64)
        assert host_kernels.rice_encode(gaps, b) == _numpy_twin(entropy.rice_encode, gaps, b)
    deltas = rng.integers(1, 1 << 16, n).astype(np.uint16)
    deltas[: n // 2] = rng.choice(np.array([1, 0xFFFF, 0x8000, 2], np.uint16), n // 2)
    meta, streams = entropy.deltas_encode(deltas, 3)
    meta_np, streams_np = _numpy_twin(entropy.deltas_encode, deltas, 3)
    assert meta == meta_np and streams == streams_np
    if n:
        with pytest.raises(ValueError, match="unchanged"):
            host_kernels.value_bits(np.zeros(n, np.uint16))


def test_digest_lanes_match_numpy():
    import ml_dtypes

    from jaxflow.sync import digest
    rng = np.random.default_rng(5)
    for dtype in (ml_dtypes.bfloat16, np.float32, np.int8, np.bool_, np.float64, ml_dtypes.int4):
        values = rng.standard_normal(70_001) * 3
        if not np.issubdtype(np.dtype(dtype), np.floating):  # no float -> int cast warnings
            values = np.round(values).clip(-7, 7)
        x = values.astype(dtype)
        assert np.array_equal(digest.host_lanes(x), _numpy_twin(digest.host_lanes, x))
    pos = np.sort(rng.choice(1 << 33, 4000, replace=False)).astype(np.int64)  # wraps mod 2**32
    old = rng.integers(0, 1 << 16, pos.size).astype(np.uint16)
    new = (old + 1).astype(np.uint16)
    assert np.array_equal(host_kernels.lanes_delta(pos, old, new),
                          _numpy_twin(digest.lanes_delta, pos, old, new))
    many = digest.lanes_deltas([pos, pos[:0], pos[:9]], [old, old[:0], old[:9]],
                               [new, new[:0], new[:9]])
    assert np.array_equal(many, _numpy_twin(digest.lanes_deltas, [pos, pos[:0], pos[:9]],
                                            [old, old[:0], old[:9]], [new, new[:0], new[:9]]))
