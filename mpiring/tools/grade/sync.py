"""The grader's own communication between ranks: exchanges with a deadline, clean-up, abort.

Every call here polls with a timeout longer than any student call may take, so a rank that
never joins ends the job (``Lost``, then ``fatal``) instead of hanging it.
"""

import contextlib
import sys
import time

import numpy as np
from mpi4py import MPI

from ...mpi.waits import CommTimeout
from ...testing.timed import Stuck, settle
from ..cli import objects, poll

__all__ = ["Lost", "allgather", "drain", "fatal", "timed_sum"]


class Lost(Exception):
    """The grader's own communication with the other ranks did not complete in time."""


@contextlib.contextmanager
def _joined(timeout, what):
    """A wait of the grader's that outlives ``timeout`` raises ``Lost``."""
    try:
        yield
    except TimeoutError:
        raise Lost(f"{what}: the other ranks did not join within {timeout:g} s") from None


def allgather(comm, obj, timeout, what="exchange of results"):
    with _joined(timeout, what):
        return objects(comm, obj, timeout=timeout, what=what)


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
    with _joined(timeout, "reference gradients"):
        poll([comm.Iallreduce(a, out, MPI.SUM)], timeout)
    return out
