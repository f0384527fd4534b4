"""One verdict on every rank: failures before, inside and after the ring, in-process under mpiexec.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_reliability_mpi.py

What docs/reliability.md promises: an error found on one rank before the ring
(a MemoryError while copying inputs) is raised by every rank; a rank stalled
past the timeout makes every rank raise, itself included; root is agreed on
by every distributed call; bad communicators and options are refused clearly.
"""

import time

import numpy as np
import pytest

from mpiring import distributed_attention, distributed_attention_backward, ring_attention
from mpiring.core import block
from mpiring.mpi.waits import CommTimeout
from mpiring.parallel.ring import _slow_step_note

from conftest import local, qkv

pytestmark = pytest.mark.mpi


def _shards(comm, rng, n=6):
    Q, K, V = qkv(rng, (2, n * comm.size, 8))
    return Q, K, V, [local(x, comm) for x in (Q, K, V)]


def test_a_memory_error_while_copying_inputs_is_raised_by_every_rank(comm, rng, monkeypatch):
    _, _, _, shards = _shards(comm, rng)
    b = comm.size - 1
    if comm.rank == b:
        def no_memory(a, *args, **kwargs):
            raise MemoryError("injected: no memory for the contiguous copy")

        monkeypatch.setattr(np, "ascontiguousarray", no_memory)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"rank {b}: MemoryError: injected"):
        ring_attention(*shards, comm, timeout=5)
    assert time.perf_counter() - start < 5  # found in the agreement, not by a timeout


def test_a_rank_stalled_past_the_timeout_fails_everywhere_itself_included(comm, rng, monkeypatch):
    """The stalled rank arrives 1.3 T late: before, it returned normally while the others raised."""
    if comm.size < 2:
        pytest.skip("needs a peer to stall against")
    _, _, _, shards = _shards(comm, rng)
    T, b = 1.0, comm.size - 1
    if comm.rank == b:
        real, calls = block.attend, [0]

        def late(*args, **kwargs):
            calls[0] += 1
            if calls[0] == comm.size:  # its last block: every transfer is already posted
                time.sleep(1.3 * T)
            return real(*args, **kwargs)

        monkeypatch.setattr(block, "attend", late)
    with pytest.raises(CommTimeout, match="apart, more than the timeout|end-of-ring check not complete"):
        ring_attention(*shards, comm, timeout=T)
    comm.Barrier()


def test_slow_step_note_names_the_step():
    assert "computed step 2 for 3.5 s, longer than the timeout" in _slow_step_note(2, 3.5, 2.0)
    assert _slow_step_note(2, 3.5, 5.0) is None and _slow_step_note(2, 3.5, None) is None


@pytest.mark.parametrize("roots,match", [
    ("split", "root 1 differs from rank 0's 0"),
    ("past", "root must be a rank of the communicator"),
    ("negative", "root must be a rank of the communicator"),
])
def test_backward_agrees_on_root(comm, rng, roots, match):
    if roots == "split" and comm.size < 2:
        pytest.skip("needs two ranks to disagree")
    Q, K, V, _ = _shards(comm, rng)
    root = {"split": 1 if comm.rank == 1 else 0, "past": comm.size, "negative": -1}[roots]
    with pytest.raises(ValueError, match=match):
        distributed_attention_backward(Q, K, V, np.ones_like(Q), comm, root=root, timeout=5)


def test_a_bad_scale_on_one_rank_is_caught_before_the_scatter(comm, rng):
    Q, K, V, _ = _shards(comm, rng)
    b = comm.size - 1
    with pytest.raises(ValueError, match=f"rank {b}: scale must be a finite positive number"):
        distributed_attention(Q, K, V, comm, scale=-1.0 if comm.rank == b else None, timeout=5)


def test_an_intercommunicator_is_refused_on_every_rank(comm, rng):
    if comm.size < 2:
        pytest.skip("an intercommunicator needs two groups")
    _, _, _, shards = _shards(comm, rng)
    low = comm.rank < comm.size // 2
    local_comm = comm.Split(0 if low else 1, comm.rank)
    inter = local_comm.Create_intercomm(0, comm, comm.size // 2 if low else 0, tag=11)
    with pytest.raises(ValueError, match="intercommunicator"):
        ring_attention(*shards, inter)
    inter.Free()
    local_comm.Free()


@pytest.mark.parametrize("bad,match", [
    ("yes", "causal must be True or False"),
])
def test_causal_must_be_a_bool(comm, rng, bad, match):
    _, _, _, shards = _shards(comm, rng)
    with pytest.raises(ValueError, match=match):
        ring_attention(*shards, comm, causal=bad, timeout=5)


def test_empty_batch_is_a_clear_error(comm, rng):
    q = np.zeros((0, 2, 4, 8))
    with pytest.raises(ValueError, match="batch and head axes must not be empty"):
        ring_attention(q, q, q, comm, timeout=5)


def test_the_default_timeout_is_auto_and_scales_with_the_work(comm):
    from mpiring import make_plan
    from mpiring.plans.checks import AUTO_BASE, AUTO_RATE, resolve_timeout

    plan = make_plan(4096 * comm.size, comm.size, causal=True, layout="zigzag")
    t = resolve_timeout("auto", plan, batch_heads=8, dim=64)
    assert t == pytest.approx(AUTO_BASE + 4 * 8 * 64 * max(plan.visible_pairs()) / AUTO_RATE)
    assert resolve_timeout(3.0, plan, 8, 64) == 3.0 and resolve_timeout(None, plan, 8, 64) is None
