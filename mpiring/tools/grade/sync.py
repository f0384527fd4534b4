"""The grader's communication: its own exchanges with a deadline, clean-up and abort, and the student's ``comm``.

The grader's calls poll with a timeout longer than any student call may take, so a rank that never joins
ends the job (``Lost``, then ``fatal``) instead of hanging it. The student's ``comm`` is
``mpiring.testing``'s ``StrictComm`` (synchronous sends, every wait timed, a ledger); ``instrument`` points
the student's module's ``MPI`` at a proxy whose ``Request`` waits are timed and whose ``COMM_WORLD``, during
a graded call, is a strict communicator that counts the calls made on it (the ring must use its ``comm``).
"""

import contextlib
import sys
import time

import numpy as np
from mpi4py import MPI

from ...mpi.waits import CommTimeout
from ...testing.strictcomm import StrictComm
from ...testing.timed import Ledger, MPIProxy, Stuck, TimedRequest, settle
from ...testing.timed import instrument as _instrument
from ..cli import objects, poll
from .arguments import DEFAULT_TIMEOUT

__all__ = ["ACTIVE", "Ledger", "Lost", "StrictComm", "Stuck", "TimedRequest", "allgather", "drain", "fatal",
           "instrument", "timed_sum"]


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


class _Active:
    """``ACTIVE.ledger``: the ledger of the student call in progress, or None."""

    ledger = None


ACTIVE = _Active()


class _GraderProxy(MPIProxy):
    """``mpi4py.MPI`` in the student's module: timed ``Request`` waits, a counted COMM_WORLD."""

    @property
    def COMM_WORLD(self):
        if ACTIVE.ledger is None:
            return MPI.COMM_WORLD
        return StrictComm(MPI.COMM_WORLD, ACTIVE.ledger, world=True)


def instrument(module, timeout=DEFAULT_TIMEOUT):
    """Point the student's module's names for ``mpi4py.MPI`` (and ``MPI.Request``) at the grader's proxies."""
    return _instrument(module, proxy=_GraderProxy(timeout))
