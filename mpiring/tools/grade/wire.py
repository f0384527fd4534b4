"""The communicator the student's code gets: forwards mpi4py, counts what is sent, times every wait.

``GradedComm`` runs every send in synchronous mode (``Send`` as ``Ssend``, ``Isend`` as
``Issend``) and polls every blocking call with a deadline, raising ``Stuck`` after the ledger's
timeout; ``TimedRequest`` does the same for ``MPI.Request.Wait*``; ``instrument`` points a
student's module's ``MPI`` name at a proxy that hands out both. What a call did is in its ``Ledger``.
"""

import collections
import time

import numpy as np
from mpi4py import MPI

from .flops import mark

__all__ = ["ACTIVE", "DEFAULT_TIMEOUT", "GradedComm", "Ledger", "Stuck", "TimedRequest", "instrument", "nbytes_of",
           "request_text", "size_text"]

DEFAULT_TIMEOUT = 5.0  # seconds any one MPI call of the student's may block
NAP = 5e-5  # first sleep between two polls; grows to NAP_MAX, so waiting ranks leave the cores to working ones
NAP_MAX = 2e-3

class Stuck(BaseException):
    """A call of the student's blocked longer than the timeout (BaseException: ``except Exception`` can't hide it)."""

    def __init__(self, call, waiting, seconds):
        self.call, self.waiting, self.seconds = call, waiting, seconds  # waiting: [(kind, peer, text)]
        super().__init__(f"{call} blocked for {seconds:.3g} s")


class Ledger:
    """What one rank's student did through ``comm`` during one call: traffic, requests, the call in progress."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.requests = []  # every TimedRequest made (pending ones are those not yet REQUEST_NULL)
        self.comms = []  # every communicator the student's messages may be on, in creation order
        self.bytes = 0
        self.messages = 0
        self.pickled = 0  # messages of pickled objects (their bytes include the pickle's framing)
        self.sent_to = collections.Counter()  # dest rank -> bytes
        self.collective_bytes = 0
        self.calls = collections.Counter()  # name -> count, calls forwarded without being timed
        self.world_calls = 0
        self.current = None  # description of the blocking call in progress

    def count(self, dest, nbytes):
        self.bytes += nbytes
        self.messages += 1
        self.sent_to[dest] += nbytes

    def pending(self):
        return [r for r in self.requests if r != MPI.REQUEST_NULL]

    def state_text(self):
        now = f"blocked in {self.current}" if self.current else "not in a call the grader times"
        pending = self.pending()
        if pending:
            now += "; unfinished requests: " + ", ".join(request_text(r) for r in pending[:6])
        if self.calls:
            now += "; untimed calls made: " + ", ".join(f"{n} x{c}" for n, c in self.calls.items())
        return now


class _Active:
    """``ACTIVE.ledger``: the ledger of the student call in progress (for waits on requests), or None."""

    ledger = None


ACTIVE = _Active()


def request_text(request):
    return getattr(request, "text", "a request not made through comm")


def nbytes_of(buf):
    """Bytes of an mpi4py buffer argument: an array, or [array, datatype], [array, count, datatype], ..."""
    if isinstance(buf, (list, tuple)):
        if len(buf) >= 3 and isinstance(buf[1], (int, np.integer)) and isinstance(buf[-1], MPI.Datatype):
            return int(buf[1]) * buf[-1].Get_size()
        return nbytes_of(buf[0]) if buf else 0
    if isinstance(buf, np.ndarray):
        return buf.nbytes
    try:
        return memoryview(buf).nbytes
    except TypeError:
        return 0


def _pickled_bytes(obj):
    return len(MPI.pickle.dumps(obj))


def _poll(requests, call, statuses=None, objects=False, any_one=False):
    """Complete ``requests`` (or one of them) by polling; raise Stuck after the active ledger's timeout.

    Returns the received objects (``objects``) or the index of the completed request (``any_one``).
    """
    ledger = ACTIVE.ledger
    timeout = ledger.timeout if ledger is not None else DEFAULT_TIMEOUT
    start, nap = time.perf_counter(), NAP
    results = [None] * len(requests)
    done = [False] * len(requests)
    if ledger is not None and ledger.current is None:
        ledger.current = call
    try:
        while True:
            for i, req in enumerate(requests):
                if done[i]:
                    continue
                status = statuses[i] if statuses is not None and i < len(statuses) else None
                if objects:
                    done[i], results[i] = MPI.Request.test(req, status)
                else:
                    done[i] = MPI.Request.Test(req, status)
                if done[i] and any_one:
                    return i
            if all(done):
                return [mark(x) for x in results] if objects else None
            waited = time.perf_counter() - start
            if waited > timeout:
                left = [requests[i] for i in range(len(requests)) if not done[i]]
                raise Stuck(call, [(getattr(r, "kind", "?"), getattr(r, "peer", None), request_text(r))
                                   for r in left], waited)
            time.sleep(nap)
            nap = min(2 * nap, NAP_MAX)
    finally:
        if ledger is not None and ledger.current == call:
            ledger.current = None


class TimedRequest(MPI.Request):
    """An mpi4py Request whose waits give up after the grader's timeout, saying what they waited for.

    ``MPI.Request.Waitall`` etc. are replaced by timed versions in the student's module (its name
    ``MPI`` refers to a proxy whose ``Request`` is this class); they accept any requests.
    """

    def Wait(self, status=None):
        _poll([self], f"Wait for {request_text(self)}", [status])
        return True

    def wait(self, status=None):
        return _poll([self], f"wait for {request_text(self)}", [status], objects=True)[0]

    @classmethod
    def Waitall(cls, requests, statuses=None):
        _poll(list(requests), "Waitall", statuses)
        return True

    @classmethod
    def waitall(cls, requests, statuses=None):
        return _poll(list(requests), "waitall", statuses, objects=True)

    @classmethod
    def Waitany(cls, requests, status=None):
        requests = list(requests)
        if all(r == MPI.REQUEST_NULL for r in requests):
            return MPI.UNDEFINED
        return _poll(requests, "Waitany", [status] * len(requests), any_one=True)

    @classmethod
    def waitany(cls, requests, status=None):
        requests = list(requests)
        index = cls.Waitany(requests, status)
        return index, None

    @classmethod
    def Waitsome(cls, requests, statuses=None):
        requests = list(requests)
        if all(r == MPI.REQUEST_NULL for r in requests):
            return None
        _poll(requests, "Waitsome", statuses, any_one=True)
        return [i for i, r in enumerate(requests) if r == MPI.REQUEST_NULL]


def _timed_request(req, kind, peer, text, ledger, comm=None, tag=None):
    timed = TimedRequest(req)
    timed.kind, timed.peer, timed.text, timed.comm, timed.tag = kind, peer, text, comm, tag
    ledger.requests.append(timed)
    return timed


def _peer_text(kind, peer, tag, nbytes):
    where = "to" if kind == "send" else "from"
    who = "any rank" if peer == MPI.ANY_SOURCE else f"rank {peer}"
    tag_text = "any tag" if tag == MPI.ANY_TAG else f"tag {tag}"
    size = f", {size_text(nbytes)}" if nbytes is not None else ""
    return f"{where} {who} ({tag_text}{size})"


class GradedComm:
    """A communicator for the student: forwards mpi4py's Comm methods, counts sends, times blocking calls.

    Sends run in synchronous mode (a blocking send returns only once the receive has started), so
    code that is only correct if MPI buffers its messages fails at every size. Every blocking call
    raises ``Stuck`` after the ledger's timeout. Anything not defined here is forwarded as is
    (and noted in ``ledger.calls``: it is not timed, only ``--time-limit`` ends it).
    """

    def __init__(self, comm, ledger, world=False):
        self._comm, self._ledger, self._world = comm, ledger, world
        if not any(c is comm for c in ledger.comms):
            ledger.comms.append(comm)

    # -- identity

    def Get_rank(self):
        return self._comm.Get_rank()

    def Get_size(self):
        return self._comm.Get_size()

    @property
    def rank(self):
        return self._comm.Get_rank()

    @property
    def size(self):
        return self._comm.Get_size()

    def __repr__(self):
        return f"<GradedComm rank {self.rank} of {self.size}>"

    def _note(self):
        if self._world:
            self._ledger.world_calls += 1

    # -- point to point

    def _isend(self, buf, dest, tag, call):
        self._note()
        n = nbytes_of(buf)
        self._ledger.count(dest, n)
        req = self._comm.Issend(buf, dest, tag)
        return _timed_request(req, "send", dest, f"{call} {_peer_text('send', dest, tag, n)}", self._ledger,
                              self._comm, tag)

    def _irecv(self, buf, source, tag, call):
        self._note()
        req = self._comm.Irecv(buf, source, tag)
        return _timed_request(req, "recv", source, f"{call} {_peer_text('recv', source, tag, nbytes_of(buf))}",
                              self._ledger)

    def _lower_isend(self, obj, dest, tag, call):
        self._note()
        n = _pickled_bytes(obj)
        self._ledger.count(dest, n)
        self._ledger.pickled += 1
        req = self._comm.issend(obj, dest, tag)
        return _timed_request(req, "send", dest, f"{call} {_peer_text('send', dest, tag, n)}", self._ledger,
                              self._comm, tag)

    def _block(self, requests, call, statuses=None, objects=False):
        return _poll(requests, call, statuses, objects)

    def Send(self, buf, dest, tag=0):
        req = self._isend(buf, dest, tag, "Send")
        self._block([req], f"Send {_peer_text('send', dest, tag, nbytes_of(buf))}")

    def Ssend(self, buf, dest, tag=0):
        req = self._isend(buf, dest, tag, "Ssend")
        self._block([req], f"Ssend {_peer_text('send', dest, tag, nbytes_of(buf))}")

    Bsend = Rsend = Send

    def Isend(self, buf, dest, tag=0):
        return self._isend(buf, dest, tag, "Isend")

    def Issend(self, buf, dest, tag=0):
        return self._isend(buf, dest, tag, "Issend")

    Ibsend = Irsend = Isend

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        req = self._irecv(buf, source, tag, "Recv")
        self._block([req], f"Recv {_peer_text('recv', source, tag, nbytes_of(buf))}", [status])

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        return self._irecv(buf, source, tag, "Irecv")

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        recv = self._irecv(recvbuf, source, recvtag, "Sendrecv")
        send = self._isend(sendbuf, dest, sendtag, "Sendrecv")
        self._block([recv, send], f"Sendrecv {_peer_text('send', dest, sendtag, nbytes_of(sendbuf))}, "
                                  f"{_peer_text('recv', source, recvtag, None)}", [status, None])

    def Sendrecv_replace(self, buf, dest, sendtag=0, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):
        data = buf[0] if isinstance(buf, (list, tuple)) else buf
        copy = np.array(data, copy=True)
        sendbuf = [copy, *buf[1:]] if isinstance(buf, (list, tuple)) else copy
        self.Sendrecv(sendbuf, dest, sendtag, buf, source, recvtag, status)

    def send(self, obj, dest, tag=0):
        req = self._lower_isend(obj, dest, tag, "send")
        self._block([req], f"send {_peer_text('send', dest, tag, None)}")

    ssend = send

    def isend(self, obj, dest, tag=0):
        return self._lower_isend(obj, dest, tag, "isend")

    issend = isend

    def _probe_recv(self, source, tag, status, call):
        """A pickled message, received once a matched probe finds it (polled, so it can time out)."""
        self._note()
        ledger, start, nap = self._ledger, time.perf_counter(), NAP
        ledger.current = call
        try:
            while True:
                message = self._comm.improbe(source, tag, status)
                if message is not None:
                    return mark(message.recv(status))
                waited = time.perf_counter() - start
                if waited > ledger.timeout:
                    raise Stuck(call, [("recv", source, call)], waited)
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX)
        finally:
            ledger.current = None

    def recv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self._probe_recv(source, tag, status, f"recv {_peer_text('recv', source, tag, None)}")

    def irecv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self._note()
        req = self._comm.irecv(buf, source, tag)
        return _timed_request(req, "recv", source, f"irecv {_peer_text('recv', source, tag, None)}", self._ledger)

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        send = self._lower_isend(sendobj, dest, sendtag, "sendrecv")
        obj = self._probe_recv(source, recvtag, status, f"sendrecv {_peer_text('recv', source, recvtag, None)}")
        self._block([send], f"sendrecv {_peer_text('send', dest, sendtag, None)}")
        return obj

    # -- collectives (timed through their non-blocking forms)

    def _collective(self, req, call):
        self._note()
        req = _timed_request(req, "collective", None, call, self._ledger)
        self._block([req], call)

    def Barrier(self):
        self._collective(self._comm.Ibarrier(), "Barrier")

    barrier = Barrier

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        self._collective(self._comm.Iallreduce(sendbuf, recvbuf, op), "Allreduce")

    def Bcast(self, buf, root=0):
        if self.rank == root:
            self._ledger.collective_bytes += nbytes_of(buf) * (self.size - 1)
        self._collective(self._comm.Ibcast(buf, root), "Bcast")

    def Allgather(self, sendbuf, recvbuf):
        self._ledger.collective_bytes += nbytes_of(sendbuf) * (self.size - 1)
        self._collective(self._comm.Iallgather(sendbuf, recvbuf), "Allgather")

    def allgather(self, sendobj):
        data = np.frombuffer(MPI.pickle.dumps(sendobj), np.uint8)
        self._ledger.collective_bytes += data.nbytes * (self.size - 1)
        self._ledger.pickled += self.size - 1
        sizes = np.empty(self.size, np.int64)
        self._collective(self._comm.Iallgather(np.array([data.size], np.int64), sizes), "allgather")
        flat = np.empty(int(sizes.sum()), np.uint8)
        self._collective(self._comm.Iallgatherv(data, [flat, sizes]), "allgather")
        edges = np.concatenate([[0], np.cumsum(sizes)])
        return [mark(MPI.pickle.loads(flat[edges[r]:edges[r + 1]].tobytes())) for r in range(self.size)]

    def allreduce(self, sendobj, op=MPI.SUM):
        values = self.allgather(sendobj)
        result = values[0]
        for value in values[1:]:
            result = op(result, value)
        return result

    def bcast(self, obj=None, root=0):
        values = self.allgather(obj if self.rank == root else None)
        return values[root]

    # -- communicators

    def Dup(self):
        self._note()
        return GradedComm(self._comm.Dup(), self._ledger)

    Clone = Dup

    def Free(self):
        if not self._world:
            self._comm.Free()

    def __getattr__(self, name):
        target = getattr(self._comm, name)
        if not callable(target):
            return target
        ledger = self._ledger

        def forwarded(*args, **kwargs):
            ledger.calls[name] += 1
            return target(*args, **kwargs)

        return forwarded


class _MPIProxy:
    """Stands for ``mpi4py.MPI`` in the student's module: timed ``Request`` waits, a counted COMM_WORLD."""

    Request = TimedRequest

    @property
    def COMM_WORLD(self):
        if ACTIVE.ledger is None:
            return MPI.COMM_WORLD
        return GradedComm(MPI.COMM_WORLD, ACTIVE.ledger, world=True)

    def __getattr__(self, name):
        return getattr(MPI, name)


_PROXY = _MPIProxy()


def instrument(module):
    """Point a module's names for ``mpi4py.MPI`` (and ``MPI.Request``) at the timed proxies."""
    for name, value in list(vars(module).items()):
        if value is MPI:
            setattr(module, name, _PROXY)
        elif value is MPI.Request:
            setattr(module, name, TimedRequest)


def size_text(nbytes):
    """``1 KiB``, ``1.5 MiB``, ``512 B``; ``?`` for None."""
    if nbytes is None:
        return "?"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
