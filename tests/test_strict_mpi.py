"""The kit's strict communicator and collective assertions under pytest-mpi, on third-party style code.

    python -m pytest --with-mpi -q tests/test_strict_mpi.py                      # P = 1
    mpiexec -n 3 python -m pytest --with-mpi -q -m mpi tests/test_strict_mpi.py  # and -n 2, 4

tests/thirdparty_attention.py is head-parallel attention whose all-to-all sends before it
receives: MPI buffers its 2 KiB messages, so it works on a plain communicator, and deadlocks once
messages pass the eager limit. The strict fixture (synchronous sends) catches it at 2 KiB.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import thirdparty_attention as third
from mpi4py import MPI

import mpiring
from mpiring.testing import Stuck, assert_attention_close, assert_sharded_attention, reference, strict

from launch import MPIEXEC, mpiexec_argv, run_limited

strict_comm = mpiring.testing.strict_comm_fixture(timeout=2.0, modules=["thirdparty_attention"])


def problem(P, D=16, n=16, seed=0):
    """Full q, k, v with H = P heads: every all-to-all message is one head of n tokens, n * D * 8 = 2 KiB."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((P, n * P, D)) for _ in range(3)]


def shards(arrays, comm):
    rows = mpiring.shard_indices(arrays[0].shape[-2], comm.Get_size(), comm.Get_rank())
    return [np.ascontiguousarray(a[..., rows, :]) for a in arrays], rows


@pytest.mark.mpi(min_size=2)
def test_send_before_receive_deadlocks_under_the_strict_fixture_at_2_KiB(strict_comm):
    (q, k, v), _ = shards(problem(strict_comm.Get_size()), strict_comm)
    with pytest.raises(Stuck) as info:
        third.head_parallel_attention(q, k, v, strict_comm, alltoall=third.send_first)
    message = str(info.value)
    rank = strict_comm.Get_rank()
    assert message.startswith(f"rank {rank}: Send to rank "), message
    assert "(tag 77, 2 KiB) blocked for 2." in message and "(timeout 2 s)" in message, message
    assert info.value.timeout == 2.0 and info.value.call.startswith("Send")


@pytest.mark.mpi
def test_the_safe_exchange_passes_and_its_traffic_is_in_the_ledger(strict_comm):
    P = strict_comm.Get_size()
    Q, K, V = problem(P)
    (q, k, v), _ = shards((Q, K, V), strict_comm)
    out = third.head_parallel_attention(q, k, v, strict_comm)
    assert_sharded_attention(out, q, K, V, strict_comm, dtype=np.float64)
    traffic = strict_comm.traffic()
    piece = 16 * 16 * 8  # one head of one shard
    for r, t in enumerate(traffic):
        assert t["sent_to"] == {d: 4 * piece for d in range(P) if d != r}  # q, k, v there, out back
        assert t["bytes_received"] == 4 * piece * (P - 1) and t["unfinished"] == []


@pytest.mark.mpi
def test_a_waitall_on_the_wrong_source_raises_with_the_real_timeout():
    """MPI.Request.Waitall, reached through the module's MPI name, is timed: it raises, naming the timeout given."""
    comm = MPI.COMM_WORLD.Dup()
    control = MPI.COMM_WORLD.Dup()
    P = comm.Get_size()
    with strict(comm, timeout=1.5, modules=[third]) as sc:
        (q, k, v), _ = shards(problem(P), sc)
        if P == 1:
            third.head_parallel_attention(q, k, v, sc, alltoall=third.wrong_source)  # nothing to receive
        else:
            with pytest.raises(Stuck, match=r"Waitall blocked for 1\.\d s \(timeout 1\.5 s\); unfinished: Irecv "
                                            r"from rank \d \(tag 77, 2 KiB\)"):
                third.head_parallel_attention(q, k, v, sc, alltoall=third.wrong_source)
    assert third.MPI is MPI  # the module's MPI name is put back
    left, clean = mpiring.testing.settle(control, sc.ledger, 30)
    assert clean and (left != []) == (P > 1)
    comm.Free()
    control.Free()


@pytest.mark.mpi
def test_a_collective_assert_gives_one_verdict_and_rank_0_the_summary(strict_comm):
    P, rank = strict_comm.Get_size(), strict_comm.Get_rank()
    Q, K, V = problem(P)
    (q, k, v), rows = shards((Q, K, V), strict_comm)
    ref, _ = reference(q, K, V, q_positions=rows)
    got = ref.copy()
    if rank == P - 1:
        got[1 % P, 3, 5] += 1e-3  # the last rank is wrong at its row 3
    with pytest.raises(AssertionError) as info:
        assert_attention_close(got, ref, np.float64, positions=rows, comm=strict_comm)
    message = str(info.value)
    head = f"out: failed on rank {P - 1} of {P}"
    assert message.startswith(head), message
    if rank == 0:
        assert (f"[rank {P - 1}] out: max error 0.001 on rank {P - 1} at global position {16 * (P - 1) + 3} "
                f"(row 3 here), head {1 % P}, column 5") in message, message
    else:
        assert message == f"{head} (rank 0's report has every rank's message)"
    mpiring.testing.assert_on_all_ranks(strict_comm, None)  # nobody failed: no exception


@pytest.mark.mpi(min_size=2)
def test_a_skipped_block_is_named_with_its_rank(strict_comm):
    """The last rank leaves rank 0's K/V block out: the message says so, with the rank and global positions."""
    P, rank = strict_comm.Get_size(), strict_comm.Get_rank()
    Q, K, V = problem(P)
    (q, k, v), rows = shards((Q, K, V), strict_comm)
    keep = np.arange(16, 16 * P) if rank == P - 1 else np.arange(16 * P)
    got, _ = reference(q, K[:, keep], V[:, keep], q_positions=rows, k_positions=keep)
    with pytest.raises(AssertionError) as info:
        assert_sharded_attention(got, q, K, V, strict_comm)
    if rank == 0:
        assert f"[rank {P - 1}] out: max error" in str(info.value) and "global position" in str(info.value)
        assert (f"hint: rank {P - 1}'s output is exactly attention in which rank 0's K/V block is skipped (it must be "
                f"attended in full)") in str(info.value), str(info.value)


JOBS = Path(__file__).with_name("strict_jobs.py")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_a_collective_one_rank_never_joins_raises_on_the_others():
    code, output, _ = run_limited(mpiexec_argv(3, sys.executable, JOBS, "bcast"), 60, stderr=subprocess.STDOUT)
    assert code == 0 and "rank 0 returned" in output, output
    for r in (1, 2):
        assert f"Stuck: rank {r}: Bcast blocked for 1." in output and "(timeout 1 s)" in output, output


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_a_deadline_ends_a_wait_nothing_can_time():
    """strict(deadline=): mpi4py's own Waitall, in a module not instrumented, ends the job instead of hanging it."""
    code, output, _ = run_limited(mpiexec_argv(2, sys.executable, JOBS, "deadline"), 60, stderr=subprocess.STDOUT)
    assert code != 0 and "returned" not in output, output
    # either rank may be the first to abort the job (and the only one heard)
    assert re.search(r"strict: rank (\d): Irecv from rank \1 \(tag 5, 32 B\) unfinished 2 s after it was posted, "
                     r"outside any timed wait", output), output
