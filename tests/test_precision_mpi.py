"""Half inputs and coded wires through the real MPI ring: results, dtypes, bytes; bad options on every rank.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_precision_mpi.py

Every rank builds the same seeded inputs (rounded to the dtype under test), keeps
its shard, and checks its own rows against the float64 reference of the rounded
inputs, with the tolerances of ``mpiring.testing.TOLERANCE``; P is the world size.
"""

import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpiring import (
    MODES,
    Record,
    distributed_attention,
    distributed_attention_backward,
    make_plan,
    predicted_backward_bytes,
    predicted_bytes_sent,
    ring_attention,
    ring_attention_backward,
    ring_attention_context_parallel,
)
from mpiring.core.precision import SCALED, named_dtype
from mpiring.testing import assert_attention_close, reference, reference_backward

from conftest import local

pytestmark = pytest.mark.mpi

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(ml_dtypes is None, reason='bfloat16 needs ml_dtypes: '
                                                          'pip install -e ".[half]"'))
FP8 = [pytest.param(name, 0.3, marks=BF16.marks) for name in ("float8_e4m3", "float8_e5m2")]


def _full(seed, S, dtype, heads=2, kv_heads=1, dim=16):
    """q, k, v, dout over the whole sequence, rounded to ``dtype``: the same on every rank."""
    rng = np.random.default_rng(seed)
    shapes = [(heads, S, dim), (kv_heads, S, dim), (kv_heads, S, dim), (heads, S, dim)]
    return [rng.standard_normal(s).astype(named_dtype(dtype)) for s in shapes]


def _f64(arrays):
    return [a.astype(np.float64) for a in arrays]


def _check(comm, got, want, positions, dtype, what, wire=None):
    """This rank's rows against the reference's; the largest error over every rank, the same on all."""
    error = assert_attention_close(got, want[..., positions, :] if what != "lse" else want[..., positions],
                                   dtype if what != "lse" else np.float32, what, wire)
    return comm.allreduce(error, op=MPI.MAX)


# one token; uneven (S = 5 P + 1), every mode; past the 256-key tile, the ring (every mode runs the same kernels)
SIZES = [(per_rank, mode) for per_rank in (1, 5) for mode in MODES] + [(300, "ring")]


@pytest.mark.parametrize("dtype", ["float16", BF16])
@pytest.mark.parametrize("per_rank,mode", SIZES)
def test_half_inputs_forward_and_backward(comm, dtype, mode, per_rank):
    """Out and gradients in the input dtype, lse in float32, every mode, against float64 of the rounded inputs."""
    S = per_rank * comm.size + (per_rank == 5)
    layout = "zigzag" if per_rank > 1 else "contiguous"
    Q, K, V, dO = _full(7, S, dtype)
    positions = local(np.arange(S)[:, None], comm, layout)[:, 0]
    q, k, v, do = (local(x, comm, layout) for x in (Q, K, V, dO))
    out, lse = ring_attention(q, k, v, comm, causal=True, layout=layout, mode=mode)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    grads = ring_attention_backward(do, q, k, v, out, lse, comm, causal=True, layout=layout, mode=mode)
    assert all(g.dtype == q.dtype and g.shape == a.shape for g, a in zip(grads, (q, k, v)))
    ref, ref_lse = reference(*_f64((Q, K, V)), causal=True)
    _check(comm, out, ref, positions, q.dtype, "out")
    _check(comm, lse, ref_lse, positions, q.dtype, "lse")
    # the gradients of the returned (rounded) out: the reference's own out is the exact one
    for got, want, name in zip(grads, reference_backward(*_f64((dO, Q, K, V)), causal=True), ("dq", "dk", "dv")):
        _check(comm, got, want, positions, q.dtype, name)


def test_bfloat16_sends_the_bytes_of_the_cost_report(comm):
    """A bf16 run sends what the cost report predicts at bytes_per_element=2 (even split, full ring)."""
    if ml_dtypes is None:
        pytest.skip('bfloat16 needs ml_dtypes: pip install -e ".[half]"')
    P, S, heads, dim = comm.size, 8 * comm.size, 2, 16
    Q, K, V, _ = _full(3, S, "bfloat16", heads, heads, dim)
    rec = Record()
    ring_attention(*(local(x, comm) for x in (Q, K, V)), comm, record=rec)
    plan = make_plan(S, P)
    assert rec.bytes_sent == predicted_bytes_sent(plan, 2 * heads * dim, 2)[comm.rank]
    assert rec.bytes_sent == ring_attention_context_parallel(S, P, heads * dim, heads, 2)["total_comm_bytes"]
    assert rec.wire_dtype == "bfloat16"


@pytest.mark.parametrize("wire,fraction", [("float16", 0.5), pytest.param("bfloat16", 0.5, marks=BF16.marks),
                                           ("int8", 0.3), *FP8])
def test_wire_error_and_bytes(comm, wire, fraction):
    """fp32 inputs, K/V coded on the wire: the error under its bound, the bytes at their fraction of float32."""
    S, dim = 12 * comm.size + 1, 32
    Q, K, V, dO = _full(11, S, "float32", dim=dim)
    q, k, v, do = (local(x, comm, "zigzag") for x in (Q, K, V, dO))
    positions = local(np.arange(S)[:, None], comm, "zigzag")[:, 0]
    options = dict(causal=True, layout="zigzag")
    plain, coded, plain_back, coded_back = Record(), Record(), Record(), Record()
    out, lse = ring_attention(q, k, v, comm, record=plain, **options)
    ring_attention_backward(do, q, k, v, out, lse, comm, record=plain_back, **options)
    out, lse = ring_attention(q, k, v, comm, record=coded, wire_dtype=wire, **options)
    assert out.dtype == np.float32 and coded.wire_dtype == wire
    grads = ring_attention_backward(do, q, k, v, out, lse, comm, record=coded_back, wire_dtype=wire, **options)
    ref, _ = reference(*_f64((Q, K, V)), causal=True)
    error = _check(comm, out, ref, positions, np.float32, "out", wire)
    if comm.size > 1:
        assert error > 1e-4  # remote blocks were coded: far above float32's own error
        assert coded.bytes_sent <= fraction * plain.bytes_sent
        kv = coded.bytes_sent  # the backward's K/V travel as the forward's; its float32 partials do not change
        assert coded_back.bytes_sent - kv == plain_back.bytes_sent - plain.bytes_sent
    plan = make_plan(S, comm.size, causal=True, layout="zigzag")
    row = dim + 4 if wire in SCALED else dim  # int8, FP8: 1 byte per value and a float32 scale per row
    itemsize = 1 if wire in SCALED else 2
    assert coded.bytes_sent == predicted_bytes_sent(plan, 2 * row, itemsize)[comm.rank]
    assert coded_back.bytes_sent == predicted_backward_bytes(plan, 2 * row, itemsize, 4, 2 * dim)[comm.rank]
    for got, want, name in zip(grads, reference_backward(*_f64((dO, Q, K, V)), causal=True), ("dq", "dk", "dv")):
        _check(comm, got, want, positions, np.float32, name, wire)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_bytes_halved_for_float32(comm, mode):
    """dK/dV partials travel in float32 by default: half the gradient bytes of grad_wire_dtype='float64'."""
    S = 6 * comm.size
    Q, K, V, dO = _full(5, S, "float32")
    q, k, v, do = (local(x, comm) for x in (Q, K, V, dO))
    out, lse = ring_attention(q, k, v, comm, mode=mode)
    kv = Record()
    ring_attention(q, k, v, comm, mode=mode, record=kv)
    sent = {}
    for grad in ("float32", "float64", None):
        rec = Record()
        dq, dk, dv = ring_attention_backward(do, q, k, v, out, lse, comm, mode=mode, grad_wire_dtype=grad,
                                             record=rec)
        sent[grad] = rec.bytes_sent - kv.bytes_sent
    assert sent[None] == sent["float32"] and 2 * sent["float32"] == sent["float64"]
    assert (sent["float32"] > 0) == (comm.size > 1)
    plan = make_plan(S, comm.size, mode=mode)
    assert rec.bytes_sent == predicted_backward_bytes(plan, 2 * 16, 4)[comm.rank]
    positions = local(np.arange(S)[:, None], comm)[:, 0]
    for got, want, name in zip((dq, dk, dv), reference_backward(*_f64((dO, Q, K, V))), ("dq", "dk", "dv")):
        _check(comm, got, want, positions, np.float32, name)


def test_float64_gradients_keep_float64_tolerance(comm):
    """float64 inputs: partials travel in float64 by default, and the 1e-12 tolerance holds."""
    S = 5 * comm.size + 2
    Q, K, V, dO = _full(2, S, "float64")
    q, k, v, do = (local(x, comm, "striped") for x in (Q, K, V, dO))
    out, lse = ring_attention(q, k, v, comm, layout="striped", causal=True)
    grads = ring_attention_backward(do, q, k, v, out, lse, comm, layout="striped", causal=True)
    positions = local(np.arange(S)[:, None], comm, "striped")[:, 0]
    for got, want, name in zip(grads, reference_backward(dO, Q, K, V, causal=True), ("dq", "dk", "dv")):
        _check(comm, got, want, positions, np.float64, name)


def test_distributed_with_half_inputs_and_int8_wire(comm):
    dtype = "bfloat16" if ml_dtypes is not None else "float16"
    S = 7 * comm.size + 1
    Q, K, V, dO = _full(9, S, dtype)
    root = comm.size - 1
    args = [x if comm.rank == root else None for x in (Q, K, V, dO)]
    out, lse, schedule = distributed_attention(*args[:3], comm, root=root, causal=True, return_lse=True,
                                               wire_dtype="int8", accumulate="float32")
    back = distributed_attention_backward(*args, comm, root=root, causal=True, wire_dtype="int8")
    if comm.rank != root:
        assert out is None and back[0] is None
        return
    assert out.dtype == Q.dtype and lse.dtype == np.float32 and back[0].dtype == Q.dtype
    ref, _ = reference(*_f64((Q, K, V)), causal=True)
    assert_attention_close(out, ref, Q.dtype, wire="int8")
    for got, want, name in zip(back[:3], reference_backward(*_f64((dO, Q, K, V)), causal=True), ("dq", "dk", "dv")):
        assert_attention_close(got, want, Q.dtype, name, wire="int8")
    assert all(r["wire_dtype"] == "int8" for r in schedule.records)


BAD = [  # (keyword, bad value, the text every rank raises)
    ("wire_dtype", "int4", "wire_dtype must be None or one of 'float16', 'bfloat16', 'int8', 'float8_e4m3', "
                           "'float8_e5m2'; got 'int4'"),
    ("accumulate", "float16", "accumulate must be one of 'float64', 'float32', 'input'; got 'float16'"),
    ("grad_wire_dtype", "bfloat16", "grad_wire_dtype must be None or one of 'float32', 'float64'; got 'bfloat16'"),
]


@pytest.mark.parametrize("name,value,text", BAD)
def test_bad_precision_option_raises_on_every_rank(comm, name, value, text):
    """The last rank passes a bad value (or, with one rank, every rank does): every rank raises the same text."""
    b = comm.size - 1
    Q, K, V, dO = _full(1, 4 * comm.size, "float32")
    q, k, v, do = (local(x, comm) for x in (Q, K, V, dO))
    out, lse = ring_attention(q, k, v, comm)
    kwargs = {name: value} if comm.rank == b else {}
    messages = []
    for call in ([ring_attention, q, k, v] if name != "grad_wire_dtype" else None,
                 [ring_attention_backward, do, q, k, v, out, lse] if name != "accumulate" else None):
        if call is None:
            continue
        with pytest.raises(ValueError) as caught:
            call[0](*call[1:], comm, **kwargs)
        messages.append(str(caught.value))
    everyone = comm.allgather(messages)
    assert all(m == [f"rank {b}: {text}"] * len(messages) for m in everyone)
    if comm.size > 1:  # a good value on one rank only: the others' differ from rank 0's
        good = {"wire_dtype": "int8", "accumulate": "float32", "grad_wire_dtype": "float64"}[name]
        call = ring_attention_backward if name == "grad_wire_dtype" else ring_attention
        args = (do, q, k, v, out, lse) if name == "grad_wire_dtype" else (q, k, v)
        with pytest.raises(ValueError, match=f"rank {b}: {name} '{good}' differs from rank 0's"):
            call(*args, comm, **({name: good} if comm.rank == b else {}))
    assert comm.allreduce(1) == comm.size  # the communicator still works


def test_fp8_wire_without_ml_dtypes_raises_on_every_rank(comm, monkeypatch):
    """The last rank's ml_dtypes lacks float8_e4m3fn (with one rank: every rank's): every rank raises the
    same ValueError naming it, before anything moves; the others with ml_dtypes run it afterwards."""
    b = comm.size - 1
    Q, K, V, dO = _full(4, 4 * comm.size, "float32")
    q, k, v = (local(x, comm) for x in (Q, K, V))
    if comm.rank == b:
        monkeypatch.setitem(sys.modules, "ml_dtypes", type(sys)("ml_dtypes"))  # an ml_dtypes without FP8
    rec = Record()
    with pytest.raises(ValueError) as caught:
        ring_attention(q, k, v, comm, wire_dtype="float8_e4m3", record=rec)
    assert rec.bytes_sent == 0 and rec.messages == 0
    text = f"rank {b}: float8_e4m3 needs ml_dtypes.float8_e4m3fn, which ml_dtypes ? lacks: pip install -U ml_dtypes"
    assert comm.allgather(str(caught.value)) == [text] * comm.size
    monkeypatch.undo()
    if ml_dtypes is not None:
        out, _ = ring_attention(q, k, v, comm, wire_dtype="float8_e4m3")
        assert_attention_close(out, reference(*_f64((Q, K, V)))[0][..., local(np.arange(4 * comm.size)[:, None],
                                                                               comm)[:, 0], :],
                               np.float32, "out", "float8_e4m3")


def _strategies(P):
    """Every strategy that runs on P ranks: the ring modes, pass-Q, Ulysses, the double ring, the grid."""
    out = {mode: dict(mode=mode) for mode in MODES}
    out.update({"pass-q": dict(rotate="q"), "ulysses": dict(mode="ulysses"),
                "double_ring": dict(mode="double_ring", node_size=2 if P % 2 == 0 else 1)})
    if P % 2 == 0 and P > 2:  # (at P = 2 the ring across groups holds one block: nothing to merge)
        out["grid"] = dict(ulysses_size=2)
    return out


def test_every_strategy_honours_accumulate(comm):
    """accumulate= changes every strategy's result as it changes the ring's: float32 running outputs round at
    every merge, so out differs from float64's in its last bits, both within tolerance (issue 34: Ulysses, the
    double ring, the grid and pass-Q kept float64 whatever was asked)."""
    P = comm.size
    if P == 1:
        pytest.skip("one rank merges one block: nothing to round between blocks")
    S = 64 * P
    Q, K, V, _ = _full(4 * P, S, "float32", heads=P)
    ref, _ = reference(*_f64((Q, K, V)), causal=True)
    rows = np.arange(S)[:, None]
    for name, strategy in _strategies(P).items():
        layout = "zigzag"
        q, k, v = (local(x, comm, layout) for x in (Q, K, V))
        mine = local(rows, comm, layout)[:, 0]
        outs = {}
        for accumulate in ("float64", "float32"):
            out, lse = ring_attention(q, k, v, comm, causal=True, layout=layout, accumulate=accumulate, **strategy)
            assert out.dtype == np.float32
            assert_attention_close(out, ref[..., mine, :], np.float32, f"{name} out, accumulate {accumulate}")
            outs[accumulate] = out
        differs = comm.allreduce(int(not np.array_equal(outs["float32"], outs["float64"])), op=MPI.SUM)
        assert differs > 0, f"{name}: accumulate='float32' gave float64's results bit for bit: it was ignored"
