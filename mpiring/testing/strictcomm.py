"""The strict communicator: mpi4py's Comm API with synchronous sends, every wait timed, and a ledger.

    with strict(comm, timeout=3) as sc:
        my_alltoall(x, sc)          # third-party code that takes an mpi4py communicator
    sc.ledger.summary()             # what this rank sent and received

Blocking sends run in synchronous mode (``Send`` as ``Ssend``, ``Isend`` as ``Issend``: MPI's
advice for testing a program's buffering assumptions), so code in which every rank sends before
it receives deadlocks at every message size instead of only past MPI's eager limit. Every
blocking call (point-to-point, collectives through their non-blocking forms, ``Wait*`` on the
requests handed out) polls and raises ``Stuck`` after ``timeout`` seconds, naming the call, the
peer, the tag and the timeout. Collectives with no non-blocking form (``Split``, ``Create_cart``)
are preceded by a timed ``Ibarrier``. Anything else is forwarded untimed and noted.
"""

import pickle
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from ..mpi.collectives import pickled, unpickled
from ..mpi.waits import polls
from . import timed
from .timed import nbytes_of, peer_text, poll, timed_request

__all__ = ["StrictComm", "strict"]


def strict(comm, timeout=timed.DEFAULT_TIMEOUT, modules=(), deadline=None):
    """A ``StrictComm`` over ``comm`` (an mpi4py communicator); ``modules``: whose ``MPI`` name to time too.

    Code that calls ``MPI.Request.Waitall(requests)`` reaches mpi4py's own (untimed) wait unless
    its module is in ``modules`` (module objects or names): while the strict communicator is open
    (``with``, until ``close``) their ``MPI`` is a proxy with timed ``Request`` waits. ``deadline``
    (seconds, off by default): the last resort for waits nothing can time: a request still
    unfinished that long after it was posted, outside any timed call, aborts the job (MPI Abort)
    with what this rank was waiting for. Make it longer than any compute between post and wait.
    """
    if not timeout > 0 or not (deadline is None or deadline > 0):
        raise ValueError(f"timeout and deadline must be positive seconds, got {timeout!r}, {deadline!r}")
    sc = StrictComm(comm, timed.Ledger(timeout, comm.Get_rank()), modules=modules)
    if deadline is not None:
        sc._watch = _Watch(sc.ledger, deadline)
    return sc


class _Watch:
    """``strict(deadline=)``: a thread that aborts the job when a request outlives the deadline outside a timed call."""

    def __init__(self, ledger, deadline):
        self.stop = threading.Event()
        threading.Thread(target=self._run, args=(ledger, deadline), daemon=True).start()

    def _run(self, ledger, deadline):
        while not self.stop.wait(min(0.25, deadline / 4)):
            now = time.perf_counter()
            old = [r for r in ledger.pending() if now - r.posted > deadline]
            if old and ledger.current is None:
                sys.stderr.write(f"strict: rank {ledger.rank}: {timed.request_text(old[0])} unfinished {deadline:g} s "
                                 f"after it was posted, outside any timed wait (an MPI wait the strict communicator "
                                 f"cannot time?); {ledger.state_text()}; aborting the job\n")
                sys.stderr.flush()
                time.sleep(0.2)
                MPI.COMM_WORLD.Abort(5)


class StrictComm:
    """A communicator for code under test: forwards mpi4py's Comm methods, sends synchronously, times every wait.

    ``ledger`` holds this rank's traffic (``ledger.summary()``) and timeline. Anything not
    defined here is forwarded as is (noted in ``ledger.calls``: untimed).
    """

    def __init__(self, comm, ledger, world=False, owned=False, modules=()):
        self._comm, self.ledger, self._world, self._owned = comm, ledger, world, owned
        if not any(c is comm for c in ledger.comms):
            ledger.comms.append(comm)
        import importlib

        self._undo, self._watch = [], None
        for module in modules:
            module = importlib.import_module(module) if isinstance(module, str) else module
            self._undo += timed.instrument(module, ledger.timeout)

    # -- identity and lifetime

    @property
    def mpi_comm(self):
        """The mpi4py communicator this one wraps."""
        return self._comm

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
        return f"<StrictComm rank {self.rank} of {self.size}, timeout {self.ledger.timeout:g} s>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Put back the modules' ``MPI`` names (``strict(..., modules=)``)."""
        timed.uninstrument(self._undo)
        self._undo = []
        if self._watch is not None:
            self._watch.stop.set()

    def _note(self):
        if self._world:
            self.ledger.world_calls += 1

    def _block(self, requests, call, statuses=None, objects=False):
        return poll(requests, call, statuses, objects, ledger=self.ledger)

    # -- point to point

    def _isend(self, buf, dest, tag, call):
        self._note()
        n = nbytes_of(buf)
        self.ledger.count(dest, n)
        req = self._comm.Issend(buf, dest, tag)
        return timed_request(req, "send", dest, f"{call} {peer_text('send', dest, tag, n)}", self.ledger,
                             self._comm, tag)

    def _irecv(self, buf, source, tag, call):
        self._note()
        req = self._comm.Irecv(buf, source, tag)
        return timed_request(req, "recv", source, f"{call} {peer_text('recv', source, tag, nbytes_of(buf))}",
                             self.ledger)

    def _lower_isend(self, obj, dest, tag, call):
        self._note()
        n = len(pickle.dumps(obj))
        self.ledger.count(dest, n)
        self.ledger.pickled += 1
        req = self._comm.issend(obj, dest, tag)
        return timed_request(req, "send", dest, f"{call} {peer_text('send', dest, tag, n)}", self.ledger,
                             self._comm, tag)

    def Send(self, buf, dest, tag=0):
        req = self._isend(buf, dest, tag, "Send")
        self._block([req], f"Send {peer_text('send', dest, tag, nbytes_of(buf))}")

    def Ssend(self, buf, dest, tag=0):
        req = self._isend(buf, dest, tag, "Ssend")
        self._block([req], f"Ssend {peer_text('send', dest, tag, nbytes_of(buf))}")

    Bsend = Rsend = Send

    def Isend(self, buf, dest, tag=0):
        return self._isend(buf, dest, tag, "Isend")

    def Issend(self, buf, dest, tag=0):
        return self._isend(buf, dest, tag, "Issend")

    Ibsend = Irsend = Isend

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        req = self._irecv(buf, source, tag, "Recv")
        self._block([req], f"Recv {peer_text('recv', source, tag, nbytes_of(buf))}", [status])

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        return self._irecv(buf, source, tag, "Irecv")

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        recv = self._irecv(recvbuf, source, recvtag, "Sendrecv")
        send = self._isend(sendbuf, dest, sendtag, "Sendrecv")
        self._block([recv, send], f"Sendrecv {peer_text('send', dest, sendtag, nbytes_of(sendbuf))}, "
                                  f"{peer_text('recv', source, recvtag, None)}", [status, None])

    def Sendrecv_replace(self, buf, dest, sendtag=0, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):
        data = buf[0] if isinstance(buf, (list, tuple)) else buf
        copy = np.array(data, copy=True)
        sendbuf = [copy, *buf[1:]] if isinstance(buf, (list, tuple)) else copy
        self.Sendrecv(sendbuf, dest, sendtag, buf, source, recvtag, status)

    def send(self, obj, dest, tag=0):
        req = self._lower_isend(obj, dest, tag, "send")
        self._block([req], f"send {peer_text('send', dest, tag, None)}")

    ssend = send

    def isend(self, obj, dest, tag=0):
        return self._lower_isend(obj, dest, tag, "isend")

    issend = isend

    def _probe(self, source, tag, status, call):
        """A matched probe, polled so that it can time out: the message (mpi4py ``Message``)."""
        self._note()
        ledger, start, message = self.ledger, time.perf_counter(), [None]
        ledger.current = call

        def arrived():
            message[0] = self._comm.improbe(source, tag, status)
            return message[0] is not None

        try:
            for now in polls(arrived, naps=(5e-5, 2e-3)):  # the one polling loop (mpi.waits)
                if now - start > ledger.timeout:
                    raise timed.Stuck(call, [("recv", source, call)], now - start, ledger.timeout, ledger.rank)
            return message[0]
        finally:
            ledger.current = None
            ledger.note("wait", start=start, end=time.perf_counter(), call=call)

    def _probe_recv(self, source, tag, status, call):
        status = status if status is not None else MPI.Status()
        obj = self._probe(source, tag, status, call).recv(status)
        n = status.Get_count(MPI.BYTE)
        self.ledger.received += n
        self.ledger.received_messages += 1
        self.ledger.received_from[status.Get_source()] += n
        return self.ledger.on_object(obj) if self.ledger.on_object else obj

    def recv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self._probe_recv(source, tag, status, f"recv {peer_text('recv', source, tag, None)}")

    def irecv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self._note()
        req = self._comm.irecv(buf, source, tag)
        return timed_request(req, "recv", source, f"irecv {peer_text('recv', source, tag, None)}", self.ledger)

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        send = self._lower_isend(sendobj, dest, sendtag, "sendrecv")
        obj = self._probe_recv(source, recvtag, status, f"sendrecv {peer_text('recv', source, recvtag, None)}")
        self._block([send], f"sendrecv {peer_text('send', dest, sendtag, None)}")
        return obj

    def Probe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Probe without taking the message: Iprobe polled until it finds one."""
        self._note()
        call, start = f"Probe {peer_text('recv', source, tag, None)}", time.perf_counter()
        while not self._comm.Iprobe(source, tag, status):
            waited = time.perf_counter() - start
            if waited > self.ledger.timeout:
                raise timed.Stuck(call, [("recv", source, call)], waited, self.ledger.timeout, self.ledger.rank)
            time.sleep(1e-4)
        return True

    probe = Probe

    # -- collectives, timed through their non-blocking forms; bytes as a direct algorithm would send them

    def _collective(self, req, call, nbytes=0):
        self._note()
        self.ledger.collectives[call] += 1
        self.ledger.collective_bytes += int(nbytes)
        req = timed_request(req, "collective", None, call, self.ledger)
        self._block([req], call)

    def Barrier(self):
        self._collective(self._comm.Ibarrier(), "Barrier")

    barrier = Barrier

    def Bcast(self, buf, root=0):
        sent = nbytes_of(buf) * (self.size - 1) if self.rank == root else 0
        self._collective(self._comm.Ibcast(buf, root), "Bcast", sent)

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        sent = nbytes_of(sendbuf if sendbuf is not MPI.IN_PLACE else recvbuf) if self.rank != root else 0
        self._collective(self._comm.Ireduce(sendbuf, recvbuf, op, root), "Reduce", sent)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        n = nbytes_of(sendbuf if sendbuf is not MPI.IN_PLACE else recvbuf)
        self._collective(self._comm.Iallreduce(sendbuf, recvbuf, op), "Allreduce", n * (self.size - 1))

    def Gather(self, sendbuf, recvbuf, root=0):
        sent = nbytes_of(sendbuf) if self.rank != root else 0
        self._collective(self._comm.Igather(sendbuf, recvbuf, root), "Gather", sent)

    def Scatter(self, sendbuf, recvbuf, root=0):
        sent = nbytes_of(sendbuf) * (self.size - 1) // self.size if self.rank == root else 0
        self._collective(self._comm.Iscatter(sendbuf, recvbuf, root), "Scatter", sent)

    def Allgather(self, sendbuf, recvbuf):
        self._collective(self._comm.Iallgather(sendbuf, recvbuf), "Allgather", nbytes_of(sendbuf) * (self.size - 1))

    def Allgatherv(self, sendbuf, recvbuf):
        self._collective(self._comm.Iallgatherv(sendbuf, recvbuf), "Allgatherv",
                         nbytes_of(sendbuf) * (self.size - 1))

    def Alltoall(self, sendbuf, recvbuf):
        sent = nbytes_of(sendbuf) * (self.size - 1) // self.size
        self._collective(self._comm.Ialltoall(sendbuf, recvbuf), "Alltoall", sent)

    def Alltoallv(self, sendbuf, recvbuf):
        sent = nbytes_of(sendbuf) * (self.size - 1) // self.size  # as if spread evenly
        self._collective(self._comm.Ialltoallv(sendbuf, recvbuf), "Alltoallv", sent)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        sent = nbytes_of(sendbuf) * (self.size - 1) // self.size
        self._collective(self._comm.Ireduce_scatter_block(sendbuf, recvbuf, op), "Reduce_scatter_block", sent)

    def Scan(self, sendbuf, recvbuf, op=MPI.SUM):
        sent = nbytes_of(sendbuf) if self.rank < self.size - 1 else 0
        self._collective(self._comm.Iscan(sendbuf, recvbuf, op), "Scan", sent)

    def Exscan(self, sendbuf, recvbuf, op=MPI.SUM):
        sent = nbytes_of(sendbuf) if self.rank < self.size - 1 else 0
        self._collective(self._comm.Iexscan(sendbuf, recvbuf, op), "Exscan", sent)

    # lower case: pickled objects, through the non-blocking buffer collectives

    def allgather(self, sendobj):
        data = pickled(sendobj)
        self.ledger.pickled += self.size - 1
        sizes = np.empty(self.size, np.int64)
        self._collective(self._comm.Iallgather(np.array([data.size], np.int64), sizes), "allgather")
        flat = np.empty(int(sizes.sum()), np.uint8)
        self._collective(self._comm.Iallgatherv(data, [flat, sizes]), "allgather", data.nbytes * (self.size - 1))
        return self._objects(unpickled(flat, sizes))

    def _objects(self, objs):
        hook = self.ledger.on_object
        return [hook(x) for x in objs] if hook else objs

    def gather(self, sendobj, root=0):
        data = pickled(sendobj)
        me = self.rank == root
        sizes = np.empty(self.size, np.int64) if me else None
        self._collective(self._comm.Igather(np.array([data.size], np.int64), sizes, root), "gather")
        flat = np.empty(int(sizes.sum()), np.uint8) if me else None
        self._collective(self._comm.Igatherv(data, [flat, sizes] if me else None, root), "gather",
                         0 if me else data.nbytes)
        return self._objects(unpickled(flat, sizes)) if me else None

    def bcast(self, obj=None, root=0):
        me = self.rank == root
        data = pickled(obj) if me else None
        size = np.array([data.size if me else 0], np.int64)
        self._collective(self._comm.Ibcast(size, root), "bcast")
        buf = data.copy() if me else np.empty(int(size[0]), np.uint8)
        self._collective(self._comm.Ibcast(buf, root), "bcast", buf.nbytes * (self.size - 1) if me else 0)
        return self._objects([pickle.loads(buf.tobytes())])[0]

    def reduce(self, sendobj, op=MPI.SUM, root=0):
        values = self.gather(sendobj, root)
        return None if values is None else _fold(values, op)

    def allreduce(self, sendobj, op=MPI.SUM):
        return _fold(self.allgather(sendobj), op)

    def scatter(self, sendobj=None, root=0):
        me = self.rank == root
        if me and (sendobj is None or len(sendobj) != self.size):
            raise ValueError(f"scatter needs a sequence of {self.size} objects on the root")
        pieces = [pickled(x) for x in sendobj] if me else []
        sizes = np.array([p.size for p in pieces], np.int64) if me else None
        mine = np.empty(1, np.int64)
        self._collective(self._comm.Iscatter(sizes, mine, root), "scatter")
        flat = np.concatenate(pieces) if me else None
        buf = np.empty(int(mine[0]), np.uint8)
        sent = int(flat.nbytes - sizes[root]) if me else 0
        self._collective(self._comm.Iscatterv([flat, sizes] if me else None, buf, root), "scatter", sent)
        return self._objects([pickle.loads(buf.tobytes())])[0]

    def alltoall(self, sendobj):
        if len(sendobj) != self.size:
            raise ValueError(f"alltoall needs a sequence of {self.size} objects")
        pieces = [pickled(x) for x in sendobj]
        sizes = np.array([p.size for p in pieces], np.int64)
        got = np.empty(self.size, np.int64)
        self._collective(self._comm.Ialltoall(sizes, got), "alltoall")
        flat = np.empty(int(got.sum()), np.uint8)
        sent = int(sizes.sum() - sizes[self.rank])
        self._collective(self._comm.Ialltoallv([np.concatenate(pieces), sizes], [flat, got]), "alltoall", sent)
        return self._objects(unpickled(flat, got))

    # -- communicators

    def _together(self, what):
        """A timed barrier before a collective MPI has no non-blocking form of."""
        self._collective(self._comm.Ibarrier(), f"{what} (its barrier)")

    def Dup(self):
        self._note()
        self.ledger.collectives["Dup"] += 1
        new, req = self._comm.Idup()
        self._block([timed_request(req, "collective", None, "Dup", self.ledger)], "Dup")
        return StrictComm(new, self.ledger, owned=True)

    Clone = Dup

    def Split(self, color=0, key=0):
        self._together("Split")
        return StrictComm(self._comm.Split(color, key), self.ledger, owned=True)

    def Split_type(self, split_type, key=0, info=MPI.INFO_NULL):
        self._together("Split_type")
        return StrictComm(self._comm.Split_type(split_type, key, info), self.ledger, owned=True)

    def Create_cart(self, dims, periods=None, reorder=False):
        self._together("Create_cart")
        return StrictComm(self._comm.Create_cart(dims, periods, reorder), self.ledger, owned=True)

    def Free(self):
        """Free a communicator this one made (Dup, Split); the one ``strict`` was given stays its owner's."""
        if self._owned and self._comm != MPI.COMM_NULL:
            self._comm.Free()

    def __getattr__(self, name):
        target = getattr(self._comm, name)
        if not callable(target):
            return target
        ledger = self.ledger

        def forwarded(*args, **kwargs):
            ledger.calls[name] += 1
            return target(*args, **kwargs)

        return forwarded

    def traffic(self, timeout=None):
        """Every rank's ``ledger.summary()``, gathered on every rank (collective; a timed all-gather)."""
        from ..mpi.collectives import allgather

        return allgather(self._comm, self.ledger.summary(), timeout or self.ledger.timeout)


def _fold(values, op):
    result = values[0]
    for value in values[1:]:
        result = op(result, value)
    return result
