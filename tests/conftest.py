import contextlib
import os

import numpy as np
import pytest

# tiles and GEMM backend from the code's defaults, not from a tuning cache on this machine (mpiring.core.tune)
os.environ.setdefault("MPIRING_TUNE_CACHE", "off")

from mpiring.core.backends import BACKENDS as _KERNELS
from mpiring.core.backends import available as _kernels_available
from mpiring.core.gemm import available as _gemm_available
from mpiring.core.reference import definition_mask, dense_attention, dense_attention_backward
from mpiring.testing import TOLERANCE

# agreement with the float64 single-process reference, per input dtype: outputs (mpiring.testing's
# table, which users of the kit get too), and gradients, absolute (the backward adds a recomputation
# and three more products per element)
TOL = {t: TOLERANCE[np.dtype(t)] for t in (np.float64, np.float32)}
GRAD_TOL = {np.float64: 1e-10, np.float32: 1e-4}


# (q shape, k/v shape or None for the same): 2-D, (batch, heads, seq, dim), grouped-query g = 2, multi-query g = 4
SHAPES = [((17, 8), None), ((2, 3, 33, 16), None), ((2, 4, 21, 8), (2, 2, 21, 8)), ((1, 4, 19, 8), (1, 1, 19, 8))]


def tol(dtype):
    return TOL[np.dtype(dtype).type]


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: reproducible, different per test."""
    return np.random.default_rng(_seed(request.node.name))


def _seed(name):
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 2**32


def qkv(rng, shape_q, shape_kv=None, dtype=np.float64, scale=1.0):
    """Random q, k, v with the given shapes (k and v share shape_kv)."""
    shape_kv = shape_kv or shape_q
    q = (rng.standard_normal(shape_q) * scale).astype(dtype)
    k = (rng.standard_normal(shape_kv) * scale).astype(dtype)
    v = rng.standard_normal(shape_kv).astype(dtype)
    return q, k, v


def dense_mask(seq_len, causal=False, window=None, cu_seqlens=None):
    """The one reference mask of the suite: boolean (S, S) from the definitions (``mpiring.core.reference``).

    It shares no code with mpiring.plans.masks or the plan, which it checks.
    """
    pos = np.arange(seq_len)
    return definition_mask(pos, pos, causal=causal, window=window, cu_seqlens=cu_seqlens)


def naive_attention(q, k, v, mask=None, scale=None):
    """The textbook softmax(scale q k^T) v in float64 under a dense boolean mask (rows that see nothing: 0)."""
    return dense_attention(q, k, v, scale, None if mask is None else lambda a, b: mask[a:b])[0]


def naive_attention_backward(dout, q, k, v, mask=None, scale=None):
    """Dense float64 gradients (dq, dk, dv) of ``naive_attention``, from the textbook formulas."""
    return dense_attention_backward(dout, q, k, v, scale, None if mask is None else lambda a, b: mask[a:b])


@pytest.fixture
def comm(request):
    """The world communicator (size 1 in the serial run, P under mpiexec -n P).

    A test may run over others too, as mpi4py's own tests do:
    ``@pytest.mark.parametrize("comm", COMMS, indirect=True)`` gives COMM_WORLD,
    a duplicate of it (freed after the test) and COMM_SELF (P = 1 on every rank).
    """
    from mpi4py import MPI

    kind = getattr(request, "param", "world")
    if kind == "dup":
        dup = MPI.COMM_WORLD.Dup()
        yield dup
        dup.Free()
    else:
        yield {"world": MPI.COMM_WORLD, "self": MPI.COMM_SELF}[kind]


COMMS = ["world", "dup", "self"]


def local(x, comm, layout="contiguous"):
    """This rank's contiguous shard of a full array."""
    from mpiring import shard

    return np.ascontiguousarray(shard(x, comm.size, comm.rank, layout))


# tests of the torch kernel backend (and of what runs on it) skip where torch is not installed
needs_torch = pytest.mark.skipif("torch" not in _kernels_available(), reason="torch with its CPU attention ops is "
                                                                            "not installed here")


# The kernels' GEMM backends (mpiring.core.gemm): kernel test modules that say
# ``pytestmark = pytest.mark.usefixtures("each_gemm")`` run once per backend installed here.
# MKL's path is taken only while BLAS runs one thread per process, as under mpiexec: it gets that.
GEMM_BACKENDS = _gemm_available()


@contextlib.contextmanager
def _gemm_backend(name):
    from threadpoolctl import threadpool_limits

    from mpiring.core import gemm

    gemm.set_backend(name)
    try:
        with threadpool_limits(1 if name == "mkl" else None, user_api="blas"):
            yield name
    finally:
        gemm.set_backend("auto")


@pytest.fixture(params=GEMM_BACKENDS)
def each_gemm(request):
    with _gemm_backend(request.param):
        yield request.param


# The block kernel's backends (mpiring.core.backends) with the GEMM backends: kernel test modules that say
# ``pytestmark = pytest.mark.usefixtures("each_kernel")`` run with the NumPy kernel once per GEMM backend
# (as ``each_gemm``) and once with each other kernel backend; torch's is skipped, with the reason, where
# torch is not installed.
KERNEL_BACKENDS = [pytest.param(("numpy", g), id=g) for g in GEMM_BACKENDS] + [
    pytest.param((name, "numpy"), id=name, marks=pytest.mark.skipif(
        name not in _kernels_available(), reason=f"kernel backend {name!r}: torch is not installed here"))
    for name in _KERNELS if name != "numpy"]


@pytest.fixture(params=KERNEL_BACKENDS)
def each_kernel(request):
    from mpiring.core import backends

    kernel, gemm = request.param
    with backends.using(kernel), _gemm_backend(gemm):
        yield kernel
