import collections
import contextlib
import itertools
import os

import numpy as np
import pytest

# tiles and GEMM backend from the code's defaults, not from a tuning cache on this machine (mpiring.core.tuning.tune)
os.environ.setdefault("MPIRING_TUNE_CACHE", "off")

from mpiring.core.backends import BACKENDS as _KERNELS
from mpiring.core.backends import available as _kernels_available
from mpiring.core.reference import definition_mask, dense_attention, dense_attention_backward
from mpiring.core.tuning.gemm import available as _gemm_available
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

    It shares no code with mpiring.plans.visibility or the plan, which it checks.
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


# The kernels' GEMM backends (mpiring.core.tuning.gemm): kernel test modules that say
# ``pytestmark = pytest.mark.usefixtures("each_gemm")`` run once per backend installed here.
# MKL's path is taken only while BLAS runs one thread per process, as under mpiexec: it gets that.
GEMM_BACKENDS = _gemm_available()


@contextlib.contextmanager
def gemm_backend(name):
    from threadpoolctl import threadpool_limits

    from mpiring.core.tuning import gemm

    gemm.set_backend(name)
    try:
        with threadpool_limits(1 if name == "mkl" else None, user_api="blas"):
            yield name
    finally:
        gemm.set_backend("auto")


@pytest.fixture(params=GEMM_BACKENDS)
def each_gemm(request):
    with gemm_backend(request.param):
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
    with backends.using(kernel), gemm_backend(gemm):
        yield kernel


# ---------------------------------------------------------------------------- the quick suite and --full
# ``run/test`` runs the quick suite; ``run/test --full`` (pytest's ``--full``) runs every case (docs/testing.md):
# - ``@pytest.mark.ranks(1, 2)``: an MPI test whose outcome does not depend on the number of ranks beyond those
#   runs only at those world sizes (unmarked tests run at every size: the serial stage, -n 2, 3 and 4);
# - the ``comm`` fixture's duplicate and COMM_SELF variants run at P = 2 only (at P = 1 all three are one rank);
# - ``sweep(...)``: a parametrized sweep keeps an all-pairs cover of its cases (every value of each option meets
#   every value of every other in some case); the rest, and tests marked ``full``, run only with --full;
# - a parametrized MPI test (unmarked by ``ranks``) runs every case at P = 2, and at P = 1, 3 and 4 a cover of
#   its cases in which every value of each parameter appears (``spread``): each value meets every size.


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every case: the long sweeps and every MPI test at every number of ranks")


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks(*sizes): an MPI test the quick suite runs only at these world sizes")
    config.addinivalue_line("markers", "full: a case only pytest --full (run/test --full) runs")


def _world_size(config):
    if not config.getoption("with_mpi", default=False):
        return 1
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def quick_skip(item, size):
    """Why the quick suite leaves ``item`` out at world size ``size``, or None."""
    if item.get_closest_marker("full"):
        return "full"
    ranks = item.get_closest_marker("ranks")
    if ranks and size not in ranks.args:
        return f"ranks{ranks.args}"
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("comm", "world") != "world" and size != 2:
        return "comm variant"
    return None


SPREAD_SIZES = (1, 3, 4)  # where a parametrized MPI test runs a cover of its cases; at P = 2 (and 8) every case


def _factors(item):
    """A test case's parameters as ``{(name, repr of its value)}``, the comm fixture's variant left out."""
    spec = getattr(item, "callspec", None)
    return {(name, repr(value)) for name, value in (spec.params.items() if spec else ()) if name != "comm"}


def spread(items, size):
    """The items the quick suite leaves out at world ``size`` of each parametrized MPI test: at P = 1, 3 and 4
    each test runs a greedy cover of its cases in which every value of every parameter appears at least once
    (each size starting from another case, so the sizes run different ones); P = 2 runs every case. Tests marked
    ``ranks`` or ``full`` keep their own rule. The same on every rank: the collection is."""
    if size not in SPREAD_SIZES:
        return []
    groups = collections.defaultdict(list)
    for item in items:
        if (item.get_closest_marker("mpi") and not item.get_closest_marker("ranks")
                and not item.get_closest_marker("full") and _factors(item)):
            params = item.callspec.params
            groups[item.path, item.cls, item.originalname, params.get("comm", "world")].append(item)
    left = []
    for group in groups.values():
        start = size * 7 % len(group)
        order = group[start:] + group[:start]
        need = set().union(*map(_factors, group))
        chosen = set()
        while need:
            best = max(order, key=lambda item: len(_factors(item) & need))  # ties: the first in order
            chosen.add(id(best))
            need -= _factors(best)
        left += [item for item in group if id(item) not in chosen]
    return left


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    size = _world_size(config)
    left = [item for item in items if quick_skip(item, size)]
    gone = set(map(id, left))
    left += spread([item for item in items if id(item) not in gone], size)
    if left:
        config.hook.pytest_deselected(items=left)
        gone = set(map(id, left))
        items[:] = [item for item in items if id(item) not in gone]


def _pairs(combo):
    return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}


def all_pairs(sizes):
    """Index tuples of a greedy all-pairs cover of factors of ``sizes`` values: every value of each factor meets
    every value of every other in at least one tuple (all values when there is one factor). Each step takes the
    tuple that covers most pairs still uncovered, among those the one of the values used least so far, then the
    first in order: the same cover on every rank and every run."""
    combos = list(itertools.product(*(range(n) for n in sizes)))
    if len(sizes) < 2:
        return set(combos)
    pairs = [_pairs(c) for c in combos]
    uncovered = set().union(*pairs)
    used = collections.Counter()
    chosen = set()
    while uncovered:
        best = min(range(len(combos)), key=lambda i: (-len(pairs[i] & uncovered),
                                                      sum(used[f, v] for f, v in enumerate(combos[i])), i))
        chosen.add(combos[best])
        used.update(enumerate(combos[best]))
        uncovered -= pairs[best]
    return chosen


def _case_id(value, name, index):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    if isinstance(value, tuple) and all(isinstance(x, (int, type(None))) for x in value):
        return "default" if all(x is None for x in value) else "x".join(map(str, value))
    return getattr(value, "__name__", f"{name}{index}")


def _cases(name, values):
    """``(id, value, marks)`` of a factor given as a list (values, or one-value ``pytest.param``s) or a dict
    ``{id: value}``."""
    if isinstance(values, dict):
        return [(ident, value, ()) for ident, value in values.items()]
    cases = []
    for i, v in enumerate(values):
        if isinstance(v, type(pytest.param(None))):
            cases.append((v.id or _case_id(v.values[0], name, i), v.values[0], tuple(v.marks)))
        else:
            cases.append((_case_id(v, name, i), v, ()))
    return cases


def sweep(**factors):
    """``(argnames, params)`` for ``pytest.mark.parametrize``: every combination of ``factors`` (lists of values or
    of one-value ``pytest.param``s, or dicts ``{id: value}``); those outside ``all_pairs`` are marked ``full``
    (run with --full only)."""
    names = list(factors)
    levels = [_cases(name, values) for name, values in factors.items()]
    keep = all_pairs([len(level) for level in levels])
    params = []
    for combo in itertools.product(*(range(len(level)) for level in levels)):
        case = [levels[f][i] for f, i in enumerate(combo)]
        marks = [m for _, _, ms in case for m in ms] + ([] if combo in keep else [pytest.mark.full])
        params.append(pytest.param(*(v for _, v, _ in case), id="-".join(i for i, _, _ in case), marks=marks))
    return ",".join(names), params
