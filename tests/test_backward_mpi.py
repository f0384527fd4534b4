"""The backward pass through the real MPI ring against the single-process analytic reference.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_backward_mpi.py

Every rank builds the same seeded inputs, keeps its shard, runs the forward and
backward ring, and checks its own gradients, messages and bytes; P is the world size.
"""

import numpy as np
import pytest

from mpiring import (
    LAYOUTS,
    MODES,
    Record,
    distributed_attention_backward,
    make_plan,
    predicted_backward_bytes,
    ring_attention,
    ring_attention_backward,
)

from conftest import COMMS, GRAD_TOL, dense_mask, local, naive_attention_backward, qkv

pytestmark = pytest.mark.mpi


def _problem(rng, S, heads=4, kv_heads=2, dim=8, dim_v=6, dtype=np.float64):
    q, k, _ = qkv(rng, (2, heads, S, dim), (2, kv_heads, S, dim), dtype)
    v = rng.standard_normal((2, kv_heads, S, dim_v)).astype(dtype)
    dout = rng.standard_normal((2, heads, S, dim_v)).astype(dtype)
    return q, k, v, dout


def _reference(Q, K, V, dOut, causal=False, window=None, cu=None, scale=None):
    return naive_attention_backward(dOut, Q, K, V, dense_mask(Q.shape[-2], causal, window, cu), scale)


def _ring_grads(comm, Q, K, V, dOut, record=None, **options):
    layout = options.get("layout", "contiguous")
    q, k, v, dout = (local(x, comm, layout) for x in (Q, K, V, dOut))
    out, lse = ring_attention(q, k, v, comm, **options)
    return ring_attention_backward(dout, q, k, v, out, lse, comm, record=record, **options)


MASKS = [  # (causal, window, cu_seqlens) over S = 5 P + 3 tokens, with one empty document
    (False, None, None), (True, None, None), (True, (4, 0), None), (False, (3, 5), None),
    (True, None, "docs"), (False, (2, 2), "docs"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal,window,cu", MASKS)
def test_gradients_match_reference(comm, rng, layout, mode, causal, window, cu):
    S = 5 * comm.size + 3  # uneven on purpose
    cu = [0, 2, 2, S - 4, S] if cu else None
    Q, K, V, dOut = _problem(rng, S)
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu)
    rec = Record()
    grads = _ring_grads(comm, Q, K, V, dOut, record=rec, **options)
    for name, got, want in zip(("dq", "dk", "dv"), grads, _reference(Q, K, V, dOut, causal, window, cu)):
        np.testing.assert_allclose(got, local(want, comm, layout), atol=1e-10, rtol=0, err_msg=name)
    plan = make_plan(S, comm.size, **options)
    assert rec.messages == plan.backward_messages_per_rank()
    assert rec.bytes_sent == predicted_backward_bytes(plan, kv_width=2 * 2 * (8 + 6), itemsize=8)[comm.rank]
    assert rec.table(plan.n_steps) == [plan.tasks(s, comm.rank) for s in range(plan.n_steps)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape_q,shape_kv", [
    ((24, 8), None),                    # 2-D (seq, dim)
    ((2, 3, 24, 16), None),             # same number of heads
    ((1, 8, 24, 8), (1, 2, 24, 8)),     # grouped-query, g = 4
    ((1, 4, 24, 8), (1, 1, 24, 8)),     # multi-query
])
@pytest.mark.parametrize("layout,mode", [("contiguous", "ring"), ("zigzag", "bidirectional"), ("striped", "allgather")])
def test_shapes_and_dtypes(comm, rng, dtype, shape_q, shape_kv, layout, mode):
    Q, K, V = qkv(rng, shape_q, shape_kv, dtype)
    dOut = rng.standard_normal(shape_q).astype(dtype)
    grads = _ring_grads(comm, Q, K, V, dOut, layout=layout, mode=mode, causal=True, scale=0.4)
    for got, want, x in zip(grads, _reference(Q, K, V, dOut, causal=True, scale=0.4), (Q, K, V)):
        assert got.dtype == dtype and got.shape == local(x, comm, layout).shape
        np.testing.assert_allclose(got, local(want, comm, layout), atol=GRAD_TOL[dtype], rtol=0)


@pytest.mark.parametrize("comm", COMMS, indirect=True)
def test_float32_accumulates_in_float64(comm, rng):
    """Many ranks' contributions to one block: the float32 error stays at the kernel's level."""
    S = 64 * comm.size
    Q, K, V, dOut = _problem(rng, S, heads=2, kv_heads=1, dim=16, dim_v=16, dtype=np.float32)
    rec = Record()
    dq, dk, dv = _ring_grads(comm, Q, K, V, dOut, record=rec, layout="zigzag", causal=True)
    _, want_k, want_v = _reference(Q, K, V, dOut, causal=True)
    for got, want in ((dk, want_k), (dv, want_v)):
        np.testing.assert_allclose(got, local(want, comm, "zigzag"), atol=2e-5, rtol=0)
    plan = make_plan(S, comm.size, layout="zigzag", causal=True)
    assert rec.bytes_sent == predicted_backward_bytes(plan, kv_width=2 * 1 * 32, itemsize=4)[comm.rank]


def test_distributed_backward_gathers_gradients(comm, rng):
    S = 6 * comm.size + 1
    Q, K, V, dOut = _problem(rng, S)
    cu = [0, 5, S]
    result = distributed_attention_backward(Q, K, V, dOut, comm, causal=True, layout="zigzag", cu_seqlens=cu,
                                            timeout=30, return_out=True)
    if comm.rank != 0:
        assert result == (None,) * 5
        return
    out, dQ, dK, dV, schedule = result
    for got, want in zip((dQ, dK, dV), _reference(Q, K, V, dOut, causal=True, cu=cu)):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
    assert out.shape == dOut.shape
    plan = make_plan(S, comm.size, causal=True, layout="zigzag", cu_seqlens=cu)
    assert schedule == plan.schedule
    assert [r["messages"] for r in schedule.records] == [plan.backward_messages_per_rank()] * comm.size
    assert [r["bytes_sent"] for r in schedule.records] == predicted_backward_bytes(plan, 2 * 2 * 14, 8)
    assert [r["forward"]["messages"] for r in schedule.records] == [plan.messages_per_rank()] * comm.size


def test_bad_input_raises_on_every_rank(comm, rng):
    Q, K, V, dOut = _problem(rng, 4 * comm.size)
    q, k, v, dout = (local(x, comm) for x in (Q, K, V, dOut))
    out, lse = ring_attention(q, k, v, comm)
    last = comm.size - 1
    bad = dout[..., :5] if comm.rank == last else dout  # only the last rank is wrong
    with pytest.raises(ValueError, match=f"rank {last}: dout must have shape"):
        ring_attention_backward(bad, q, k, v, out, lse, comm)
    bad = lse.astype(np.float32) if comm.rank == 0 else lse
    with pytest.raises(ValueError, match="rank 0: lse must have the dtype of q"):
        ring_attention_backward(dout, q, k, v, out, bad, comm)
    bad = k[..., :4] if comm.rank == last else k
    with pytest.raises(ValueError, match=f"rank {last}: "):
        ring_attention_backward(dout, q, bad, v, out, lse, comm)
    with pytest.raises(ValueError, match="mode must be one of"):
        ring_attention_backward(dout, q, k, v, out, lse, comm, mode="spiral")
    with pytest.raises(ValueError, match="root rank 0: dOut must be"):
        distributed_attention_backward(Q, K, V, dOut[..., :3] if comm.rank == 0 else None, comm)
    # the ring still works afterwards
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, timeout=30)
    np.testing.assert_allclose(grads[0], local(_reference(Q, K, V, dOut)[0], comm), atol=1e-10)


@pytest.mark.parametrize("layout,mode", [("contiguous", "ring"), ("zigzag", "ring"), ("zigzag", "bidirectional"),
                                         ("striped", "bidirectional")])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_shorter_than_the_home_chunks(comm, rng, layout, mode, causal):
    """Shards of 2 or 3 tokens: the hop home is cut into 2 chunks on every rank, gradients stay exact."""
    from mpiring.plans.plan import home_chunks

    S = 3 * comm.size - 1 if comm.size > 1 else 3
    Q, K, V, dOut = _problem(rng, S)
    options = dict(layout=layout, mode=mode, causal=causal)
    rec = Record()
    grads = _ring_grads(comm, Q, K, V, dOut, record=rec, **options)
    for name, got, want in zip(("dq", "dk", "dv"), grads, _reference(Q, K, V, dOut, causal)):
        np.testing.assert_allclose(got, local(want, comm, layout), atol=1e-10, rtol=0, err_msg=name)
    plan = make_plan(S, comm.size, **options)
    chunks = home_chunks(plan)
    assert chunks == (2 if comm.size > 1 else 3)
    homes = sum(rounds > 0 for rounds in plan.rounds.values())
    assert rec.messages == plan.backward_messages_per_rank() == 2 * plan.messages_per_rank() + homes * 2 * (chunks - 1)
    assert rec.bytes_sent == predicted_backward_bytes(plan, kv_width=2 * 2 * (8 + 6), itemsize=8)[comm.rank]


@pytest.mark.parametrize("layout,mode,causal", [("contiguous", "ring", False), ("zigzag", "ring", True),
                                                ("zigzag", "bidirectional", True)])
def test_hop_home_goes_in_key_chunks_while_computing(comm, rng, layout, mode, causal):
    """At a stream's last round each key chunk is sent home as soon as it is done, before the next one computes."""
    from mpiring.plans.plan import home_chunks, key_chunks

    S = 16 * comm.size + 3
    Q, K, V, dOut = _problem(rng, S)
    rec = Record()
    _ring_grads(comm, Q, K, V, dOut, record=rec, layout=layout, mode=mode, causal=causal)
    plan = make_plan(S, comm.size, layout=layout, mode=mode, causal=causal)
    chunks = home_chunks(plan)
    assert chunks == 4
    for stream, rounds in plan.rounds.items():
        home = [(start, info) for name, start, _, info in rec.events
                if name == "send" and info.get("data") == "dK/dV home" and info["stream"] == stream]
        if rounds == 0:
            assert not home
            continue
        source = plan.held_source(comm.rank, stream, rounds)
        n = len(plan.shards[source])
        assert sorted(info["keys"] for _, info in home) == sorted(f"{lo}:{hi}" for lo, hi in key_chunks(n, chunks))
        assert all(info["step"] == rounds and info["dest"] == source for _, info in home)
        assert sum(info["bytes"] for _, info in home) == 2 * 2 * (8 + 6) * n * 8  # the whole partial, once
        # each chunk is computed before its send and after the previous send: sends interleave with compute
        computed = [(start, end, info["keys"]) for name, start, end, info in rec.events
                    if name == "compute" and info["step"] == rounds and info["stream"] == stream]
        assert computed, "every block of these plans has work at its last round"
        order, posted = [info["keys"] for _, info in home], {info["keys"]: t for t, info in home}
        for start, end, keys in computed:
            i = order.index(keys)
            assert end <= posted[keys]  # a chunk goes home once its keys are computed ...
            assert i == 0 or posted[order[i - 1]] <= start  # ... and the one before it went before they started
    waits = [info for name, _, _, info in rec.events if name == "wait"]
    assert all(info.get("data") in ("K/V", "dK/dV", "dK/dV home") for info in waits)
