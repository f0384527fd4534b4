"""The grader's own communication between ranks: exchanges with a deadline, clean-up, abort.

Every call here polls with a timeout longer than any student call may take, so a rank that
never joins ends the job (``Lost``, then ``fatal``) instead of hanging it.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from ...mpi.waits import CommTimeout
from ...testing.timed import Stuck, settle

__all__ = ["Lost", "allgather", "drain", "fatal", "timed_sum", "wait_for"]


class Lost(Exception):
    """The grader's own communication with the other ranks did not complete in time."""


def wait_for(requests, timeout, what):
    start = time.perf_counter()
    while not MPI.Request.Testall(requests):
        if time.perf_counter() - start > timeout:
            raise Lost(f"{what}: the other ranks did not join within {timeout:g} s")
        time.sleep(2e-4)


def allgather(comm, obj, timeout, what="exchange of results"):
    data = np.frombuffer(MPI.pickle.dumps(obj), np.uint8)
    sizes = np.empty(comm.Get_size(), np.int64)
    wait_for([comm.Iallgather(np.array([data.size], np.int64), sizes)], timeout, what)
    flat = np.empty(int(sizes.sum()), np.uint8)
    wait_for([comm.Iallgatherv(data, [flat, sizes])], timeout, what)
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return [MPI.pickle.loads(flat[edges[r]:edges[r + 1]].tobytes()) for r in range(comm.Get_size())]


def fatal(comm, message, code=3):
    """Last resort: say why on stderr, give the launcher a moment to forward it, and abort the job."""
    sys.stdout.flush()
    sys.stderr.write(f"grade: rank {comm.Get_rank()}: {message}; aborting the job\n")
    sys.stderr.flush()
    time.sleep(0.3)
    comm.Abort(code)


def drain(gcomm, ledger, timeout):
    """Bring the student's communicators back to a clean state after a call (``mpiring.testing.settle``)."""
    try:
        return settle(gcomm, ledger, timeout)
    except (CommTimeout, Stuck) as exc:
        raise Lost(f"clean-up: {exc}") from None


def timed_sum(comm, a, timeout):
    out = np.empty_like(a)
    wait_for([comm.Iallreduce(a, out, MPI.SUM)], timeout, "reference gradients")
    return out
