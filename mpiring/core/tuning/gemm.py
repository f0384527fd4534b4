"""The kernels' matrix products: NumPy's BLAS, or Intel MKL's when it is installed and chosen. No MPI.

    out = a @ b            gemm(a, b, out)
    out += a @ b           gemm(a, b, out, beta=1.0)

``a`` (B, m, k), ``b`` (B, k, n) and ``out`` (B, m, n) are batches of
matrices, views of the kernels' tiles: each may be transposed (a unit stride
on either of its last two axes), and ``out`` is written in place. With
``beta=1.0`` the product is added into ``out`` by the BLAS itself, with no
temporary and no second pass over it.

Backends (``MPIRING_GEMM`` or ``set_backend``; ``"auto"``, the default, takes
the tuning cache's choice, ``python -m mpiring bench tune``, else MKL when it is
installed and the CPU is Intel's, else NumPy's):

- ``numpy``: ``np.matmul`` (OpenBLAS in NumPy's wheels). Always there.
- ``mkl``: ``cblas_?gemm_batch_strided`` of Intel MKL's ``libmkl_rt``
  (``pip install mpiring[mkl]``), called through ctypes, sequential: one
  thread per rank. Faster than OpenBLAS on an Intel Xeon (docs/performance.md §10).
  Used only while BLAS runs one thread per process (``mpiring.core.tuning.threads``);
  other thread counts take NumPy's path.

The untuned rule: MKL's kernel was faster than OpenBLAS's on an Intel Xeon and
slower on both AMD EPYCs measured (docs/performance.md §10, §14, §17), so on any
CPU but Intel's "auto" without a cache keeps NumPy's and MKL's library is never loaded.

Whatever the backend, float32 and float64 give the same results up to the
order of the sums (rounding); other dtypes and operands MKL cannot take as
strided batches always go through NumPy.

MKL and torch in one process: ``libmkl_rt`` loads MKL's libraries into the
process's global symbol scope, and torch (which carries its own MKL, bound
lazily) then calls this MKL for every MKL function it had not called yet, and
takes one intra-op thread by default (torch asks MKL for its thread count, and
this MKL is sequential). Results agree to rounding either way, but which bits
a torch op gives then depends on what ran first. So MKL's library is loaded
only when it is the backend in use (``available`` only looks for its file).
"""

import ctypes
import functools

import numpy as np

from ..tiles import scratch
from .machine import Choice, cpu_vendor, mkl_library
from .threads import blas_threads

__all__ = ["gemm", "product", "backend", "set_backend", "using", "available", "mkl_library", "BACKENDS"]

BACKENDS = ("numpy", "mkl")
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


_errors = []  # what MKL's error handler reported during the last call


@ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
def _xerbla(name, number, length):
    """MKL's parameter-error handler: recorded here and raised by the caller, instead of printed and ignored."""
    _errors.append(f"parameter {number[0]} of {name[:length].decode(errors='replace')}")


@functools.cache
def _mkl():
    """MKL's batched GEMMs as ctypes functions, sequential; None when MKL is not installed or unusable."""
    path = mkl_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.MKL_Set_Threading_Layer(ctypes.c_int(1))  # MKL_THREADING_SEQUENTIAL: no thread pool of its own
        lib.mkl_set_xerbla(_xerbla)
    except (OSError, AttributeError):
        return None
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fns = {}
    for dtype, name, scalar in ((np.float32, "cblas_sgemm_batch_strided", ctypes.c_float),
                                (np.float64, "cblas_dgemm_batch_strided", ctypes.c_double)):
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = [i, i, i, i, i, i, scalar, p, i, ll, p, i, ll, scalar, p, i, ll, i]
        fn.restype = None
        fns[np.dtype(dtype)] = fn
    return fns


def available():
    """The backends this process can use. MKL's library is not loaded to answer (module docstring)."""
    loaded = _mkl.cache_info().currsize
    return [name for name in BACKENDS if name == "numpy" or (_mkl() is not None if loaded else mkl_library())]


def _untuned():
    """"auto" without a tuning cache: MKL on Intel CPUs where it is installed, else NumPy's (module docstring).

    Answered from MKL's file, as ``available``: resolving the backend (every call's checks do) loads nothing;
    ``product`` loads MKL when a kernel first asks for it, and takes NumPy's GEMMs if it will not load."""
    return "mkl" if cpu_vendor() == "GenuineIntel" and "mkl" in available() else "numpy"


_choice = Choice("gemm", "MPIRING_GEMM", BACKENDS, available,
                 lambda name: "gemm backend 'mkl' needs Intel MKL's libmkl_rt: pip install mpiring[mkl]", "gemm",
                 _untuned)
set_backend = _choice.set  # "numpy", "mkl" or "auto" (the tuning cache's choice) for this process
using = _choice.using  # ``set_backend(name)`` inside a ``with`` block, the choice before it restored after
backend = _choice.current  # the backend in use: chosen, or for "auto" the tuning cache's pick, else _untuned()


def _operand(x, itemsize):
    """(transpose flag, leading dimension, batch stride) of a (B, r, c) view for a row-major BLAS, or None."""
    _, r, c = x.shape
    s0, s1, s2 = (s // itemsize for s in x.strides)
    if s0 < 0 or any(s % itemsize for s in x.strides):
        return None
    if s2 == 1 or c == 1:
        ld = s1 if r > 1 else c
        return (_NO_TRANS, ld, s0) if ld >= max(c, 1) else None
    if s1 == 1 or r == 1:
        ld = s2 if c > 1 else r
        return (_TRANS, ld, s0) if ld >= max(r, 1) else None
    return None


def product():
    """The ``gemm`` to use now: MKL's when it is the backend and BLAS runs one thread per process, else NumPy's.

    Kernels ask once per call (the thread count is read from the BLAS, a few microseconds).
    """
    if backend() == "mkl" and blas_threads() == 1 and _mkl() is not None:
        return gemm_mkl
    return gemm


def gemm(a, b, out, beta=0.0):
    """``out = a @ b`` (``beta=0``) or ``out += a @ b`` (``beta=1``), batched over the first axis, in place."""
    if beta == 0:
        return np.matmul(a, b, out=out)
    out += np.matmul(a, b, out=scratch("gemm", out.shape, np.result_type(a, b)))  # a reused buffer, one add
    return out


def gemm_mkl(a, b, out, beta=0.0):
    """``gemm`` through MKL where the operands allow it (else NumPy's)."""
    return out if _mkl_gemm(a, b, out, beta) else gemm(a, b, out, beta)


def _mkl_gemm(a, b, out, beta):
    """MKL's batched GEMM if the operands allow it; False (nothing done) otherwise."""
    fn = _mkl().get(out.dtype)
    if fn is None or a.dtype != out.dtype or b.dtype != out.dtype:
        return False
    nb, m, n = out.shape
    k = a.shape[2]
    if a.shape != (nb, m, k) or b.shape != (nb, k, n):
        raise ValueError(f"gemm shapes differ: {a.shape} @ {b.shape} -> {out.shape}")
    if m == 0 or n == 0 or nb == 0:
        return True
    if k == 0:
        if beta == 0:
            out.fill(0)
        return True
    size = out.itemsize
    ops = [_operand(x, size) for x in (a, b, out)]
    if None in ops or ops[2][0] != _NO_TRANS:
        return False
    strides = []
    for x, (trans, ld, stride) in zip((a, b, out), ops):
        extent = ld * (x.shape[1] if trans == _NO_TRANS else x.shape[2])  # one stored matrix, as MKL checks it
        if nb > 1 and stride < extent:  # batches that overlap (a broadcast one): MKL refuses them
            return False
        strides.append(stride if nb > 1 else extent)
    (ta, lda, _), (tb, ldb, _), (_, ldc, _) = ops
    fn(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, strides[0], b.ctypes.data, ldb, strides[1],
       float(beta), out.ctypes.data, ldc, strides[2], nb)
    if _errors:  # MKL refused a parameter (its xerbla): nothing was computed, never a silent wrong result
        raise RuntimeError(f"MKL's GEMM refused its parameters: {_errors.pop()}; shapes {a.shape} @ {b.shape}")
    return True
