"""Isolation, failures, determinism and accuracy of the real MPI ring.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi tests/test_validation_ring_mpi.py
"""

import numpy as np
import pytest

import mpiring.core.block
from mpiring import LAYOUTS, MODES, ring_attention, simulate
from mpiring.mpi.waits import CommTimeout

from conftest import dense_mask, local, naive_attention, qkv

pytestmark = pytest.mark.mpi




def test_caller_wildcard_receives_and_interleaved_rings_on_two_communicators(comm, rng):
    """Pending ANY_SOURCE/ANY_TAG receives on the caller's communicators only ever get the caller's messages."""
    from mpi4py import MPI

    P, rank = comm.size, comm.rank
    a_comm, b_comm = comm.Dup(), comm.Dup()
    got = {name: np.full(2, -1, np.int64) for name in ("world", "a")}
    status = {name: MPI.Status() for name in got}
    pending = {"world": comm.Irecv(got["world"], source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG),
               "a": a_comm.Irecv(got["a"], source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)}
    Q, K, V = qkv(rng, (2, 4 * P + 1, 8))
    shards = [local(x, comm) for x in (Q, K, V)]
    results = []
    for c, causal in ((a_comm, False), (b_comm, True), (a_comm, True), (comm, False), (b_comm, False)):
        results.append(ring_attention(*shards, c, causal=causal, timeout=30)[0])
        assert not pending["world"].Test(status["world"]) and not pending["a"].Test(status["a"])
    comm.Barrier()  # no rank sends before every rank has checked
    # only now does the caller send; tags 0..3 are the ones the ring uses internally
    mine = np.array([rank, 7], np.int64)
    sends = [comm.Isend(mine, dest=(rank + 1) % P, tag=1), a_comm.Isend(mine, dest=(rank + 1) % P, tag=2)]
    MPI.Request.Waitall(sends + [pending["world"], pending["a"]], [MPI.Status()] * 2 + [status["world"], status["a"]])
    for name, tag in (("world", 1), ("a", 2)):
        assert got[name].tolist() == [(rank - 1) % P, 7]
        assert status[name].Get_source() == (rank - 1) % P and status[name].Get_tag() == tag
    S = 4 * P + 1
    for out, causal in zip(results, (False, True, True, False, False)):
        np.testing.assert_allclose(out, local(naive_attention(Q, K, V, dense_mask(S, causal)), comm), atol=1e-12)
    a_comm.Free()
    b_comm.Free()


@pytest.mark.parametrize("mode", MODES)
def test_bitwise_identical_run_after_run(comm, rng, mode):
    Q, K, V = qkv(rng, (1, 4, 8 * comm.size + 3, 16), (1, 2, 8 * comm.size + 3, 16), dtype=np.float32)
    shards = [local(x, comm, "zigzag") for x in (Q, K, V)]
    runs = [ring_attention(*shards, comm, causal=True, layout="zigzag", mode=mode, timeout=None if i % 2 else 30)
            for i in range(3)]
    for out, lse in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes() and lse.tobytes() == runs[0][1].tobytes()
    # and every rank agrees that its neighbours' runs were identical too
    assert all(comm.allgather(all(o.tobytes() == runs[0][0].tobytes() for o, _ in runs)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_error_at_world_size_within_2x_of_one_device(comm, layout):
    rng = np.random.default_rng(7)
    S = 32 * comm.size
    Q, K, V = (rng.standard_normal((2, S, 32)).astype(np.float32) for _ in range(3))
    Q *= 3  # peaked softmax: rounding in the merge matters
    ref = naive_attention(Q, K, V, dense_mask(S, True))
    one, _, _ = simulate(Q, K, V, 1, causal=True)
    err_one = np.abs(one - ref).max()
    out, _ = ring_attention(*(local(x, comm, layout) for x in (Q, K, V)), comm, causal=True, layout=layout)
    err = np.abs(out - local(ref, comm, layout)).max()
    worst = max(comm.allgather(err))
    assert worst <= 2 * err_one + 1e-7, (worst, err_one)


def _inject_raise(monkeypatch, at):
    real, calls = mpiring.core.block.attend, [0]

    def compute(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at + 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(mpiring.core.block, "attend", compute)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_a_failure_on_one_rank_raises_on_every_rank_with_a_timeout(comm, rng, monkeypatch, mode):
    """The failed rank raises its own error at once and announces it; the others, which finished, hear of it in
    the end-of-ring check instead of returning as if all went well, and name it (stalls: test_faults.py)."""
    b, T = comm.size - 1, 2.0
    Q, K, V = qkv(rng, (2, 6 * comm.size, 8))
    shards = [local(x, comm) for x in (Q, K, V)]
    if comm.rank == b:  # at its last block: every transfer is already posted
        _inject_raise(monkeypatch, at=comm.size - 1)
    with pytest.raises(CommTimeout if comm.rank != b else RuntimeError) as info:
        ring_attention(*shards, comm, mode=mode, timeout=T)
    if comm.rank != b:  # at once, not after the end-of-ring check's 1.5 T + 0.5 s (docs/reliability.md)
        assert str(info.value) == f"rank {comm.rank}: rank {b} failed in the call: RuntimeError: injected failure"
    monkeypatch.undo()
    comm.Barrier()
    out, _ = ring_attention(*shards, comm, mode=mode, timeout=T)  # the caller's communicator still works
    np.testing.assert_allclose(out, local(naive_attention(Q, K, V), comm), atol=1e-12)
