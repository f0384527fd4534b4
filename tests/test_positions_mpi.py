"""Tokens anywhere: explicit positions, block-causal masks and queries against a longer K/V, through the real ring.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_positions_mpi.py

Every rank holds a random, uneven, unsorted share of the positions (whole
random chunks, or single tokens dealt anywhere); each result is checked in
the caller's row order against the dense float64 reference
(``mpiring.testing``, masks written from their definitions), forward and
backward, under every strategy (the ring modes, Ulysses, the double ring and
ring x Ulysses), and the bytes each rank sent against the byte model.
"""

import numpy as np
import pytest

from mpiring import MODES, ring_attention, ring_attention_backward
from mpiring.core.record import Record
from mpiring.cost.nodes import predicted_bytes
from mpiring.testing import assert_attention_close, reference, reference_backward

from conftest import GRAD_TOL

pytestmark = pytest.mark.mpi

STRATEGIES = MODES + ("ulysses", "double_ring", "grid")


def strategy(name, P):
    """The options of a strategy on P ranks: double ring nodes of 2 and a grid of 2 where P is even."""
    if name == "double_ring":
        return dict(mode="double_ring", node_size=2 if P % 2 == 0 else 1)
    if name == "grid":
        return dict(mode="bidirectional", ulysses_size=2 if P % 2 == 0 else 1)
    return dict(mode=name)


def heads(P):
    """Query and K/V heads that every strategy splits on P ranks, grouped-query (2 query heads per K/V head)."""
    return 2 * P, P


def random_partition(seq_len, size, rng, chunky):
    """``size`` non-empty, unsorted arrays that together hold 0 .. seq_len-1 once (the same on every rank).

    ``chunky``: whole runs of consecutive positions go to random ranks; else single tokens do.
    """
    if chunky:
        cuts = np.sort(rng.choice(np.arange(1, seq_len), min(seq_len - 1, 3 * size), replace=False))
        chunks = np.split(np.arange(seq_len), cuts)
        owner = np.concatenate([rng.permutation(size), rng.integers(0, size, len(chunks) - size)])
        parts = [np.concatenate([c for c, o in zip(chunks, owner) if o == r]) for r in range(size)]
    else:
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size - 1, replace=False))
        parts = np.split(rng.permutation(seq_len), cuts)
    return [rng.permutation(p) for p in parts]


def _masks(S):
    """(causal, window, cu_seqlens, causal_block): causal, window, documents, causal blocks and their mixes."""
    cu = np.array(sorted({0, S // 3, S // 2 + 1, S}))
    return [(True, None, None, None), (False, (3, 2), None, None), (False, None, cu, None),
            (True, None, None, 4), (True, (5, 0), None, 3), (True, None, cu, 5), (True, (6, 0), cu, 2)]


def _grad_tol(dtype):
    return GRAD_TOL[np.dtype(dtype).type]


def _check_grads(got, want, dtype, case):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = float(np.max(np.abs(g - w)) / max(1.0, float(np.max(np.abs(w)))))
        assert err <= _grad_tol(dtype), f"{name} error {err:.3e} ({case})"


def _run(comm, Q, K, V, dOut, q_parts, kv_parts, options, dtype, case, first=None):
    """This rank's rows (its positions, in their order) through the ring, checked against the full reference.

    ``first``: None when q, k, v hold the same tokens; else Q holds the queries
    at positions first, first + 1, ... of a longer K/V, passed as kv_positions.
    """
    rank = comm.rank
    mine_q, mine_kv = q_parts[rank], kv_parts[rank]
    rows = mine_q - (first or 0)  # this rank's rows of Q
    q, dout = (np.ascontiguousarray(a[..., rows, :].astype(dtype)) for a in (Q, dOut))
    k, v = (np.ascontiguousarray(a[..., mine_kv, :].astype(dtype)) for a in (K, V))
    positions = dict(positions=mine_q, **({} if first is None else {"kv_positions": mine_kv}))
    forward, backward = Record(rank), Record(rank)
    out, lse = ring_attention(q, k, v, comm, record=forward, **positions, **options)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, record=backward, **positions, **options)
    mask = {n: options.get(n) for n in ("causal", "window", "cu_seqlens", "causal_block")}
    all_q = np.arange(Q.shape[-2]) + (first or 0)
    out_ref, lse_ref = reference(Q, K, V, q_positions=all_q, **mask)
    grads_ref = reference_backward(dOut, Q, K, V, q_positions=all_q, **mask)
    assert_attention_close(out, out_ref[..., rows, :], dtype, f"out ({case})")
    assert_attention_close(lse, lse_ref[..., rows], dtype, f"lse ({case})")
    _check_grads(grads, (grads_ref[0][..., rows, :], grads_ref[1][..., mine_kv, :], grads_ref[2][..., mine_kv, :]),
                 dtype, case)
    # the bytes each rank sends are the byte model's, from the positions
    shape = dict(batch=q.shape[0], hq=q.shape[-3], hk=k.shape[-3], dim=q.shape[-1], dim_v=v.shape[-1],
                 itemsize=k.itemsize)
    assert forward.bytes_sent == predicted_bytes(forward.plan, **shape)[rank], case
    assert backward.bytes_sent == predicted_bytes(backward.plan, **shape, backward=True)[rank], case


@pytest.mark.parametrize("chunky", [True, False])
@pytest.mark.parametrize("mode", STRATEGIES)
def test_random_partitions_every_mask(comm, mode, chunky):
    """Random uneven unsorted positions, every mask, float64 to 1e-12 (gradients 1e-10), forward and backward."""
    P = comm.size
    hq, hk = heads(P)
    for i, (causal, window, cu, block) in enumerate(_masks(40)):
        rng = np.random.default_rng(100 * i + 7 * P + chunky)
        S = int(rng.integers(max(P, 9), 41))
        cu = None if cu is None else np.array(sorted({0, S // 3, S // 2 + 1, S}))
        Q, dOut = (rng.standard_normal((1, hq, S, 8)) for _ in range(2))
        K, V = (rng.standard_normal((1, hk, S, 8)) for _ in range(2))
        parts = random_partition(S, P, rng, chunky)
        options = dict(causal=causal, window=window, cu_seqlens=cu, causal_block=block, **strategy(mode, P))
        case = f"S={S} P={P} {mode} chunky={chunky} causal={causal} window={window} cu={cu} block={block}"
        _run(comm, Q, K, V, dOut, parts, parts, options, np.float64, case)


@pytest.mark.parametrize("mode", STRATEGIES)
def test_float32_positions(comm, mode):
    """float32 within 1e-5 (gradients 1e-4) with random positions and a block-causal window."""
    rng = np.random.default_rng(comm.size)
    S = 37
    Q, K, V, dOut = (rng.standard_normal((2, 2 * comm.size, S, 16)) for _ in range(4))
    parts = random_partition(S, comm.size, rng, True)
    options = dict(causal=True, window=(9, 0), causal_block=4, **strategy(mode, comm.size))
    _run(comm, Q, K, V, dOut, parts, parts, options, np.float32, f"float32 P={comm.size} {mode}")


@pytest.mark.parametrize("mode", STRATEGIES)
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, causal_block=3),
                                     dict(causal=True, window=(7, 0))])
def test_queries_against_a_longer_kv(comm, mode, options):
    """Chunked prefill: new tokens attend to every cached token and causally to each other; dK/dV of the cache too."""
    P = comm.size
    rng = np.random.default_rng(P + len(options))
    cached, new = 23, 3 * P + 2
    S = cached + new
    Q, dOut = (rng.standard_normal((1, 2 * P, new, 8)) for _ in range(2))
    K, V = (rng.standard_normal((1, 1, S, 8)) for _ in range(2))  # multi-query
    kv_parts = random_partition(S, P, rng, True)
    q_parts = [p + cached for p in random_partition(new, P, rng, False)]
    case = f"prefill P={P} {mode} {options}"
    _run(comm, Q, K, V, dOut, q_parts, kv_parts, dict(options, **strategy(mode, P)), np.float64, case, first=cached)


BAD = [
    ("a position held twice", lambda r, P, n: np.arange(n) * P + r if r else np.zeros(n, int), {}, "more than once"),
    ("out of range", lambda r, P, n: np.arange(n) * P + r + (r == P - 1) * 10 ** 6, {}, "outside 0 .."),
    ("wrong length", lambda r, P, n: np.arange(n + (r == 0)) * P + r, {}, "entries for the"),
    ("not integers", lambda r, P, n: (np.arange(n) * P + r).astype(float), {}, "1-D integer array"),
    ("causal_block without causal", lambda r, P, n: np.arange(n) * P + r, {"causal_block": 4}, "needs causal=True"),
]


@pytest.mark.parametrize("what, make, extra, message", BAD, ids=[b[0] for b in BAD])
def test_bad_positions_raise_the_same_error_on_every_rank(comm, what, make, extra, message):
    """Bad input on one rank (or all) raises the same ValueError on every rank, never a hang."""
    P, n = comm.size, 5
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, n, 4))
    positions = make(comm.rank, P, n)
    if P == 1 and what == "a position held twice":
        positions = np.array([0, 1, 2, 2, 3])
    with pytest.raises(ValueError, match=message) as info:
        ring_attention(q, q, q, comm, positions=positions, timeout=30, **extra)
    texts = comm.allgather(str(info.value))
    assert len(set(texts)) == 1, texts


def test_kv_positions_must_match_k_rows(comm):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 4))
    P, r = comm.size, comm.rank
    with pytest.raises(ValueError, match="kv_positions has 3 entries for the 4 rows of k and v"):
        ring_attention(q, k, k, comm, positions=np.arange(3) * P + r, kv_positions=np.arange(3) * P + r, timeout=30)
    with pytest.raises(ValueError, match="q and k must hold the same local tokens"):
        ring_attention(q, k, k, comm, positions=np.arange(3) * P + r, timeout=30)


@pytest.mark.mpi(min_size=2)
def test_positions_on_some_ranks_only(comm):
    """Every rank must pass positions, or none: the same ValueError everywhere otherwise."""
    P, r = comm.size, comm.rank
    q = np.random.default_rng(2).standard_normal((2, 3, 4))
    mine = np.arange(3) * P + r
    with pytest.raises(ValueError, match=f"rank {P - 1}: positions given differs from rank 0's None") as info:
        ring_attention(q, q, q, comm, positions=mine if r == P - 1 else None, layout="striped", timeout=30)
    assert len(set(comm.allgather(str(info.value)))) == 1
