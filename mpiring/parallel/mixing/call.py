"""One mixer call: its agreement, its private communicator, and the few verbs its loops use (post, wait, count).

    call = open_call(comm, run, problem, values, n_local, work)   # collective; run = Run.of(**options)
    with call:
        request = call.isend(state, dest, tag)
        call.wait([request], "state from rank 1")

``open_call`` is the agreement every mixer entry point goes through: one
all-gather (``mpi.agree.agreed``) of every rank's problem, the values that
must match, its token count and positions; then every rank builds the same
``MixerPlan`` or raises the same ValueError. The call owns a duplicate of the
caller's communicator (freed on leaving ``with``; abandoned, never freed, if
transfers are still pending after a failure) and counts what its loops send
in ``record``.
"""

import dataclasses
import time

import numpy as np
from mpi4py import MPI

from ...core.record import Record
from ...mpi.agree import agreed, check_comm
from ...mpi.collectives import together
from ...mpi.waits import abandon, completed, wait_until
from ...plans.checks import AUTO_BASE, AUTO_RATE, agreement_timeout, describe, timeout_problem
from ...plans.chunks import MixerSpec

__all__ = ["MixerCall", "Run", "open_call"]


@dataclasses.dataclass(frozen=True)
class Run:
    """One mixer call's options: its ``MixerSpec``, ``timeout`` (seconds, None or "auto") and ``record``."""

    spec: MixerSpec
    timeout: float | str | None = "auto"
    record: Record | None = None

    @classmethod
    def of(cls, spec=None, timeout="auto", record=None, **options):
        """The run of a call's keywords: ``spec=`` or the ``MixerSpec`` options (not both), timeout, record."""
        if spec is None:
            return cls(MixerSpec.of(**options), timeout, record)
        if not isinstance(spec, MixerSpec):
            raise ValueError(f"spec must be an mpiring MixerSpec, got {type(spec).__name__}")
        if options:
            raise ValueError(f"options {sorted(options)} given beside spec=: give them in the spec only")
        return cls(spec, timeout, record)


def open_call(comm, run, problem, values, n_local, work=0.0):
    """Agree on one call (collective): a ``MixerCall`` on every rank, or the same ValueError on every rank.

    ``run``: this rank's ``Run`` (its spec None when ``problem`` says why it could not be made); ``values``: what every
    rank must pass alike; ``work``: the busiest rank's floating-point operations, for ``timeout="auto"``
    (60 s plus the work at 1e8 per second, as the attention calls).
    """
    comm = check_comm(comm)
    shown = held = None
    timeout = run.timeout
    try:
        problem = timeout_problem(timeout) or problem
        if problem is None:
            shown = dict(run.spec.shown(), timeout=timeout, **values)
            held = run.spec.positions
    except Exception as exc:  # reported collectively, never raised alone
        problem, shown = describe(exc), None
    metas = agreed(comm, problem, shown, timeout, (n_local, held), entry=True)
    spec = run.spec
    positions = [m[1] for m in metas] if spec.positions is not None else None
    plan = spec.plan(comm.Get_size(), [m[0] for m in metas], positions)  # the same on every rank, or its error
    seconds = AUTO_BASE + work / AUTO_RATE if isinstance(timeout, str) else timeout
    return MixerCall(comm, plan, spec, seconds, agreement_timeout(timeout), run.record)


class MixerCall:
    """A call's plan, private communicator, timeout and record: what every mixer loop takes."""

    def __init__(self, comm, plan, spec, timeout, agree_timeout, record):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.plan, self.spec, self.timeout = plan, spec, timeout
        self.record = record if record is not None else Record(self.rank)
        self.record.rank = self.rank
        self._requests, self._ordered, self._types = [], {}, []
        self.comm, request = comm.Idup()
        self._requests = [request]
        wait_until(self._requests, agree_timeout, self.rank, "communicator duplicate", sync=True)
        self._requests = []
        self._agree_timeout = agree_timeout
        self._start = time.perf_counter()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.record.wall_time += time.perf_counter() - self._start
        self.free()

    def isend(self, array, dest, tag):
        """Post a send of ``array`` (kept alive until completed) and count it."""
        array = np.ascontiguousarray(array)
        start = time.perf_counter()
        request = self.comm.Isend(array, dest=int(dest), tag=tag)
        self._requests.append((request, array))
        self.record.bytes_sent += array.nbytes
        self.record.messages += 1
        self.record.event("send", start, dest=int(dest), bytes=array.nbytes, tag=tag)
        return request

    def irecv(self, array, source, tag):
        request = self.comm.Irecv(array, source=int(source), tag=tag)
        self._requests.append((request, array))
        return request

    def swap(self, sends, recvs, tag, what):
        """Post a receive into each ``(source, buffer)`` of ``recvs``, then a send of each ``(dest, array)`` of
        ``sends``, and wait for them all."""
        requests = [self.irecv(buffer, source, tag) for source, buffer in recvs]
        requests += [self.isend(array, dest, tag) for dest, array in sends]
        self.wait(requests, what)

    def wait(self, requests, what):
        """Complete ``requests`` within the call's timeout; the time blocked is this rank's wait."""
        start = time.perf_counter()
        try:
            wait_until(list(requests), self.timeout, self.rank, what, start)
        finally:
            end = time.perf_counter()
            self.record.wait_time += end - start
            self.record.events.append(("wait", start, end, {"what": what}))
        done = {id(r) for r in requests}
        self._requests = [(r, a) for r, a in self._requests if id(r) not in done]

    def datatype(self, dtype, count):
        """A committed contiguous datatype of ``count`` values of ``dtype`` (one map: an element MPI never splits),
        freed with the call."""
        datatype = MPI._typedict[np.dtype(dtype).char].Create_contiguous(int(count)).Commit()
        self._types.append(datatype)
        return datatype

    def ordered(self, order):
        """A communicator whose rank i is this communicator's rank ``order[i]`` (this one for 0, 1, 2, ...)."""
        order = [int(r) for r in order]
        if order == list(range(self.size)):
            return self.comm
        key = tuple(order)
        if key not in self._ordered:
            together(self.comm, self._agree_timeout, "communicator split")  # a failed rank cannot stall Split
            self._ordered[key] = self.comm.Split(0, order.index(self.rank))
        return self._ordered[key]

    def free(self):
        """Free the communicators and datatypes, or abandon them if a transfer is still pending (an error path)."""
        pending = [r for r, _ in self._requests]
        if pending and not completed(pending):
            abandon((self.comm, self._requests, list(self._ordered.values()), self._types))
        else:
            for comm in [self.comm, *self._ordered.values()]:
                if comm != MPI.COMM_NULL:
                    comm.Free()
            for datatype in self._types:
                datatype.Free()
        self._requests, self._ordered, self._types = [], {}, []
        self.comm = MPI.COMM_NULL
