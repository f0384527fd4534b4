"""Coded wires in every mode: the ring modes, sparse, Ulysses, the double ring, the ring x Ulysses grid, pass-Q.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_wires_modes_mpi.py

``wire_dtype`` (half, int8, FP8) codes what travels between ranks that a ring would send coded:
K/V round the rings, all-gathered, sent where the sparse movement needs them,
in Ulysses' all-to-all, in the double ring's two rings, in the grid's
all-to-all and its ring across the groups; under pass-Q the query blocks. The
backward's dK/dV (Ulysses, the grid: dq, dK, dV on their way back) travel in
``grad_wire_dtype``. Every rank draws the whole problem from one seed, keeps
its shard (``shard_indices``) and checks its rows against the float64
reference with the wire's tolerance (``mpiring.testing.TOLERANCE``; pass-Q's
gradients twice it: its forward coded the queries, its backward the K/V), its bytes
against the prediction, and that what a rank holds itself is never coded: at
P = 1 a coded wire changes nothing, and rows that see only their own rank's
keys come out bit for bit as without a wire. P is the world size.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpiring import Record, ring_attention, ring_attention_backward, shard_indices
from mpiring.cost.nodes import predicted_bytes
from mpiring.parallel.passq import plan_bytes, rank_bytes
from mpiring.plans.heads import deal_heads
from mpiring.testing import assert_attention_close, reference, reference_backward

from conftest import sweep

pytestmark = pytest.mark.mpi

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

NEEDS_ML_DTYPES = pytest.mark.skipif(ml_dtypes is None, reason='needs ml_dtypes: pip install -e ".[half]"')
WIRES = ["float16", pytest.param("bfloat16", marks=NEEDS_ML_DTYPES), "int8",
         *(pytest.param(name, marks=NEEDS_ML_DTYPES) for name in ("float8_e4m3", "float8_e5m2"))]
MODES = ["ring", "bidirectional", "allgather", "sparse", "ulysses", "double_ring", "grid", "passq"]
DIM, DIM_V, BATCH = 8, 6, 2


def _mode(mode, P):
    """``(options, layout, S)`` of ``mode`` on P ranks.

    The grid (ulysses_size) deals its own shards today; with the contiguous layout and S divisible
    by P they are the tokens ``shard_indices`` gives, whichever definition holds (the grid is being
    changed to hold ``shard_indices``' tokens under every layout): so only that layout here.
    """
    if mode == "grid":
        return dict(ulysses_size=2 if P % 2 == 0 else 1), "contiguous", 8 * P
    options = {"ulysses": dict(mode="ulysses"), "passq": dict(rotate="q"),
               "double_ring": dict(mode="double_ring", node_size=2 if P % 2 == 0 else P)}.get(mode, dict(mode=mode))
    return options, "zigzag", 8 * P + 3


def _heads(P, gqa):
    """Query and K/V heads: P + P // 2 query heads (not divisible by P from P = 2: Ulysses deals them unevenly),
    and with ``gqa`` half as many K/V heads (fewer than P from P = 3), or one."""
    hq = max(2, P + P // 2)
    return hq, (hq // 2 if hq % 2 == 0 else 1) if gqa else hq


def _full(seed, S, hq, hk, dtype):
    """q, k, v, dout of the whole sequence from one seed: the same on every rank."""
    rng = np.random.default_rng(seed)
    shapes = [(BATCH, hq, S, DIM), (BATCH, hk, S, DIM), (BATCH, hk, S, DIM_V), (BATCH, hq, S, DIM_V)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _rows(x, positions, axis=-2):
    return np.ascontiguousarray(np.take(x, positions, axis=axis))


def _run(comm, q, k, v, do, options, **more):
    """Forward and backward of ``options`` (pass-Q: its backward is the K/V ring's, on the same wire)."""
    fwd, bwd = Record(), Record()
    out, lse = ring_attention(q, k, v, comm, record=fwd, **options, **more)
    back = {name: value for name, value in options.items() if name != "rotate"}
    grads = ring_attention_backward(do, q, k, v, out, lse, comm, record=bwd, **back, **more)
    return (out, lse, *grads), fwd, bwd


def _predicted(fwd, bwd, mode, hq, hk, dtype, wire, rank):
    """The bytes this rank sends forward and backward, K/V (pass-Q: the queries) on ``wire``."""
    shape = dict(batch=BATCH, hq=hq, hk=hk, dim=DIM, dim_v=DIM_V, itemsize=np.dtype(dtype).itemsize,
                 wire_dtype=wire)
    backward = predicted_bytes(bwd.plan, **shape, backward=True)[rank]
    if mode == "passq":
        return rank_bytes(fwd.plan, BATCH * hq, hq // hk, DIM, DIM_V, shape["itemsize"], wire)["q"][rank], backward
    return predicted_bytes(fwd.plan, **shape)[rank], backward


@pytest.mark.parametrize(*sweep(mode=MODES, wire=WIRES, dtype=["float32", "float64"],
                               causal={"full": False, "causal": True}, gqa={"mha": False, "gqa": True}))
def test_coded_wire_forward_and_backward(comm, mode, wire, dtype, causal, gqa):
    """out, lse, dq, dk, dv within the wire's tolerance of float64; bytes as predicted for the coded wire (every
    pair of options in the quick suite, ``sweep``)."""
    P, rank = comm.size, comm.rank
    options, layout, S = _mode(mode, P)
    hq, hk = _heads(P, gqa)
    Q, K, V, dO = _full(MODES.index(mode) + 10 * causal + 100 * gqa, S, hq, hk, dtype)
    mine = shard_indices(S, P, rank, layout)
    q, k, v, do = (_rows(x, mine) for x in (Q, K, V, dO))
    got, fwd, bwd = _run(comm, q, k, v, do, dict(options, causal=causal, layout=layout), wire_dtype=wire)
    assert got[0].dtype == np.dtype(dtype) and all(g.dtype == np.dtype(dtype) for g in got[2:])
    assert fwd.wire_dtype == bwd.wire_dtype == wire and fwd.rotate == options.get("rotate", "kv")
    exact = [a.astype(np.float64) for a in (Q, K, V, dO)]
    ref, ref_lse = reference(*exact[:3], causal=causal)
    want = [_rows(ref, mine), _rows(ref_lse, mine, -1)]
    want += [_rows(g, mine) for g in reference_backward(exact[3], *exact[:3], causal=causal)]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):  # pass-Q's gradients: two codings
        assert_attention_close(a, b, np.dtype(dtype), name, wire, 1 + (mode == "passq" and name[0] == "d"))
    forward, backward = _predicted(fwd, bwd, mode, hq, hk, dtype, wire, rank)
    assert (fwd.bytes_sent, bwd.bytes_sent) == (forward, backward)
    if P > 1:  # the coded wire's bytes are not the input dtype's: a wire left uncoded would fail the line above
        assert (forward, backward) != _predicted(fwd, bwd, mode, hq, hk, dtype, None, rank)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("mode", MODES)
def test_what_a_rank_holds_is_never_coded(comm, mode, wire):
    """At P = 1 (COMM_SELF, on every rank) a coded wire changes nothing, bit for bit, forward and backward.

    On all P ranks, causal and contiguous, rank 0's queries see only rank 0's keys: its out, lse and
    dq (Ulysses and the grid: for the heads rank 0 attends itself, whose keys never leave it) are
    those of a run without a wire, bit for bit, while some rank's results do change.
    """
    P = comm.size
    hq, hk = _heads(P, gqa=True)
    for world in (MPI.COMM_SELF, comm):
        size, rank = world.Get_size(), world.Get_rank()
        run = dict(_mode(mode, size)[0], causal=True, layout="contiguous")
        S = 8 * size
        Q, K, V, dO = _full(7, S, hq, hk, "float32")
        mine = shard_indices(S, size, rank)
        arrays = [_rows(x, mine) for x in (Q, K, V, dO)]
        plain = _run(world, *arrays, run)[0]
        coded = _run(world, *arrays, run, wire_dtype=wire)[0]
        if size == 1:
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), coded, plain):
                np.testing.assert_array_equal(a, b, err_msg=f"{name}: P = 1 with a {wire} wire")
            continue
        split = {"ulysses": size, "grid": run.get("ulysses_size")}.get(mode)
        heads = deal_heads(hq, hk, split).q[0] if split else slice(None)
        if rank == 0:
            for name, a, b in zip(("out", "lse", "dq"), coded[:3], plain[:3]):
                np.testing.assert_array_equal(a[:, heads], b[:, heads], err_msg=f"{name} of rank 0's own keys")
        changed = not all(np.array_equal(a, b) for a, b in zip(coded, plain))
        assert world.allreduce(changed, op=MPI.LOR), "the wire coded nothing"


def test_auto_rotation_counts_the_wire(comm):
    """rotate='auto' chooses by the bytes on the call's wire (``plan_bytes``) and sends what it predicts.

    A prefill of T new tokens after C = 16 T cached, 8 query heads, 1 K/V head: as they are, passing
    the queries sends fewer bytes; with an int8 wire the K/V shrink to 0.39x, the queries' float64
    partials home do not, and passing K/V sends fewer.
    """
    P, rank = comm.size, comm.rank
    T = 2 * P
    C = 16 * T
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((8, T, DIM)).astype(np.float32)
    K, V = (rng.standard_normal((1, C + T, d)).astype(np.float32) for d in (DIM, DIM_V))
    q_pos, kv_pos = np.arange(C, C + T)[rank::P], np.arange(rank, C + T, P)
    ref, _ = reference(*(a.astype(np.float64) for a in (Q, K, V)), causal=True, q_positions=np.arange(C, C + T))
    for wire, chosen in ((None, "q"), ("int8", "kv")):
        rec = Record()
        out, _ = ring_attention(Q[..., q_pos - C, :], K[..., kv_pos, :], V[..., kv_pos, :], comm, causal=True,
                                positions=q_pos, kv_positions=kv_pos, rotate="auto", wire_dtype=wire, record=rec)
        assert rec.rotate == (chosen if P > 1 else "kv")  # one rank sends nothing either way
        sent = plan_bytes(rec.plan, 8, 8, DIM, DIM_V, 4, wire)
        assert rec.rotate == ("q" if sent["q"] < sent["kv"] else "kv")
        assert rec.bytes_sent == rank_bytes(rec.plan, 8, 8, DIM, DIM_V, 4, wire)[rec.rotate][rank]
        assert_attention_close(out, _rows(ref, q_pos - C), np.dtype(np.float32), "out", wire)


@pytest.mark.parametrize("mode", ["ulysses", "double_ring", "grid"])
def test_grad_wire_dtype_sets_the_gradients_that_travel(comm, mode):
    """float32 inputs: the dK/dV partials (Ulysses, the grid: dq, dK, dV on their way back) travel in float32 by
    default and in float64 when asked, twice the gradient bytes; K/V on an int8 wire either way."""
    P, rank = comm.size, comm.rank
    options, layout, S = _mode(mode, P)
    hq, hk = _heads(P, gqa=True)
    Q, K, V, dO = _full(2, S, hq, hk, "float32")
    mine = shard_indices(S, P, rank, layout)
    q, k, v, do = (_rows(x, mine) for x in (Q, K, V, dO))
    options = dict(options, causal=True, layout=layout, wire_dtype="int8")
    out, lse = ring_attention(q, k, v, comm, **options)
    shape = dict(batch=BATCH, hq=hq, hk=hk, dim=DIM, dim_v=DIM_V, itemsize=4, wire_dtype="int8", backward=True)
    want = [_rows(g, mine) for g in reference_backward(*(a.astype(np.float64) for a in (dO, Q, K, V)), causal=True)]
    sent = {}
    for grad, itemsize in ((None, 4), ("float32", 4), ("float64", 8)):
        rec = Record()
        grads = ring_attention_backward(do, q, k, v, out, lse, comm, grad_wire_dtype=grad, record=rec, **options)
        assert rec.bytes_sent == predicted_bytes(rec.plan, **shape, grad_itemsize=itemsize)[rank]
        sent[grad] = rec.bytes_sent
        for name, a, b in zip(("dq", "dk", "dv"), grads, want):
            assert_attention_close(a, b, np.dtype(np.float32), name, "int8")
    kv = predicted_bytes(rec.plan, **shape, grad_itemsize=0)[rank]  # the K/V (and queries) alone
    assert sent[None] == sent["float32"] and sent["float64"] - kv == 2 * (sent["float32"] - kv)
    assert (sent["float32"] > kv) == (P > 1)
