"""The kernels' GEMM backends (core.tuning.gemm): MKL's strided batches against np.matmul, and the kernels on each.

    python -m pytest -q tests/test_gemm.py

MKL's tests skip where it is not installed (``pip install mpiring[mkl]``;
run/test installs it on x86-64 Linux).
"""

import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from mpiring.core.kernels import attention_block, attention_block_backward
from mpiring.core.reference import reference_attention, reference_attention_backward
from mpiring.core.tiles import BlockRun
from mpiring.core.tuning import gemm, machine

from conftest import GEMM_BACKENDS, gemm_backend, sweep

needs_mkl = pytest.mark.skipif("mkl" not in GEMM_BACKENDS, reason="MKL not installed (pip install mpiring[mkl])")


def _views(rng, dtype, nb, m, k, n):
    """Operands as the kernels pass them: plain, transposed, sliced out of wider arrays, reversed."""
    a = rng.standard_normal((nb, m, k)).astype(dtype)
    b = rng.standard_normal((nb, k, n)).astype(dtype)
    wide_b = rng.standard_normal((nb, k, n + 7)).astype(dtype)[:, :, 3:3 + n]   # columns of a wider block
    bt = np.ascontiguousarray(rng.standard_normal((nb, n, k)).astype(dtype)).transpose(0, 2, 1)  # b given as b^T
    at = np.ascontiguousarray(rng.standard_normal((nb, k, m)).astype(dtype)).transpose(0, 2, 1)
    rev = rng.standard_normal((nb, m, k)).astype(dtype)[::-1]                    # negative batch stride
    bcast = np.broadcast_to(rng.standard_normal((1, k, n)).astype(dtype), (nb, k, n))  # batch stride 0
    return [(a, b), (a, wide_b), (a, bt), (at, b), (at, bt), (rev, b), (a, bcast)]


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nb, m, k, n", [(1, 1, 1, 1), (3, 5, 7, 2), (2, 17, 65, 33), (8, 64, 64, 65), (2, 1, 9, 4),
                                          (2, 6, 1, 1), (1, 0, 3, 4), (2, 3, 0, 4)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_mkl_matches_matmul(dtype, nb, m, k, n, beta):
    rng = np.random.default_rng(nb * 1000 + m * 100 + k * 10 + n)
    for a, b in _views(rng, dtype, nb, m, k, n):
        start = rng.standard_normal((nb, m, n)).astype(dtype)
        out = start.copy()
        gemm.gemm_mkl(a, b, out, beta)
        want = np.matmul(a.astype(np.float64), b.astype(np.float64)) + (start if beta else 0)
        assert np.allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-4 if dtype == np.float32
                           else 1e-11), (a.strides, b.strides)


@needs_mkl
def test_mkl_writes_into_views_and_leaves_the_rest():
    """``out`` a view of rows of a bigger array (as the kernels' accumulators): only those rows change."""
    rng = np.random.default_rng(5)
    big = rng.standard_normal((2, 10, 9)).astype(np.float32)
    keep = big.copy()
    a, b = rng.standard_normal((2, 4, 3)).astype(np.float32), rng.standard_normal((2, 3, 9)).astype(np.float32)
    gemm.gemm_mkl(a, b, big[:, 2:6], 1.0)
    assert np.allclose(big[:, 2:6], keep[:, 2:6] + a @ b, rtol=1e-5, atol=1e-5)
    assert np.array_equal(big[:, :2], keep[:, :2]) and np.array_equal(big[:, 6:], keep[:, 6:])


@needs_mkl
def test_mkl_falls_back_where_it_cannot():
    """Half floats, mixed dtypes and a transposed output go through NumPy, with the same answer."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 3, 5))
    for a_, b_, out in [(a.astype(np.float16), b.astype(np.float16), np.zeros((2, 4, 5), np.float16)),
                        (a.astype(np.float32), b, np.zeros((2, 4, 5))),
                        (a, b, np.zeros((2, 5, 4)).transpose(0, 2, 1))]:
        gemm.gemm_mkl(a_, b_, out, 0.0)
        assert np.allclose(out, a_ @ b_, rtol=1e-3, atol=1e-3)


def test_operand_strides():
    """Which views a row-major BLAS takes, and as what (transpose flag, leading dim, batch stride)."""
    x = np.zeros((3, 4, 5), np.float32)
    assert gemm._operand(x, 4) == (gemm._NO_TRANS, 5, 20)
    assert gemm._operand(x.transpose(0, 2, 1), 4) == (gemm._TRANS, 5, 20)
    assert gemm._operand(x[:, :, 1:4], 4) == (gemm._NO_TRANS, 5, 20)
    assert gemm._operand(x[:, ::2], 4) == (gemm._NO_TRANS, 10, 20)
    assert gemm._operand(x[:, :, ::2], 4) is None            # no unit stride
    assert gemm._operand(x[::-1], 4) is None                 # negative batch stride


def test_backend_choice(monkeypatch):
    assert "numpy" in gemm.available()
    with pytest.raises(ValueError, match="gemm backend must be one of"):
        gemm.set_backend("cublas")
    gemm.set_backend("numpy")
    try:
        assert gemm.backend() == "numpy" and gemm.product() is gemm.gemm
    finally:
        gemm.set_backend("auto")


def test_using_restores_the_choice():
    """``gemm.using`` chooses a backend for a block and gives back the one before it, after an error too."""
    before = gemm.backend()
    with gemm.using("numpy"):
        assert gemm.backend() == "numpy" and gemm.product() is gemm.gemm
    assert gemm.backend() == before
    with pytest.raises(KeyError), gemm.using("numpy"):
        raise KeyError
    assert gemm.backend() == before


@pytest.mark.parametrize("vendor, want", [("AuthenticAMD", "numpy"), ("GenuineIntel", "mkl"), ("", "numpy")])
def test_untuned_auto_takes_mkl_only_on_intel(monkeypatch, vendor, want):
    """Without a tuning cache "auto" keeps NumPy's GEMMs on any CPU but Intel's (MKL measured slower on AMD)."""
    if want == "mkl" and "mkl" not in GEMM_BACKENDS:
        want = "numpy"
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(machine, "cached_choice", lambda key: None)
    gemm.set_backend("auto")  # clears the cached answer
    try:
        assert gemm.backend() == want
    finally:
        monkeypatch.undo()
        gemm.set_backend("auto")


def _untuned_process(vendor, lines):
    """What ``lines`` print in a new interpreter with mpiring's GEMMs untuned on a CPU of ``vendor``; ``mkl()``
    there says whether MKL's library is loaded."""
    code = "\n".join(["import mpiring.core.tuning.gemm as g, mpiring.core.tuning.machine as m",
                      "from threadpoolctl import threadpool_limits",
                      "m.cached_choice = lambda key: None",
                      f"g.cpu_vendor = lambda: {vendor!r}",
                      "mkl = lambda: any('libmkl' in line for line in open('/proc/self/maps'))", *lines, ""])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_asking_what_is_available_loads_no_mkl():
    """``available`` and an untuned "auto" on a CPU that is not Intel's leave MKL's library unloaded: loaded, it
    would take over the MKL calls of a torch imported later (module docstring of mpiring.core.tuning.gemm)."""
    names, loaded = _untuned_process("AuthenticAMD", ["print(g.available(), g.backend(), g.product().__name__)",
                                                      "print(mkl())"])
    assert names == f"{GEMM_BACKENDS} numpy gemm" and loaded == "False", (names, loaded)


@needs_mkl
def test_resolving_the_backend_on_intel_loads_no_mkl_until_a_kernel_asks():
    """Every call's checks resolve the backend (``plans.checks.backend_problem``): on an Intel CPU that names MKL
    without loading it; the first ``product()`` with one BLAS thread loads it."""
    got = _untuned_process("GenuineIntel", ["print(g.backend(), mkl())", "with threadpool_limits(1, user_api='blas'):",
                                            "    print(g.product().__name__, mkl())"])
    assert got == ["mkl False", "gemm_mkl True"], got


@needs_mkl
def test_mkl_only_with_one_blas_thread():
    """MKL runs sequential: with more BLAS threads per process, the kernels keep NumPy's threaded GEMMs."""
    gemm.set_backend("mkl")
    try:
        with threadpool_limits(1, user_api="blas"):
            assert gemm.product() is gemm.gemm_mkl
        with threadpool_limits(2, user_api="blas"):
            assert gemm.product() is gemm.gemm
    finally:
        gemm.set_backend("auto")


# The kernels on each backend, across tile edges: tokens from 1 past two tiles, masks, GQA, both dtypes.
SIZES = [(1, 1), (5, 300), (255, 257), (513, 129), (700, 700)]
MASKS = ["none", "causal", "window", "ragged"]


def _mask(kind, sq, sk, rng):
    if kind == "none":
        return None, None
    rows = np.arange(sq)
    if kind == "causal":
        return np.zeros(sq, np.int64), np.minimum(rows * sk // max(sq, 1) + 1, sk)
    if kind == "window":
        hi = np.minimum(rows * sk // max(sq, 1) + 1, sk)
        return np.maximum(hi - 37, 0), hi
    lo = rng.integers(0, sk, sq)
    return lo, np.minimum(lo + rng.integers(0, sk, sq), sk)   # some rows see no key


@pytest.mark.parametrize(*sweep(backend=GEMM_BACKENDS, dtype=[np.float32, np.float64], sizes=SIZES, mask=MASKS,
                               tiles=[(None, None), (128, 64)], heads=[(2, 2), (4, 2)]))
def test_kernels_on_each_backend(backend, dtype, sizes, mask, tiles, heads):
    """Every pair of options meets in the quick suite (``sweep``); --full runs the whole product."""
    with gemm_backend(backend):
        _kernels_against_the_reference(dtype, *sizes, mask, tiles, *heads)


def _kernels_against_the_reference(dtype, sq, sk, mask, tiles, hq, hk):
    rng = np.random.default_rng(sq * 7 + sk + len(mask))
    d = 16
    q = rng.standard_normal((hq, sq, d)).astype(dtype)
    k = rng.standard_normal((hk, sk, d)).astype(dtype)
    v = rng.standard_normal((hk, sk, d)).astype(dtype)
    klo, khi = _mask(mask, sq, sk, rng)
    out, lse = attention_block(q, k, v, None, klo, khi, run=BlockRun(*tiles))
    ref_out, ref_lse = reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                           None, klo, khi)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    assert np.allclose(out, ref_out, rtol=tol, atol=tol)
    assert np.allclose(lse, ref_lse, rtol=tol, atol=tol)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = attention_block_backward(dout, q, k, v, out, lse, None, klo, khi,
                                     run=BlockRun(*tiles))
    want = reference_attention_backward(dout.astype(np.float64), q.astype(np.float64), k.astype(np.float64),
                                        v.astype(np.float64), None, klo, khi)
    gtol = 1e-4 if dtype == np.float32 else 1e-10
    for got, ref in zip(grads, want):
        assert np.allclose(got, ref, rtol=gtol, atol=gtol)


@needs_mkl
def test_single_matrices_with_any_batch_stride():
    """A batch of one whose batch stride NumPy leaves at 0 (``x[None]``), as the benchmark's limits pass them."""
    rng = np.random.default_rng(8)
    q, k = rng.standard_normal((64, 16)).astype(np.float32), rng.standard_normal((48, 16)).astype(np.float32)
    s = np.empty((64, 48), np.float32)
    gemm.gemm_mkl(q[None], k.T[None], s[None])
    assert np.allclose(s, q @ k.T, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_a_refused_call_raises(monkeypatch):
    """Should MKL refuse its parameters, the call raises: never a result that was not computed."""
    monkeypatch.setattr(gemm, "_operand", lambda x, size: (gemm._NO_TRANS, 0, 0))  # lda 0: invalid
    a = np.ones((1, 2, 2), np.float32)
    with pytest.raises(RuntimeError, match="MKL's GEMM refused its parameters"):
        gemm.gemm_mkl(a, a, np.empty_like(a))
