"""pytest fixtures of the kit: ``ring_comm`` over three communicators, ``strict_comm`` over strict ones.

    # conftest.py
    from mpiring.testing import ring_comm, strict_comm  # noqa: F401  (pytest finds fixtures by name)
    strict_alltoall = strict_comm_fixture(timeout=3, modules=["my_alltoall"])  # a fixture of your own
"""

__all__ = ["ring_comm_fixture", "strict_comm_fixture"]

KINDS = {"world", "dup", "self"}


def _check(params):
    unknown = set(params) - KINDS
    if unknown:
        raise ValueError(f"unknown communicators {sorted(unknown)}; choose from world, dup, self")


def ring_comm_fixture(params=("world", "dup", "self")):
    """A pytest fixture over the named communicators; ``ring_comm`` is ``ring_comm_fixture()``."""
    import pytest

    _check(params)

    @pytest.fixture(params=list(params))
    def ring_comm(request):
        """A communicator to run a ring on: COMM_WORLD, a duplicate of it (freed after the test), or COMM_SELF.

        A ring must work on any communicator, not only COMM_WORLD: on a duplicate its messages
        cannot mix with the caller's, and on COMM_SELF it is a ring of one rank.
        """
        from mpi4py import MPI

        if request.param == "world":
            yield MPI.COMM_WORLD
        elif request.param == "self":
            yield MPI.COMM_SELF
        else:
            comm = MPI.COMM_WORLD.Dup()
            try:
                yield comm
            finally:
                comm.Free()

    return ring_comm


def strict_comm_fixture(timeout=10.0, params=("world",), modules=(), deadline=None):
    """A pytest fixture of strict communicators (``mpiring.testing.strict``); ``strict_comm`` is the default one.

    ``params``: "world" (a duplicate of COMM_WORLD: every rank) and/or "self" (COMM_SELF, one
    rank); ``timeout``: seconds any call may block before ``Stuck`` is raised; ``modules``: whose
    ``MPI.Request.Wait*`` to time as well; ``deadline``: see ``strict``. After the test, every rank
    settles together: messages left unmatched by a failed test are received and dropped, so they
    cannot reach the next test.
    """
    import pytest

    _check(params)
    if "dup" in params:
        raise ValueError("strict_comm_fixture's 'world' is already a duplicate of COMM_WORLD; use world or self")

    @pytest.fixture(params=list(params))
    def strict_comm(request):
        """A strict communicator: sends in synchronous mode, every wait timed, a ledger of traffic per rank."""
        from mpi4py import MPI

        from .strictcomm import strict
        from .timed import settle

        base = MPI.COMM_WORLD if request.param == "world" else MPI.COMM_SELF
        comm, control = base.Dup(), base.Dup()
        sc = strict(comm, timeout, modules, deadline)
        try:
            yield sc
        finally:
            sc.close()
            _, clean = settle(control, sc.ledger, max(timeout, 10.0))
            control.Free()
            if clean:  # a collective left unfinished: the communicator cannot be freed
                comm.Free()

    return strict_comm
