"""The communicator the student's code gets: the kit's strict communicator, and the student's ``MPI`` name.

The student's ``comm`` is ``mpiring.testing``'s ``StrictComm`` (synchronous sends, every wait
timed, a ledger); ``instrument`` points the student's module's ``MPI`` at a proxy whose ``Request``
waits are timed and whose ``COMM_WORLD``, during a graded call, is a strict communicator that
counts the calls made on it (the ring must use the ``comm`` it is given).
"""

from mpi4py import MPI

from ...testing.strictcomm import StrictComm
from ...testing.timed import Ledger, MPIProxy, Stuck, TimedRequest, request_text, size_text
from ...testing.timed import instrument as _instrument
from .arguments import DEFAULT_TIMEOUT

__all__ = ["ACTIVE", "Ledger", "StrictComm", "Stuck", "TimedRequest", "instrument", "request_text", "size_text"]


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
