"""The real MPI ring against the single-process reference.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi tests/test_ring_mpi.py

Every rank builds the same seeded inputs, keeps its shard, runs the ring, and
checks its own part of the output; root also checks the gathered results.
"""

import numpy as np
import pytest

from mpiring import (
    LAYOUTS,
    MODES,
    Record,
    distributed_attention,
    make_plan,
    predicted_bytes_sent,
    ring_attention,
    ring_attention_context_parallel,
)

from conftest import COMMS, dense_mask, local, naive_attention, qkv, tol

pytestmark = pytest.mark.mpi




@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(24, 8), (2, 3, 24, 16)])
@pytest.mark.parametrize("comm", COMMS, indirect=True)
def test_ring_attention_matches_reference(comm, rng, dtype, causal, shape):
    Q, K, V = qkv(rng, shape, dtype=dtype)
    out, lse = ring_attention(*(local(x, comm) for x in (Q, K, V)), comm, causal=causal)
    expected = naive_attention(Q, K, V, dense_mask(shape[-2], causal))
    assert out.dtype == dtype and lse.dtype == dtype
    np.testing.assert_allclose(out, local(expected, comm), atol=tol(dtype), rtol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_distributed_attention_gathers_output_and_schedule(comm, rng, dtype, causal):
    Q, K, V = qkv(rng, (1, 2, 36, 8), dtype=dtype)
    out, schedule = distributed_attention(Q, K, V, comm, causal=causal)
    if comm.rank != 0:
        assert out is None and schedule is None
        return
    np.testing.assert_allclose(out, naive_attention(Q, K, V, dense_mask(36, causal)), atol=tol(dtype), rtol=0)
    P = comm.size
    assert schedule.sources() == [[(r - s) % P for r in range(P)] for s in range(P)]
    for s in range(P):
        for r in range(P):
            (task,) = schedule.table[s][r]
            assert task.kind == ("masked" if s == 0 and causal else "skip" if causal and r < s else "full")
    assert schedule == make_plan(36, P, causal=causal).schedule


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bytes_sent_equal_cost_model(comm, rng, dtype):
    B, H, S, D = 2, 4, 8 * comm.size, 16
    Q, K, V = qkv(rng, (B, H, S, D), dtype=dtype)
    rec = Record()
    ring_attention(*(local(x, comm) for x in (Q, K, V)), comm, record=rec)
    seed = ring_attention_context_parallel(S, comm.size, H * D, H, np.dtype(dtype).itemsize)
    assert rec.bytes_sent == B * seed["total_comm_bytes"]
    assert rec.messages == 2 * (comm.size - 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_layouts_and_modes(comm, rng, layout, mode, causal):
    S = 5 * comm.size + 3  # uneven on purpose
    Q, K, V = qkv(rng, (2, 4, S, 8), (2, 2, S, 8))
    out, lse = ring_attention(*(local(x, comm, layout) for x in (Q, K, V)), comm, causal=causal,
                              layout=layout, mode=mode)
    expected = naive_attention(Q, K, V, dense_mask(S, causal))
    np.testing.assert_allclose(out, local(expected, comm, layout), atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal,window,cu", [
    (True, (3, 0), None), (False, (4, 2), None), (True, None, [0, 1, 1, 9, 30, 32]), (False, (5, 5), [0, 17, 32]),
])
def test_windows_and_documents(comm, rng, layout, mode, dtype, causal, window, cu):
    S = 32
    Q, K, V = qkv(rng, (1, 4, S, 8), (1, 2, S, 8), dtype=dtype)  # grouped-query as well
    out, schedule = distributed_attention(Q, K, V, comm, causal=causal, layout=layout, mode=mode, window=window,
                                          cu_seqlens=None if cu is None else np.array(cu))
    if comm.rank == 0:
        np.testing.assert_allclose(out, naive_attention(Q, K, V, dense_mask(S, causal, window, cu)),
                                   atol=tol(dtype), rtol=0)
        plan = make_plan(S, comm.size, causal=causal, layout=layout, mode=mode, window=window, cu_seqlens=cu)
        assert schedule == plan.schedule
        predicted = predicted_bytes_sent(plan, kv_width=2 * 2 * 8, itemsize=np.dtype(dtype).itemsize)
        assert [r["bytes_sent"] for r in schedule.records] == predicted


def test_grouped_query_sends_only_the_small_kv(comm, rng):
    S = 4 * comm.size
    Q, K, V = qkv(rng, (1, 8, S, 8), (1, 2, S, 8))
    rec = Record()
    out, _ = ring_attention(*(local(x, comm) for x in (Q, K, V)), comm, record=rec)
    np.testing.assert_allclose(out, local(naive_attention(Q, K, V), comm), atol=1e-12, rtol=0)
    assert rec.bytes_sent == (comm.size - 1) * 2 * 2 * 4 * 8 * 8  # 2 kv heads, 4 tokens, dim 8, 8 bytes


def test_bad_input_raises_on_every_rank(comm, rng):
    q, k, v = qkv(rng, (4, 8))
    if comm.rank == comm.size - 1:
        k = k[:, :4]  # only the last rank is wrong
    with pytest.raises(ValueError, match=f"rank {comm.size - 1}: q and k must have the same head dim"):
        ring_attention(q, k, v, comm)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, q, q, comm, layout="spiral")
    bad = (np.ones((3, 8)) if comm.rank == 0 else np.ones((4, 8)))
    if comm.size > 1:
        with pytest.raises(ValueError, match="rank 0: q holds 3 tokens, but the contiguous layout"):
            ring_attention(bad, bad, bad, comm)
    with pytest.raises(ValueError, match="root rank 0"):
        distributed_attention(np.ones((8, 4)) if comm.rank == 0 else None, np.ones((8, 3)), None, comm)


def test_two_rings_in_a_row_and_caller_messages_untouched(comm, rng):
    Q, K, V = qkv(rng, (16, 4))
    mine = np.full(3, comm.rank, dtype=np.int64)
    got = np.empty(3, dtype=np.int64)
    # the caller has a message in flight on the same communicator, with tag 0
    req = [comm.Irecv(got, source=(comm.rank - 1) % comm.size, tag=0),
           comm.Isend(mine, dest=(comm.rank + 1) % comm.size, tag=0)]
    a, _ = ring_attention(*(local(x, comm) for x in (Q, K, V)), comm)
    b, _ = ring_attention(*(local(x, comm) for x in (Q, K, V)), comm.Dup(), causal=True)
    from mpi4py import MPI

    MPI.Request.Waitall(req)
    assert np.all(got == (comm.rank - 1) % comm.size)
    np.testing.assert_allclose(a, local(naive_attention(Q, K, V), comm), atol=1e-12)
    np.testing.assert_allclose(b, local(naive_attention(Q, K, V, dense_mask(16, True)), comm), atol=1e-12)
