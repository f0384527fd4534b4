"""Bad inputs: every rank raises the same ValueError, naming the offending rank and argument.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi tests/test_validation_mpi.py

Each case makes one rank (the last, ``b``) or every rank pass something wrong;
every rank catches the error, the texts are all-gathered, and all of them must
equal the expected text exactly. The communicator must still work afterwards.
"""

import numpy as np
import pytest

from mpiring import distributed_attention, distributed_attention_backward, ring_attention

pytestmark = pytest.mark.mpi


def _inputs(comm, heads=2, dim=8, per_rank=4, dtype=np.float64):
    rng = np.random.default_rng(comm.rank)
    return [rng.standard_normal((heads, per_rank, dim)).astype(dtype) for _ in range(3)]


def _all_ranks(P):
    return {1: "rank 0", 2: "ranks 0, 1"}.get(P, f"ranks 0-{P - 1}")  # three or more in a row: first-last


def _nan_q(q):
    q = q.copy()
    q[1, 3, 2] = np.nan
    return q


# (id, change made on the bad rank: (q, k, v, kwargs) -> (q, k, v, kwargs), expected text; b = bad rank)
# Cases marked "mismatch" only make sense with 2 or more ranks.
ONE_RANK_CASES = [
    ("q-not-array", lambda q, k, v, kw: (q.tolist(), k, v, kw), "rank {b}: q must be a NumPy array, got list"),
    ("int-dtype", lambda q, k, v, kw: (q, k.astype(np.int64), v, kw),
     "rank {b}: k must be float16, bfloat16, float32 or float64, got int64"),
    ("mixed-dtype", lambda q, k, v, kw: (q, k, v.astype(np.float32), kw),
     "rank {b}: q, k, v must share one dtype, got float64, float64, float32"),
    ("1-d", lambda q, k, v, kw: (q[0, 0], k, v, kw), "rank {b}: q must have shape (..., seq, dim), got (8,)"),
    ("kv-tokens", lambda q, k, v, kw: (q, k, v[:, :3], kw),
     "rank {b}: k and v must agree on all but the last axis, got (2, 4, 8) and (2, 3, 8)"),
    ("qk-head-dim", lambda q, k, v, kw: (q, k[..., :4], v[..., :4], kw),
     "rank {b}: q and k must have the same head dim, got 8 and 4"),
    ("local-tokens", lambda q, k, v, kw: (q[:, :3], k, v, kw),
     "rank {b}: q and k must hold the same local tokens, got 3 and 4"),
    ("gqa-heads", lambda q, k, v, kw: (np.concatenate([q, q[:1]]), k, v, kw),
     "rank {b}: q heads (3) must be a multiple of k/v heads (2)"),
    ("no-tokens", lambda q, k, v, kw: (q[:, :0], k[:, :0], v[:, :0], kw),
     "rank {b}: every rank needs at least one token and a positive head dim, got q (2, 0, 8), v (2, 0, 8)"),
    ("scale-nan", lambda q, k, v, kw: (q, k, v, dict(kw, scale=float("nan"))),
     "rank {b}: scale must be a finite positive number, got nan"),
    ("scale-str", lambda q, k, v, kw: (q, k, v, dict(kw, scale="0.5")),
     "rank {b}: scale must be a finite positive number, got '0.5'"),
    ("scale-negative", lambda q, k, v, kw: (q, k, v, dict(kw, scale=-1.0)),
     "rank {b}: scale must be a finite positive number, got -1.0"),
    ("nan-input", lambda q, k, v, kw: (_nan_q(q), k, v, dict(kw, check_finite=True)),
     "rank {b}: q has 1 NaN/Inf values, the first at index (1, 3, 2)"),
    ("inf-input", lambda q, k, v, kw: (q, k, np.full_like(v, np.inf), dict(kw, check_finite=True)),
     "rank {b}: v has 64 NaN/Inf values, the first at index (0, 0, 0)"),
    ("window", lambda q, k, v, kw: (q, k, v, dict(kw, window=(-3, 0))),
     "rank {b}: window left must be an integer >= 0, or -1/None for unbounded; got -3"),
    ("window-shape", lambda q, k, v, kw: (q, k, v, dict(kw, window=5)),
     "rank {b}: window must be a pair (left, right), got 5"),
    ("layout", lambda q, k, v, kw: (q, k, v, dict(kw, layout="spiral")),
     "rank {b}: layout must be one of contiguous, zigzag, striped; got 'spiral'"),
    ("mode", lambda q, k, v, kw: (q, k, v, dict(kw, mode="tree")),
     "rank {b}: mode must be one of ring, bidirectional, allgather, ulysses, double_ring, sparse; got 'tree'"),
    ("cu-float", lambda q, k, v, kw: (q, k, v, dict(kw, cu_seqlens=np.array([0.0, 2.5]))),
     "rank {b}: cu_seqlens must be a 1-D integer array [0, ..., seq_len], got array([0. , 2.5])"),
    ("timeout", lambda q, k, v, kw: (q, k, v, dict(kw, timeout=-1)),
     "rank {b}: timeout must be 'auto', a positive number of seconds, or None (wait forever); got -1"),
]

MISMATCH_CASES = [
    ("dtype", lambda q, k, v, kw: tuple(a.astype(np.float32) for a in (q, k, v)) + (kw,),
     "rank {b}: dtype 'float32' differs from rank 0's 'float64'"),
    ("heads", lambda q, k, v, kw: (q[:1], k[:1], v[:1], kw),
     "rank {b}: q shape (1, *, 8) differs from rank 0's (2, *, 8)"),
    ("gqa-kv-heads", lambda q, k, v, kw: (q, k[:1], v[:1], kw),
     "rank {b}: k shape (1, *, 8) differs from rank 0's (2, *, 8)"),
    ("v-dim", lambda q, k, v, kw: (q, k, v[..., :3], kw),
     "rank {b}: v shape (2, *, 3) differs from rank 0's (2, *, 8)"),
    ("scale", lambda q, k, v, kw: (q, k, v, dict(kw, scale=0.5)), "rank {b}: scale 0.5 differs from rank 0's None"),
    ("causal", lambda q, k, v, kw: (q, k, v, dict(kw, causal=True)),
     "rank {b}: causal True differs from rank 0's False"),
    ("layout", lambda q, k, v, kw: (q, k, v, dict(kw, layout="zigzag")),
     "rank {b}: layout 'zigzag' differs from rank 0's 'contiguous'"),
    ("mode", lambda q, k, v, kw: (q, k, v, dict(kw, mode="allgather")),
     "rank {b}: mode 'allgather' differs from rank 0's 'ring'"),
    ("window", lambda q, k, v, kw: (q, k, v, dict(kw, window=(2, None))),
     "rank {b}: window (2, -1) differs from rank 0's (-1, -1)"),
    ("cu_seqlens", lambda q, k, v, kw: (q, k, v, dict(kw, cu_seqlens=[0, 3, kw["cu_seqlens"][-1]])),
     "rank {b}: cu_seqlens [0, 3, {S}] differs from rank 0's [0, 1, {S}]"),
    ("timeout", lambda q, k, v, kw: (q, k, v, dict(kw, timeout=30)),
     "rank {b}: timeout 30 differs from rank 0's 'auto'"),
]


def _errors(comm, func, *args, **kwargs):
    """Run func on every rank; return the list of every rank's error text (None = no error)."""
    try:
        func(*args, **kwargs)
        text = None
    except ValueError as exc:
        text = str(exc)
    return comm.allgather(text)


def _still_works(comm):
    q, k, v = _inputs(comm)
    out, _ = ring_attention(q, k, v, comm)
    assert out.shape == q.shape


def _run_case(comm, change, expected, base):
    b = comm.size - 1
    q, k, v = _inputs(comm)
    kwargs = dict(base)
    if comm.rank == b:
        q, k, v, kwargs = change(q, k, v, kwargs)
    texts = _errors(comm, ring_attention, q, k, v, comm, **kwargs)
    assert texts == [expected.format(b=b, S=4 * comm.size)] * comm.size
    _still_works(comm)


@pytest.mark.parametrize("name,change,expected", ONE_RANK_CASES, ids=[c[0] for c in ONE_RANK_CASES])
def test_bad_input_on_one_rank(comm, name, change, expected):
    _run_case(comm, change, expected, {})


@pytest.mark.parametrize("name,change,expected", MISMATCH_CASES, ids=[c[0] for c in MISMATCH_CASES])
def test_ranks_passing_different_arguments(comm, name, change, expected):
    if comm.size < 2:
        pytest.skip("needs two ranks to differ")
    _run_case(comm, change, expected, dict(cu_seqlens=[0, 1, 4 * comm.size]))


@pytest.mark.parametrize("which", ["kernel", "gemm"])
def test_a_backend_one_rank_cannot_run_is_every_ranks_error(comm, monkeypatch, which):
    """A bad MPIRING_KERNEL (or MPIRING_GEMM) on one rank: the agreement reports it on every rank, and the
    backends are resolved there, before the ring, not in its first block where the others would wait."""
    from mpiring.core import backends
    from mpiring.core.tuning import gemm

    choice = {"kernel": backends._choice, "gemm": gemm._choice}[which]
    b = comm.size - 1
    if comm.rank == b:
        monkeypatch.setattr(choice, "choice", "blas")
        choice.current.cache_clear()
    q, k, v = _inputs(comm)
    try:
        texts = _errors(comm, ring_attention, q, k, v, comm)
    finally:
        monkeypatch.undo()
        choice.current.cache_clear()
    names = "('numpy', 'torch', 'auto')" if which == "kernel" else "('numpy', 'mkl', 'auto')"
    env = "MPIRING_KERNEL" if which == "kernel" else "MPIRING_GEMM"
    assert texts == [f"rank {b}: {which} backend must be one of {names}, not 'blas' ({env})"] * comm.size
    _still_works(comm)


def test_same_bad_input_everywhere_names_every_rank(comm):
    q, k, v = _inputs(comm)
    texts = _errors(comm, ring_attention, q, k, v, comm, layout="spiral", expected_size=comm.size)
    layouts = "layout must be one of contiguous, zigzag, striped; got 'spiral'"
    assert texts == [f"{_all_ranks(comm.size)}: {layouts}"] * comm.size
    texts = _errors(comm, ring_attention, q, k, v, comm, expected_size=comm.size + 1)
    msg = f"the communicator has {comm.size} ranks but expected_size={comm.size + 1}"
    assert texts == [f"{_all_ranks(comm.size)}: {msg}"] * comm.size
    _still_works(comm)


def test_plan_errors_are_identical_everywhere(comm):
    """Checks that need the total length run in make_plan, on the options every rank agreed on."""
    q, k, v = _inputs(comm)
    S = 4 * comm.size
    cases = [
        (dict(cu_seqlens=[0, 2, S + 1]),
         f"cu_seqlens must start at 0 and end at the total length {S}; got 0 .. {S + 1}"),
        (dict(cu_seqlens=[0, 3, 2, S]), "cu_seqlens must be non-decreasing"),
        (dict(cu_seqlens=[S]), "cu_seqlens must be a 1-D integer array [0, ..., seq_len] with at least 2 entries"),
    ]
    for kwargs, expected in cases:
        assert _errors(comm, ring_attention, q, k, v, comm, **kwargs) == [expected] * comm.size
    if comm.size > 1:  # 3 tokens on rank 0 and 4 elsewhere is not the contiguous split of 4P - 1
        q2 = q[:, :3] if comm.rank == 0 else q
        texts = _errors(comm, ring_attention, q2, q2, q2, comm)
        held = f"the contiguous layout of {4 * comm.size - 1} tokens over {comm.size} ranks gives this rank"
        assert len(set(texts)) == 1 and texts[0].startswith(f"rank 0: q holds 3 tokens, but {held} 4")
    _still_works(comm)


def test_equivalent_spellings_agree(comm):
    """A list and an int32 array for cu_seqlens, a list and a tuple for the window, are the same option."""
    q, k, v = _inputs(comm)
    S = 4 * comm.size
    cu = [0, 2, S] if comm.rank % 2 else np.array([0, 2, S], np.int32)
    window = [3, 1] if comm.rank % 2 else (np.int64(3), 1)
    out, _ = ring_attention(q, k, v, comm, cu_seqlens=cu, window=window, causal=np.bool_(True) if comm.rank else True)
    assert out.shape == q.shape


def test_distributed_attention_checks_root_arrays_and_every_rank_options(comm):
    rng = np.random.default_rng(0)
    S = 4 * comm.size
    Q = K = V = rng.standard_normal((2, S, 8)) if comm.rank == 0 else None
    texts = _errors(comm, distributed_attention, None if comm.rank == 0 else Q, K, V, comm)
    assert texts == ["root rank 0: Q must be a NumPy array on the root rank, got NoneType"] * comm.size
    Qs = Q[:, : comm.size - 1] if comm.rank == 0 else None
    if comm.size > 1:
        texts = _errors(comm, distributed_attention, Qs, Qs, Qs, comm)
        expected = f"root rank 0: sequence length {comm.size - 1} is shorter than the number of ranks {comm.size}"
        assert texts == [expected] * comm.size
        b = comm.size - 1
        texts = _errors(comm, distributed_attention, Q, K, V, comm, causal=comm.rank == b)
        assert texts == [f"rank {b}: causal True differs from rank 0's False"] * comm.size
        texts = _errors(comm, distributed_attention, Q, K, V, comm, window=(1, 1) if comm.rank == b else (-3, 0))
        assert texts == [f"{_all_ranks(b)}: window left must be an integer >= 0, or -1/None for unbounded; got -3"] \
            * comm.size
        texts = _errors(comm, distributed_attention, Q, K, V, comm, root=1 if comm.rank == b else 0)
        assert texts == [f"rank {b}: root 1 differs from rank 0's 0"] * comm.size
    texts = _errors(comm, distributed_attention, Q, K, V, comm, root=comm.size)
    msg = f"root must be a rank of the communicator, 0 .. {comm.size - 1}; got {comm.size}"
    assert texts == [f"{_all_ranks(comm.size)}: {msg}"] * comm.size
    bad = Q.copy() if comm.rank == 0 else None
    if comm.rank == 0:
        bad[0, 1, 0] = np.inf
    texts = _errors(comm, distributed_attention, bad, bad, bad, comm, check_finite=True)
    assert texts == ["root rank 0: q has 1 NaN/Inf values, the first at index (0, 1, 0)"] * comm.size
    out, _ = distributed_attention(Q, K, V, comm, expected_size=comm.size, check_finite=True, timeout=30)
    assert comm.rank != 0 or out.shape == Q.shape
    dout = np.ones_like(Q) if comm.rank == 0 else None  # the backward checks root's arrays too
    texts = _errors(comm, distributed_attention_backward, bad, bad, bad, dout, comm, check_finite=True)
    assert texts == ["root rank 0: q has 1 NaN/Inf values, the first at index (0, 1, 0)"] * comm.size
