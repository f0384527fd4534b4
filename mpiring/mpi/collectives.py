"""Collectives with a timeout: Python objects gathered for the agreement and the results, the K/V all-gather.

All non-blocking (they never match blocking ones), completed by ``waits.wait_until``.
"""

import pickle
import time

import numpy as np

from ..core.buffers import flat_blocks, mpi_view
from .waits import test_all, wait_until

__all__ = ["together", "allgather", "gather", "start_allgather", "allgathered", "wait_allgather",
           "pickled", "unpickled"]


def together(comm, timeout, what):
    """Every rank of ``comm`` has come here (a non-blocking barrier; CommTimeout after ``timeout``).

    For the collectives MPI has no non-blocking form of (``Split``,
    ``Split_type``): called right before one, a rank that failed or stalled
    before it makes the others raise instead of waiting in it forever.
    """
    wait_until([comm.Ibarrier()], timeout, comm.Get_rank(), what, sync=True)


def allreduced(comm, values, op, timeout, what):
    """``values`` (a float64 array) reduced with ``op`` over every rank of ``comm``: a new array, the same on
    every rank (a non-blocking all-reduce; CommTimeout after ``timeout``)."""
    values = np.ascontiguousarray(values, np.float64)
    result = np.empty_like(values)
    wait_until([comm.Iallreduce(values, result, op=op)], timeout, comm.Get_rank(), what, sync=True)
    return result


def allgather(comm, obj, timeout=None, enter=None):
    """``comm.allgather(obj)`` that raises CommTimeout if some rank does not join in time.

    Always non-blocking collectives (they never match blocking ones), so ranks
    with and without a timeout still pair up. ``enter(requests)``: when this
    all-gather opens a call, how to wait for its first stage (every rank's
    size), which completes when every rank has entered (``agree.gather_entry``);
    ``timeout`` then bounds the second.
    """
    start, rank = time.perf_counter(), comm.Get_rank()
    data = pickled(obj)
    sizes = np.empty(comm.Get_size(), np.int64)
    first = [comm.Iallgather(np.array([data.size], np.int64), sizes)]
    if enter is None:
        wait_until(first, timeout, rank, "agreement", start, sync=True)
    else:
        enter(first)
        start = time.perf_counter()
    flat = np.empty(int(sizes.sum()), np.uint8)
    wait_until([comm.Iallgatherv(data, [flat, sizes])], timeout, rank, "agreement", start, sync=True)
    return unpickled(flat, sizes)


def gather(comm, obj, root, timeout=None):
    """``comm.gather(obj, root)`` (a list on root, None elsewhere) that raises CommTimeout past ``timeout``."""
    start, rank = time.perf_counter(), comm.Get_rank()
    data = pickled(obj)
    sizes = np.empty(comm.Get_size(), np.int64) if rank == root else None
    wait_until([comm.Igather(np.array([data.size], np.int64), sizes, root=root)], timeout, rank, "gather", start,
               sync=True)
    flat = np.empty(int(sizes.sum()), np.uint8) if rank == root else None
    wait_until([comm.Igatherv(data, [flat, sizes] if rank == root else None, root=root)], timeout, rank, "gather",
               start)
    return unpickled(flat, sizes) if rank == root else None


def pickled(obj):
    """``obj`` as a byte array for the v-collectives."""
    return np.frombuffer(pickle.dumps(obj), np.uint8)


def unpickled(flat, sizes):
    """The objects of every rank from the concatenated bytes ``flat`` (``sizes[r]`` bytes of rank r)."""
    offsets = np.cumsum(np.concatenate([[0], sizes]))
    return [pickle.loads(flat[offsets[r]:offsets[r + 1]].tobytes()) for r in range(len(sizes))]


def start_allgather(k, v, plan, comm, rec):
    """Post the all-gather of every rank's K and V; returns (per-rank K views, per-rank V views) and the requests.

    Bytes and messages are counted as a ring all-gather moves them.
    """
    size = comm.Get_size()
    lengths = [len(s) for s in plan.kv_shards]
    gathered, requests = [], []
    for a in (k, v):
        flat, counts, views = flat_blocks(a, lengths, a.dtype, empty=True)
        requests.append(comm.Iallgatherv(mpi_view(a), [mpi_view(flat), counts]))
        gathered.append(views)
        rec.bytes_sent += a.nbytes * (size - 1)
        rec.messages += size - 1
    return gathered, requests


def allgathered(k, v, plan, comm, rec, timeout):
    """The all-gather as a loop: post it, then yield ``(step, task, (k, v) of the task's block, progress)``.

    Step 0 is this rank's own block, computed while the all-gather moves; it
    is completed (with the timeout) before step 1, or after step 0 when P = 1.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    posted = time.perf_counter()
    gathered, requests = start_allgather(k, v, plan, comm, rec)
    rec.event("send", posted, step=0, stream=0, dest="all", bytes=(k.nbytes + v.nbytes) * (size - 1))

    def progress():
        test_all(requests, rank, "all-gather")

    for step in range(plan.n_steps):
        task = plan.tasks(step, rank)[0]
        if step == 1:
            wait_allgather(requests, timeout, rank, rec)
        yield step, task, (k, v) if step == 0 else (gathered[0][task.source], gathered[1][task.source]), progress
    if plan.n_steps == 1:
        wait_until(requests, timeout, rank, "all-gather")


def wait_allgather(requests, timeout, rank, rec):
    """Complete the all-gather (with the timeout) and note the time blocked as step 0's wait."""
    start = time.perf_counter()
    wait_until(requests, timeout, rank, "all-gather")
    end = time.perf_counter()
    rec.wait_time += end - start
    rec.events.append(("wait", start, end, {"step": 0}))
