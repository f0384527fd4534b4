"""Grade a ring attention written by a student: right answers, a ring's traffic, and no unsafe MPI.

    mpiexec -n 4 python -m mpiring.tools.grade student.py
    mpiexec -n 4 python -m mpiring.tools.grade --exercise merge examples/exercises/01_merge.py
    mpiexec -n 3 python -m mpiring.tools.grade --quick --timeout 2 student.py

``student.py`` defines ``ring_attention(q, k, v, comm, causal=False)``: q, k, v are this rank's
contiguous shard (H, n, D) of a sequence of n * P tokens, and it returns this rank's output
(H, n, D). The grader runs it on a matrix of cases (messages of n * H * D * itemsize bytes from
1 KiB to 1 MiB, float32 and float64, causal and not) on as many ranks as it was launched with,
and checks, per case:

- output: every rank's output against ``mpiring.testing.reference`` within ``testing.TOLERANCE``;
  a wrong one is classified from the numbers (merged without the log-sum-exp rescale, a causal
  mask shifted by a block, a block missing, the wrong softmax scale, NaN) and gets a hint;
- traffic: the bytes each rank sent through ``comm`` against the cost model, (P - 1) K/V blocks
  per rank, i.e. 2 (P - 1) messages of n * H * D * itemsize bytes;
- safety: every rank returned, without an exception, a stuck call or an unfinished request.

``comm`` is a wrapper that forwards mpi4py's Comm methods and counts what is sent. It runs every
send in synchronous mode (``Send`` as ``Ssend``, ``Isend`` as ``Issend``, MPI's advice for
testing a program's buffering assumptions), so a ring in which every rank sends before it
receives deadlocks at every size instead of only above the eager limit; every blocking call
polls with a deadline (``--timeout``), so a stuck ring is reported ("unsafe: rank 0 blocked in
Send to rank 1 for 5 s ...") and the job still ends, on every rank, with a non-zero exit code.
``MPI.Request.Waitall`` and friends, looked up through the ``MPI`` name of the student's module,
are timed too; anything else that never returns is ended by ``--time-limit`` (comm.Abort).

``--exercise NAME`` grades one exercise of docs/exercises.md instead (merge, ring, causal,
zigzag, bidirectional, backward). Exit code 0 only if every check passes, on every rank.
Output is printed by rank 0.
"""

import argparse
import collections
import importlib.util
import math
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from .. import shard_indices, testing

__all__ = ["EXERCISES", "GradedComm", "TimedRequest", "grade", "main"]

DEFAULT_TIMEOUT = 5.0  # seconds any one MPI call of the student's may block
DEFAULT_TIME_LIMIT = 120.0  # seconds one call of the student's function may take in all
NAP = 5e-5  # first sleep between two polls; grows to NAP_MAX, so waiting ranks leave the cores to working ones
NAP_MAX = 2e-3
ALLOWANCE = 512  # bytes a pickled message (send, isend, allgather, ...) may carry above its array data


# ---------------------------------------------------------------- timed MPI for the student


class Stuck(BaseException):
    """A call of the student's blocked longer than the timeout (BaseException: ``except Exception`` can't hide it)."""

    def __init__(self, call, waiting, seconds):
        self.call, self.waiting, self.seconds = call, waiting, seconds  # waiting: [(kind, peer, text)]
        super().__init__(f"{call} blocked for {seconds:.3g} s")


class _Lost(Exception):
    """The grader's own communication with the other ranks did not complete in time."""


class _Ledger:
    """What one rank's student did through ``comm`` during one call: traffic, requests, time in MPI."""

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
        self.mpi_cpu = 0.0  # process time spent in calls made through comm
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
            now += "; unfinished requests: " + ", ".join(_request_text(r) for r in pending[:6])
        if self.calls:
            now += "; untimed calls made: " + ", ".join(f"{n} x{c}" for n, c in self.calls.items())
        return now


_ACTIVE = None  # the ledger of the student call in progress (for waits on requests)


def _request_text(request):
    return getattr(request, "_text", "a request not made through comm")


def _nbytes(buf):
    """Bytes of an mpi4py buffer argument: an array, or [array, datatype], [array, count, datatype], ..."""
    if isinstance(buf, (list, tuple)):
        if len(buf) >= 3 and isinstance(buf[1], (int, np.integer)) and isinstance(buf[-1], MPI.Datatype):
            return int(buf[1]) * buf[-1].Get_size()
        return _nbytes(buf[0]) if buf else 0
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
    ledger = _ACTIVE
    timeout = ledger.timeout if ledger is not None else DEFAULT_TIMEOUT
    start, cpu, nap = time.perf_counter(), time.process_time(), NAP
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
                return results if objects else None
            waited = time.perf_counter() - start
            if waited > timeout:
                left = [requests[i] for i in range(len(requests)) if not done[i]]
                raise Stuck(call, [(getattr(r, "_kind", "?"), getattr(r, "_peer", None), _request_text(r))
                                   for r in left], waited)
            time.sleep(nap)
            nap = min(2 * nap, NAP_MAX)
    finally:
        if ledger is not None:
            ledger.mpi_cpu += time.process_time() - cpu
            if ledger.current == call:
                ledger.current = None


class TimedRequest(MPI.Request):
    """An mpi4py Request whose waits give up after the grader's timeout, saying what they waited for.

    ``MPI.Request.Waitall`` etc. are replaced by timed versions in the student's module (its name
    ``MPI`` refers to a proxy whose ``Request`` is this class); they accept any requests.
    """

    def Wait(self, status=None):
        _poll([self], f"Wait for {_request_text(self)}", [status])
        return True

    def wait(self, status=None):
        return _poll([self], f"wait for {_request_text(self)}", [status], objects=True)[0]

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
    timed._kind, timed._peer, timed._text, timed._comm, timed._tag = kind, peer, text, comm, tag
    ledger.requests.append(timed)
    return timed


def _peer_text(kind, peer, tag, nbytes):
    where = "to" if kind == "send" else "from"
    who = "any rank" if peer == MPI.ANY_SOURCE else f"rank {peer}"
    tag_text = "any tag" if tag == MPI.ANY_TAG else f"tag {tag}"
    size = f", {_size(nbytes)}" if nbytes is not None else ""
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
        n = _nbytes(buf)
        self._ledger.count(dest, n)
        req = self._comm.Issend(buf, dest, tag)
        return _timed_request(req, "send", dest, f"{call} {_peer_text('send', dest, tag, n)}", self._ledger,
                              self._comm, tag)

    def _irecv(self, buf, source, tag, call):
        self._note()
        req = self._comm.Irecv(buf, source, tag)
        return _timed_request(req, "recv", source, f"{call} {_peer_text('recv', source, tag, _nbytes(buf))}",
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
        self._block([req], f"Send {_peer_text('send', dest, tag, _nbytes(buf))}")

    def Ssend(self, buf, dest, tag=0):
        req = self._isend(buf, dest, tag, "Ssend")
        self._block([req], f"Ssend {_peer_text('send', dest, tag, _nbytes(buf))}")

    Bsend = Rsend = Send

    def Isend(self, buf, dest, tag=0):
        return self._isend(buf, dest, tag, "Isend")

    def Issend(self, buf, dest, tag=0):
        return self._isend(buf, dest, tag, "Issend")

    Ibsend = Irsend = Isend

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        req = self._irecv(buf, source, tag, "Recv")
        self._block([req], f"Recv {_peer_text('recv', source, tag, _nbytes(buf))}", [status])

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        return self._irecv(buf, source, tag, "Irecv")

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        recv = self._irecv(recvbuf, source, recvtag, "Sendrecv")
        send = self._isend(sendbuf, dest, sendtag, "Sendrecv")
        self._block([recv, send], f"Sendrecv {_peer_text('send', dest, sendtag, _nbytes(sendbuf))}, "
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
        ledger, start, cpu, nap = self._ledger, time.perf_counter(), time.process_time(), NAP
        ledger.current = call
        try:
            while True:
                message = self._comm.improbe(source, tag, status)
                if message is not None:
                    return message.recv(status)
                waited = time.perf_counter() - start
                if waited > ledger.timeout:
                    raise Stuck(call, [("recv", source, call)], waited)
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX)
        finally:
            ledger.current = None
            ledger.mpi_cpu += time.process_time() - cpu

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
            self._ledger.collective_bytes += _nbytes(buf) * (self.size - 1)
        self._collective(self._comm.Ibcast(buf, root), "Bcast")

    def Allgather(self, sendbuf, recvbuf):
        self._ledger.collective_bytes += _nbytes(sendbuf) * (self.size - 1)
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
        return [MPI.pickle.loads(flat[edges[r]:edges[r + 1]].tobytes()) for r in range(self.size)]

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
        if _ACTIVE is None:
            return MPI.COMM_WORLD
        return GradedComm(MPI.COMM_WORLD, _ACTIVE, world=True)

    def __getattr__(self, name):
        return getattr(MPI, name)


# ---------------------------------------------------------------- the grader's own communication


def _wait_for(requests, timeout, what):
    start = time.perf_counter()
    while not MPI.Request.Testall(requests):
        if time.perf_counter() - start > timeout:
            raise _Lost(f"{what}: the other ranks did not join within {timeout:g} s")
        time.sleep(2e-4)


def _allgather(comm, obj, timeout, what="exchange of results"):
    data = np.frombuffer(MPI.pickle.dumps(obj), np.uint8)
    sizes = np.empty(comm.Get_size(), np.int64)
    _wait_for([comm.Iallgather(np.array([data.size], np.int64), sizes)], timeout, what)
    flat = np.empty(int(sizes.sum()), np.uint8)
    _wait_for([comm.Iallgatherv(data, [flat, sizes])], timeout, what)
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return [MPI.pickle.loads(flat[edges[r]:edges[r + 1]].tobytes()) for r in range(comm.Get_size())]


def _fatal(comm, message, code=3):
    """Last resort: say why on stderr, give the launcher a moment to forward it, and abort the job."""
    sys.stdout.flush()
    sys.stderr.write(f"grade: rank {comm.Get_rank()}: {message}; aborting the job\n")
    sys.stderr.flush()
    time.sleep(0.3)
    comm.Abort(code)


def _drain(gcomm, ledger, timeout):
    """Bring the student's communicators back to a clean state after a call, whatever it left behind.

    Unfinished receives are cancelled; unfinished sends are matched by receives posted here (every
    rank learns which sends are addressed to it), so no message is left in flight and every
    communicator can be freed. Returns ``(unfinished requests as text, clean)``; ``clean`` is False
    when a collective was left unfinished somewhere (those cannot be cancelled: the job must abort).
    """
    left = [_request_text(r) for r in ledger.pending()]
    states = _allgather(gcomm, (bool(left), any(getattr(r, "_kind", None) == "collective" for r in ledger.pending())),
                        timeout, "clean-up")
    if not any(pending for pending, _ in states):
        return left, True
    if any(collective for _, collective in states):
        return left, False
    receives = [r for r in ledger.pending() if getattr(r, "_kind", None) == "recv"]
    for req in receives:
        try:
            req.Cancel()
        except MPI.Exception:
            pass
    _wait_for(receives, timeout, "cancelling unfinished receives")
    _wait_for([gcomm.Ibarrier()], timeout, "clean-up")  # from here on no receive of the student's can match
    # Rounds: every rank lists its sends still unfinished; each receiver takes the listed messages it
    # can probe. A listed send whose message was already matched (by a receive that completed before
    # it was cancelled) finishes on its own, and leaves the list in a later round.
    index = {id(c): i for i, c in enumerate(ledger.comms)}
    me, start = gcomm.Get_rank(), time.perf_counter()
    while True:
        sends = [r for r in ledger.pending() if getattr(r, "_kind", None) == "send"]
        MPI.Request.Testall(sends)
        listed = [(index[id(r._comm)], r._peer, r._tag) for r in ledger.pending()
                  if getattr(r, "_kind", None) == "send"]
        everyone = _allgather(gcomm, listed, timeout, "clean-up")
        if not any(everyone):
            break
        if time.perf_counter() - start > timeout:
            raise _Lost("clean-up: unfinished sends of the student's could not be matched")
        for source, theirs in enumerate(everyone):
            for i, dest, tag in theirs:
                status = MPI.Status()
                if dest == me and ledger.comms[i].Iprobe(source, tag, status):
                    ledger.comms[i].Recv(bytearray(status.Get_count(MPI.BYTE)), source, status.Get_tag())
        time.sleep(1e-3)
    _wait_for([gcomm.Ibarrier()], timeout, "clean-up")
    return left, True


# ---------------------------------------------------------------- exercises and cases


SIZES = {  # name: (H, n, D) of each rank's shard; a K or V message is n * H * D * itemsize bytes
    "tiny": (1, 8, 16),  # 1 KiB in float64
    "small": (2, 32, 16),  # 8 KiB
    "medium": (4, 64, 32),  # 64 KiB
    "large": (4, 512, 64),  # 1 MiB
}
DTYPES = (np.float64, np.float32)


@dataclass(frozen=True)
class Exercise:
    name: str
    function: str
    title: str
    signature: str
    kind: str = "forward"  # forward | backward | merge
    layout: str = "contiguous"
    causal: tuple = (False, True)
    work: str | None = None  # None | "skip" (causal skipping) | "balance" (zigzag)
    directions: bool = False  # bidirectional: both neighbours, at most floor(P/2) blocks each way


_RING = "ring_attention(q, k, v, comm, causal=False) -> out"
EXERCISES = {
    "forward": Exercise("forward", "ring_attention", "ring attention, causal and not", _RING),
    "merge": Exercise("merge", "merge", "merge two softmax blocks", "merge(out1, lse1, out2, lse2) -> (out, lse)",
                      kind="merge"),
    "ring": Exercise("ring", "ring_attention", "the ring loop (non-causal)", _RING, causal=(False,)),
    "causal": Exercise("causal", "ring_attention", "causal skipping", _RING, work="skip"),
    "zigzag": Exercise("zigzag", "ring_attention", "zigzag balance (q, k, v are zigzag shards)", _RING,
                       layout="zigzag", work="balance"),
    "bidirectional": Exercise("bidirectional", "ring_attention", "bidirectional ring", _RING, directions=True),
    "backward": Exercise("backward", "ring_attention_backward", "the backward pass",
                         "ring_attention_backward(dout, q, k, v, out, lse, comm, causal=False) -> (dq, dk, dv)",
                         kind="backward"),
}
WORK_SIZE = "large"  # the case whose compute time the work checks measure
# Thresholds of the work checks. Measured with the solutions on a 2-core machine (least of 3 runs):
# rank 0 / rank P-1 is about 0.7 at P = 2 (the masked diagonal block costs more than a full one)
# and 0.3 at P = 4, against 1.0 or more without skipping; zigzag max/min about 1.0-1.2, and causal /
# non-causal work 0.7-0.8, against about 1.5 without skipping.
SKIP_RATIO = 0.9
BALANCE_RATIO = 1.4
SAVED_RATIO = 0.95


@dataclass(frozen=True)
class Case:
    size: str
    dtype: type
    causal: bool
    seed: int

    @property
    def shape(self):
        return SIZES[self.size]

    @property
    def message(self):
        """Bytes of one K (or V) shard: n * H * D * itemsize."""
        h, n, d = self.shape
        return h * n * d * np.dtype(self.dtype).itemsize

    @property
    def label(self):
        h, n, d = self.shape
        return f"H={h} n={n} D={d} {np.dtype(self.dtype).name} {'causal' if self.causal else 'non-causal'}"


def make_cases(exercise, quick=False):
    """The case matrix: every size x dtype x causal option, or with ``quick`` four of them
    (plus the float64 'large' cases a work check measures)."""
    if quick:
        picks = [("tiny", np.float64), ("tiny", np.float32), ("medium", np.float64), ("medium", np.float32)]
        combos = [(size, dtype, exercise.causal[i % len(exercise.causal)]) for i, (size, dtype) in enumerate(picks)]
    else:
        combos = [(size, dtype, causal) for size in SIZES for dtype in DTYPES for causal in exercise.causal]
    unique = list(dict.fromkeys(combos))
    return [Case(size, dtype, causal, seed=1000 + i) for i, (size, dtype, causal) in enumerate(unique)]


def _size(nbytes):
    if nbytes is None:
        return "?"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------- the student's module


def load_student(path, function):
    """Import the student's file; its ``MPI`` (and ``Request``) names are pointed at the timed proxies."""
    path = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location("student", path)
    if spec is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec.loader.exec_module(module)
    for name, value in list(vars(module).items()):
        if value is MPI:
            setattr(module, name, _PROXY)
        elif value is MPI.Request:
            setattr(module, name, TimedRequest)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise TypeError(f"{os.path.basename(path)} defines no function {function}")
    return fn


_PROXY = _MPIProxy()


def _student_trace(exc, path):
    """The traceback lines that lie in the student's file, and the exception itself."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == path]
    lines = [f"  {os.path.basename(f.filename)}, line {f.lineno}, in {f.name}: {(f.line or '').strip()}"
             for f in frames[-4:]]
    return "\n".join(lines + [f"  {type(exc).__name__}: {exc}"])


@dataclass
class Run:
    """What one rank saw in one call of the student's function."""

    outcome: str = "returned"  # returned | raised | stuck
    value: object = None
    error: str = ""
    exception: str = ""
    stuck: tuple | None = None  # (call, [(kind, peer, text)], seconds)
    bytes: int = 0
    messages: int = 0
    pickled: int = 0
    sent_to: dict = field(default_factory=dict)
    collective_bytes: int = 0
    calls: dict = field(default_factory=dict)
    world_calls: int = 0
    cpu: float = 0.0
    left: list = field(default_factory=list)
    clean: bool = True


def _watchdog(limit, ledger, rank, what):
    def fire():
        sys.stdout.flush()
        sys.stderr.write(f"grade: rank {rank}: {what} has not returned after {limit:g} s (--time-limit); it is "
                         f"{ledger.state_text()}; aborting the job\n")
        sys.stderr.flush()
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(4)

    timer = threading.Timer(limit, fire)
    timer.daemon = True
    timer.start()
    return timer


def call_student(call, gcomm, opts, what):
    """Run ``call(comm)`` with a fresh GradedComm; every rank then cleans up together. Returns a Run."""
    global _ACTIVE
    from threadpoolctl import threadpool_limits

    scomm = gcomm.Dup()
    ledger = _Ledger(opts.timeout)
    comm = GradedComm(scomm, ledger)
    run = Run()
    _ACTIVE = ledger
    timer = _watchdog(opts.time_limit, ledger, gcomm.Get_rank(), what)
    cpu = time.process_time()
    try:
        with threadpool_limits(1):  # compute time per rank is then the work it did
            run.value = call(comm)
    except Stuck as exc:
        run.outcome, run.stuck = "stuck", (exc.call, exc.waiting, exc.seconds)
    except (Exception, SystemExit) as exc:  # noqa: BLE001  any error of the student's is reported
        run.outcome = "raised"
        run.exception = f"{type(exc).__name__}: {exc}"
        run.error = _student_trace(exc, opts.path)
    finally:
        timer.cancel()
        _ACTIVE = None
        run.cpu = time.process_time() - cpu - ledger.mpi_cpu
    run.bytes, run.messages, run.pickled = ledger.bytes, ledger.messages, ledger.pickled
    run.sent_to = dict(ledger.sent_to)
    run.collective_bytes, run.calls, run.world_calls = ledger.collective_bytes, dict(ledger.calls), ledger.world_calls
    run.left, run.clean = _drain(gcomm, ledger, opts.sync_timeout)
    if run.clean:
        for c in ledger.comms:
            if c is not MPI.COMM_WORLD and c != MPI.COMM_NULL:
                c.Free()
    return run


# ---------------------------------------------------------------- what a wrong output is likely to be


STATE_TEXT = {"none": "skipped", "full": "attended in full",
              "tri": "masked with the causal triangle (np.tril of the block)",
              "causal": "attended with the causal mask j <= i of global positions"}


def _merge_blocks(parts, shape):
    """Exact log-sum-exp merge of block (out, lse) pairs; rows no block sees get 0."""
    if not parts:
        return np.zeros(shape)
    outs = np.stack([o for o, _ in parts])
    lses = np.stack([lse for _, lse in parts])
    m = lses.max(axis=0)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lses - m)
    total = w.sum(axis=0)
    return (w[..., None] * outs).sum(axis=0) / np.where(total > 0, total, 1.0)[..., None]


def _block_states(q, K, V, idx, positions, causal):
    """Per source rank s: ({state: (out, lse) or None}, true state) for the ways its block could be masked.

    States: skipped, in full, with the triangle of local offsets (what np.tril gives: the right mask
    for a rank's own block), and with the exact causal mask of global positions when that is
    none of these (e.g. the half-visible off-diagonal blocks of zigzag shards).
    """
    blocks = []
    for ks in positions:
        k, v = K[..., ks, :], V[..., ks, :]
        mask = testing.dense_mask(idx, ks, causal=True)
        local = testing.dense_mask(np.arange(len(idx)), np.arange(len(ks)), causal=True)
        states = {"none": None, "full": testing.reference(q, k, v, q_positions=idx, k_positions=ks)}
        if local.any() and not local.all():
            states["tri"] = testing.reference(q, k, v, causal=True)
        if mask.any() and not mask.all() and not np.array_equal(mask, local):
            states["causal"] = testing.reference(q, k, v, causal=True, q_positions=idx, k_positions=ks)
        if not causal or mask.all():
            truth = "full"
        elif not mask.any():
            truth = "none"
        else:
            truth = "tri" if np.array_equal(mask, local) else "causal"
        blocks.append((states, truth))
    return blocks


def diagnose_forward(got, ref, q, K, V, idx, positions, causal, tol, rank):
    """Hints for a wrong forward output, from the numbers alone (list of (kind, text))."""
    got = np.asarray(got, dtype=np.float64)
    bad = ~np.isfinite(got)
    if bad.any():
        h, i = (int(x) for x in np.argwhere(bad)[0][:2])
        return [("nan", (f"{int(bad.sum())} NaN/Inf values (the first in head {h}, row {i}): a block with no "
                        f"visible key has lse = -inf, and exp(-inf - (-inf)) is NaN; skip blocks a row cannot see, "
                        f"or guard the merge when both lse are -inf"))]
    match = max(100 * tol, 1e-9)
    hints = []
    d = q.shape[-1]
    for scale, name in ((1.0, "1"), (1.0 / d, "1/D")):
        alt, _ = testing.reference(q, K, V, causal=causal, q_positions=idx, scale=scale)
        if testing.attention_error(got, alt)[0] <= match:
            hints.append(("scale", f"your output is attention with softmax scale {name}; the scale is 1/sqrt(D)"))
    if hints:
        return hints
    blocks = _block_states(q, K, V, idx, positions, causal)
    truth = [t for _, t in blocks]
    options = [list(states) for states, _ in blocks]
    if math.prod(len(o) for o in options) <= 4096:
        import itertools

        combos = itertools.product(*options)
    else:  # many ranks: combinations that differ from the truth in one or two blocks
        combos = [tuple(truth[:a]) + (x,) + tuple(truth[a + 1:]) for a, o in enumerate(options) for x in o]
    best = (np.inf, None)
    for combo in combos:
        if list(combo) == truth:
            continue
        parts = [blocks[s][0][state] for s, state in enumerate(combo) if state != "none"]
        err = float(np.max(np.abs(got - _merge_blocks(parts, got.shape)), initial=0.0))
        if err < best[0]:
            best = (err, combo)
    if best[0] <= match:
        combo = best[1]
        diffs = [f"rank {s}'s K/V block is {STATE_TEXT[c]} (it must be {STATE_TEXT[t]})"
                 for s, (c, t) in enumerate(zip(combo, truth)) if c != t]
        if causal:
            advice = ("causal mask off by one block? With contiguous shards rank r sees the block of rank s in full "
                  "when s < r, with the triangle when s == r, and not at all when s > r")
        elif all(c == "none" for c, t in zip(combo, truth) if c != t):
            advice = "does your loop attend to all P blocks, its own and the P - 1 it receives?"
        else:
            advice = "only the causal case masks anything"
        return [("mask", f"rank {rank}'s output is exactly attention in which " + "; ".join(diffs) + f": {advice}")]
    visible = [(s, blocks[s][0][t]) for s, t in enumerate(truth) if t != "none"]
    if 1 <= len(visible) < d:
        hint = _span_hint(got, ref, visible, tol, rank)
        if hint:
            return [hint]
    rows = np.nonzero(np.max(np.abs(got - ref), axis=tuple(a for a in range(got.ndim) if a != got.ndim - 2))
                      > tol)[0]
    n = got.shape[-2]
    where = f"rows {rows[0]}..{rows[-1]} of its {n}" if len(rows) else "no row"
    text = f"rank {rank}: the error is in {len(rows)} of {n} rows ({where})"
    if causal:
        text += "; causal mask off by one block or one token? query i sees key j only when j <= i (global positions)"
    return [("other", text)]


def _span_hint(got, ref, visible, tol, rank):
    """If every row is some mix of the per-block outputs, the blocks were merged with the wrong weights."""
    outs = np.stack([o for _, (o, _) in visible], axis=-2)  # (..., n, m, D)
    lses = np.stack([lse for _, (_, lse) in visible], axis=-1)  # (..., n, m)
    a = outs.reshape((-1,) + outs.shape[-2:])
    x = got.reshape(-1, got.shape[-1])
    w = np.einsum("bd,bdm->bm", x, np.linalg.pinv(a))
    residual = np.linalg.norm(x - np.einsum("bm,bmd->bd", w, a), axis=-1)
    scale = np.maximum(np.linalg.norm(x, axis=-1), 1e-300)
    if np.max(residual / scale) > max(1e3 * tol, 1e-6):
        return None
    err = np.max(np.abs(got - ref), axis=-1).reshape(-1)
    row = int(np.argmax(err))
    lse = lses.reshape(-1, lses.shape[-1])[row]
    right = np.exp(lse - np.max(lse))
    right /= right.sum()
    names = [f"O{s}" for s, _ in visible]
    yours = " + ".join(f"{c:.2f} {nm}" for c, nm in zip(w[row], names))
    rule = " + ".join(f"{c:.2f} {nm}" for c, nm in zip(right, names))
    n_rows = got.shape[-2]
    text = (f"did you rescale with the log-sum-exp when merging? Rank {rank}, row {row % n_rows} (head "
            f"{row // n_rows}): your output is {yours}, where Os is the attention to rank s's K/V block alone; "
            f"the log-sum-exp rule gives {rule} (out = sum_s exp(lse_s - lse) Os, lse = log sum_s exp(lse_s))")
    factor = w[row] / np.where(right > 0, right, np.nan)
    if np.nanmax(factor) - np.nanmin(factor) < 1e-6 * max(1.0, abs(np.nanmax(factor))):
        text += f"; the row is off by a factor {np.nanmax(factor):.3g}"
    return ("merge", text)


# ---------------------------------------------------------------- running one case on this rank


def _arrays(case, count, seq_len, kv_heads=None):
    rng = np.random.default_rng(case.seed)
    h, _, d = case.shape
    return [rng.standard_normal((h, seq_len, d)).astype(case.dtype) for _ in range(count)]


def run_forward_case(case, exercise, fn, gcomm, opts, check_output=True):
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    S = case.shape[1] * P
    Q, K, V = _arrays(case, 3, S)
    positions = [shard_indices(S, P, s, exercise.layout) for s in range(P)]
    idx = positions[rank]
    q, k, v = (np.ascontiguousarray(X[..., idx, :]) for X in (Q, K, V))
    run = call_student(lambda comm: fn(q.copy(), k.copy(), v.copy(), comm, causal=case.causal), gcomm, opts,
                       exercise.function)
    check = {"ok": False, "error": None, "text": "", "hints": []}
    if run.outcome == "returned" and check_output:
        got = run.value
        if isinstance(got, tuple) and len(got) == 2 and np.shape(got[0]) == q.shape:
            got = got[0]  # (out, lse) is fine too
        if not isinstance(got, np.ndarray) or got.shape != q.shape:
            shape = got.shape if isinstance(got, np.ndarray) else type(got).__name__
            check["text"] = f"rank {rank} returned {shape}, expected an array of shape (H, n, D) = {q.shape}"
        else:
            ref, _ = testing.reference(q, K, V, causal=case.causal, q_positions=idx)
            tol = testing.tolerance(case.dtype)
            err, index = testing.attention_error(got, ref)
            check.update(ok=err <= tol, error=err, index=index, tol=tol)
            if err > tol:
                check["text"] = f"max error {err:.3g} at rank {rank} (head, row, col) = {index}, tolerance {tol:g}"
                check["hints"] = diagnose_forward(got, ref, q, K, V, idx, positions, case.causal, tol, rank)
    run.value = None
    return run, check


def _timed_sum(comm, a, timeout):
    out = np.empty_like(a)
    _wait_for([comm.Iallreduce(a, out, MPI.SUM)], timeout, "reference gradients")
    return out


def run_backward_case(case, exercise, fn, gcomm, opts):
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    S = case.shape[1] * P
    Q, K, V, dO = _arrays(case, 4, S)
    positions = [shard_indices(S, P, s, exercise.layout) for s in range(P)]
    idx = positions[rank]
    q, k, v, do = (np.ascontiguousarray(X[..., idx, :]) for X in (Q, K, V, dO))
    out, lse = (a.astype(case.dtype) for a in testing.reference(q, K, V, causal=case.causal, q_positions=idx))
    run = call_student(lambda comm: fn(do.copy(), q.copy(), k.copy(), v.copy(), out.copy(), lse.copy(), comm,
                                       causal=case.causal), gcomm, opts, exercise.function)
    # reference: each rank's queries contribute to every key's gradient; the contributions are summed
    dq, dk_part, dv_part = testing.reference_backward(do, q, K, V, causal=case.causal, q_positions=idx)
    dk_all = _timed_sum(gcomm, dk_part, opts.sync_timeout)
    dv_all = _timed_sum(gcomm, dv_part, opts.sync_timeout)
    check = {"ok": False, "error": None, "text": "", "hints": []}
    if run.outcome == "returned":
        got = run.value
        if not (isinstance(got, (tuple, list)) and len(got) == 3
                and all(isinstance(g, np.ndarray) and g.shape == q.shape for g in got)):
            check["text"] = f"rank {rank} must return (dq, dk, dv), three arrays of shape {q.shape}"
        else:
            tol = testing.tolerance(case.dtype)
            refs = {"dq": dq, "dk": dk_all[..., idx, :], "dv": dv_all[..., idx, :]}
            errors = {name: testing.attention_error(g, refs[name], name) for name, g in zip(refs, got)}
            name, (err, index) = max(errors.items(), key=lambda item: item[1][0])
            check.update(ok=err <= tol, error=err, index=index, tol=tol)
            if err > tol:
                wrong = [nm for nm, (e, _) in errors.items() if e > tol]
                check["text"] = (f"{', '.join(wrong)} wrong: max relative error {err:.3g} in {name} at rank {rank} "
                                 f"{index}, tolerance {tol:g}")
                check["hints"] = _diagnose_backward(got, refs, errors, tol, dk_all, dv_all, dk_part, dv_part,
                                                    positions, idx, rank)
    run.value = None
    return run, check


def _diagnose_backward(got, refs, errors, tol, dk_all, dv_all, dk_part, dv_part, positions, idx, rank):
    hints = []
    _, dk, dv = got
    if errors["dk"][0] > tol or errors["dv"][0] > tol:
        for s, ks in enumerate(positions):
            if s != rank and len(ks) == len(idx) and testing.attention_error(dk, dk_all[..., ks, :], "dk")[0] <= tol \
                    and testing.attention_error(dv, dv_all[..., ks, :], "dv")[0] <= tol:
                hints.append(("home", (f"rank {rank} holds the dK/dV of rank {s}'s keys: the partial gradients "
                                      f"must travel (s - r) mod P = {(s - rank) % len(positions)} hops fewer/more "
                                      f"to end on their owner")))
                break
        else:
            if testing.attention_error(dk, dk_part[..., idx, :], "dk")[0] <= tol:
                hints.append(("partial", (f"rank {rank}'s dK/dV hold only its own queries' contributions: a K/V "
                                         f"block's partial dK/dV must travel with it and come home to its owner")))
    if errors["dq"][0] > tol:
        hints.append(("dq", ("dq wrong: recompute P = exp(scale q k^T - lse) from the lse you are given, "
                            "dS = P * (dout v^T - rowsum(dout * out)), dq = scale dS k summed over all blocks")))
    return hints


# name, heads, queries, keys in block 1 and 2, score scale, dtype, blocks empty (causal, keys after the queries)
MERGE_CASES = [
    ("halves", 2, 16, (12, 12), 1.0, np.float64, 0),
    ("uneven blocks", 2, 16, (3, 29), 1.0, np.float64, 0),
    ("large scores (exp(lse) overflows)", 2, 16, (12, 12), 40.0, np.float64, 0),
    ("an empty block (lse = -inf)", 2, 16, (16, 16), 1.0, np.float64, 1),
    ("both blocks empty", 2, 16, (16, 16), 1.0, np.float64, 2),
    ("float32", 2, 16, (12, 12), 1.0, np.float32, 0),
]


def run_merge_case(index, fn, gcomm, opts):
    name, h, n, (a, b), scale, dtype, empty = MERGE_CASES[index]
    causal = empty > 0
    rng = np.random.default_rng(2000 + index)
    d = 8
    q, k, v = (rng.standard_normal((h, n, d)) for n in (n, a + b, a + b))
    q, k = q * scale, k * scale
    qpos, kpos = np.arange(n), np.arange(a + b)
    if causal:  # causal, with the empty blocks' keys after every query
        kpos = np.concatenate([np.arange(a) + (n if empty == 2 else 0), n + np.arange(b)])
    parts = [testing.reference(q, k[..., s, :], v[..., s, :], causal=causal, q_positions=qpos,
                               k_positions=kpos[s]) for s in (slice(0, a), slice(a, a + b))]
    ref_out, ref_lse = testing.reference(q, k, v, causal=causal, q_positions=qpos, k_positions=kpos)
    args = [x.astype(dtype) for part in parts for x in part]
    run = call_student(lambda comm: fn(*(x.copy() for x in args)), gcomm, opts, "merge")
    check = {"ok": False, "error": None, "text": "", "hints": []}
    if run.outcome == "returned":
        got = run.value
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and np.shape(got[0]) == ref_out.shape
                and np.shape(got[1]) == ref_lse.shape):
            check["text"] = f"merge must return (out, lse) with shapes {ref_out.shape} and {ref_lse.shape}"
        else:
            tol = testing.tolerance(dtype)
            err_o, i_o = testing.attention_error(got[0], ref_out, "out")
            err_l, i_l = testing.attention_error(got[1], ref_lse, "lse")
            err = max(err_o, err_l)
            check.update(ok=err <= tol, error=err, tol=tol)
            if err > tol:
                what = "out" if err_o >= err_l else "lse"
                check["text"] = f"{what}: max error {err:.3g} at {i_o if what == 'out' else i_l}, tolerance {tol:g}"
                check["hints"] = _diagnose_merge(got, ref_out, ref_lse, parts, tol, causal, scale)
    run.value = None
    return run, check, name, dtype


def _diagnose_merge(got, ref_out, ref_lse, parts, tol, causal, scale):
    out, lse = (np.asarray(x, dtype=np.float64) for x in got)
    (o1, l1), (o2, l2) = parts
    if not np.all(np.isfinite(out)) or np.any(np.isnan(lse)) or not np.all(np.isfinite(lse[np.isfinite(ref_lse)])):
        if causal:
            return [("nan", ("NaN: an empty block has lse = -inf; with m = max(lse1, lse2), exp(-inf - m) = 0 is "
                            "fine but exp(-inf - (-inf)) is NaN: a row both blocks miss must give out 0, lse -inf"))]
        if scale > 1:
            return [("overflow", ("Inf/NaN with large scores: exp(lse) overflows; subtract m = max(lse1, lse2) "
                                 "first: lse = m + log(exp(lse1 - m) + exp(lse2 - m))"))]
        return [("nan", "NaN/Inf in the result")]
    hints = []
    close = testing.attention_error
    wrong_out = [text for cand, text in (((o1 + o2) / 2, "the mean of the two outputs"),
                                         (o1 + o2, "the sum of the two outputs"), (o2, "the second output alone"),
                                         (o1, "the first output alone")) if close(out, cand)[0] <= 100 * tol]
    if wrong_out:
        hints.append(("merge", (f"out is {wrong_out[0]}: did you rescale with the log-sum-exp? out = "
                               f"exp(lse1 - lse) out1 + exp(lse2 - lse) out2")))
    elif close(out, ref_out)[0] > tol:
        hints.append(("merge", "out: weight each block by exp(lse_b - lse), with lse the merged log-sum-exp"))
    wrong_lse = [text for cand, text in ((np.maximum(l1, l2), "max(lse1, lse2)"), (l1 + l2, "lse1 + lse2"))
                 if close(lse, cand)[0] <= 100 * tol]
    if wrong_lse:
        hints.append(("lse", (f"lse is {wrong_lse[0]}; it is log(exp(lse1) + exp(lse2)) = "
                             f"m + log(exp(lse1 - m) + exp(lse2 - m))")))
    return hints


# ---------------------------------------------------------------- verdicts (every rank computes the same ones)


@dataclass
class Verdict:
    status: str  # "ok" | "FAIL" | "not run"
    short: str = ""
    details: list = field(default_factory=list)
    hints: list = field(default_factory=list)


def _ranks_text(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def safety_verdict(runs):
    stuck = {r: run.stuck for r, run in enumerate(runs) if run.outcome == "stuck"}
    raised = [r for r, run in enumerate(runs) if run.outcome == "raised"]
    if stuck:
        return _hang_verdict(runs, stuck)
    if raised:
        first = runs[raised[0]]
        same = [r for r in raised if runs[r].exception == first.exception]
        details = [f"{_ranks_text(same)} raised {first.exception}", first.error]
        details += [f"rank {r} raised {runs[r].exception}" for r in raised if r not in same]
        hints = []
        if first.exception.startswith("NotImplementedError"):
            hints.append(("todo", "a TODO is left: fill it in"))
        return Verdict("FAIL", "raised", details, hints)
    left = [(r, run.left) for r, run in enumerate(runs) if run.left]
    if left:
        details = [f"rank {r} returned with {len(texts)} unfinished request(s): {', '.join(texts[:3])}"
                   for r, texts in left]
        return Verdict("FAIL", "unfinished requests", details,
                       [("requests", ("wait for every request before returning: until it completes, a send's buffer "
                                     "may not be reused and a receive's data may not be there"))])
    return Verdict("ok")


def _hang_verdict(runs, stuck):
    P = len(runs)
    every_send = len(stuck) == P and all(waiting and all(kind == "send" for kind, _, _ in waiting)
                                         for _, waiting, _ in stuck.values())
    if every_send:
        first = min(stuck)
        call, _, seconds = stuck[first]
        details = [(f"unsafe: rank {first} blocked in {call} for {seconds:.1f} s — every rank sends before it "
                   f"receives; use Isend/Irecv or Sendrecv")]
        details += [f"rank {r} blocked in {stuck[r][0]}" for r in sorted(stuck) if r != first]
        hints = [("unsafe", ("MPI may finish a small send before its receive is posted, by buffering it, but need "
                            "not; the grader runs every send in synchronous mode, so this ring deadlocks at every "
                            "size (on real MPI it deadlocks once messages pass the eager limit: "
                            "python -m mpiring.tools.deadlock shows it)"))]
        return Verdict("FAIL", "deadlock (unsafe)", details, hints)
    details = []
    for r, (call, waiting, seconds) in sorted(stuck.items()):
        line = f"rank {r} waited {seconds:.1f} s in {call}"
        texts = [text for _, _, text in waiting if text != call]
        if texts:
            line += " for: " + ", ".join(texts)
        peers = {}
        for kind, peer, _ in waiting:
            if isinstance(peer, int) and 0 <= peer < P and peer != r:
                peers.setdefault(peer, kind)
        for peer, kind in peers.items():
            other = runs[peer]
            if other.outcome == "returned":
                line += f"; rank {peer} had returned without {'receiving' if kind == 'send' else 'sending'} it"
            elif other.outcome == "raised":
                line += f"; rank {peer} had raised {other.exception}"
            else:
                line += f"; rank {peer} was itself blocked in {other.stuck[0]}"
        details.append(line)
    raised = [r for r, run in enumerate(runs) if run.outcome == "raised"]
    if raised:
        details += [f"rank {raised[0]} raised {runs[raised[0]].exception}", runs[raised[0]].error]
        hints = [("raised", "a rank raised an error and the others waited for it")]
    elif len(stuck) == P and all(all(kind == "recv" for kind, _, _ in w) for _, w, _ in stuck.values()):
        hints = [("recv-first", ("every rank waits to receive before any rank sends: start the send first (Isend), "
                                "or use Sendrecv"))]
    else:
        hints = [("mismatch", ("a rank waits for a message nobody sends it (or sends one nobody receives): check that "
                              "rank r sends to (r + 1) % P and receives from (r - 1) % P, with the same tags, the "
                              "same number of times"))]
    return Verdict("FAIL", "stuck", details, hints)


def output_verdict(checks):
    bad = [r for r, c in enumerate(checks) if not c["ok"]]
    worst = max((c["error"] for c in checks if c["error"] is not None), default=None)
    short = f"max error {worst:.2g}" if worst is not None else ""
    if not bad:
        return Verdict("ok", short)
    first = checks[bad[-1]]  # the last rank sees the most blocks: its hint says the most
    details = [f"wrong on {_ranks_text(bad)}: {first['text']}"]
    hints = list(first["hints"])
    for r in bad[:-1]:  # other kinds of mistakes on other ranks
        for kind, text in checks[r]["hints"]:
            if kind not in {k for k, _ in hints}:
                hints.append((kind, text))
    return Verdict("FAIL", short or "wrong", details, hints[:3])


def traffic_model(case, exercise, P):
    """(bytes each rank may send, how the model counts them)."""
    h, n, d = case.shape
    block = 2 * case.message
    model = (P - 1) * block
    text = (f"(P - 1) = {P - 1} K/V blocks per rank, i.e. 2 (P - 1) = {2 * (P - 1)} messages of "
            f"n*H*D*itemsize = {case.message} bytes")
    if exercise.kind == "backward":
        grads = P * 2 * h * n * d * 8
        model += grads
        text += f", plus dK/dV going home at most P = {P} times in float64 ({_size(grads)})"
    return model, text


def traffic_verdict(case, exercise, runs):
    P = len(runs)
    if any(run.outcome != "returned" for run in runs):
        return Verdict("not run")
    model, model_text = traffic_model(case, exercise, P)
    sent = [run.bytes + run.collective_bytes for run in runs]
    worst = int(np.argmax(sent))
    short = f"{_size(sent[worst])}/rank, model {_size(model)}"
    details, hints = [], []
    if sent[worst] > model + ALLOWANCE * runs[worst].pickled:
        ratio = sent[worst] / model if model else math.inf
        details.append(f"rank {worst} sent {sent[worst]} bytes in {runs[worst].messages} messages, "
                       f"{ratio:.3g} x the cost model: {model_text} ({model} bytes)")
        hints.append(("traffic", ("you send K/V more than P - 1 times: each block needs P - 1 hops to visit every "
                                 "other rank")))
    if P > 1 and not any(sent):
        details.append("no data went through comm")
        hints.append(("no-comm", "the K/V blocks must travel the ring through the communicator you are given (comm)"))
    world = [r for r, run in enumerate(runs) if run.world_calls]
    if world:
        details.append(f"{_ranks_text(world)} called MPI.COMM_WORLD")
        hints.append(("world", "use the comm argument, not MPI.COMM_WORLD: the ring must run on any communicator"))
    if exercise.directions and P >= 3:
        for r, run in enumerate(runs):
            ahead, behind = run.sent_to.get((r + 1) % P, 0), run.sent_to.get((r - 1) % P, 0)
            limit = (P // 2) * 2 * case.message + ALLOWANCE * run.pickled
            if not ahead or not behind:
                details.append(f"rank {r} sent {_size(ahead)} to rank {(r + 1) % P} and {_size(behind)} to rank "
                               f"{(r - 1) % P}")
                hints.append(("directions", "a bidirectional ring sends K/V both ways"))
                break
            if max(ahead, behind) > limit:
                details.append(f"rank {r} sent {_size(max(ahead, behind))} one way, more than floor(P/2) = "
                               f"{P // 2} K/V blocks")
                hints.append(("directions", ("going both ways, every block is at most floor(P/2) hops from each rank "
                                            "that needs it")))
                break
    return Verdict("FAIL" if details else "ok", short, details, hints)


WORK_REPEATS = 3  # the work checks take each rank's least CPU time over this many calls


def measure_work(exercise, fn, gcomm, opts):
    """{causal: [CPU seconds per rank]} of the 'large' float64 case, the least of WORK_REPEATS calls.

    CPU time outside the calls made through comm, with one BLAS thread: the work a rank did,
    whoever else shared its core. None if a call did not return on every rank.
    """
    cpu = {}
    for causal in (True,) if exercise.work == "skip" else (True, False):
        case = Case(WORK_SIZE, np.float64, causal, seed=999)
        for _ in range(WORK_REPEATS):
            run, _ = run_forward_case(case, exercise, fn, gcomm, opts, check_output=False)
            runs = _allgather(gcomm, run, opts.sync_timeout)
            if any(r.outcome != "returned" for r in runs):
                return None
            times = [r.cpu for r in runs]
            cpu[causal] = times if causal not in cpu else [min(a, b) for a, b in zip(cpu[causal], times)]
    return cpu


def work_verdict(exercise, cpu, P):
    """Causal skipping / zigzag balance, from the CPU time per rank of the causal (and non-causal) 'large' case."""
    if cpu is None:
        return Verdict("not run")
    if P == 1:
        return Verdict("ok", "one rank: nothing to compare")
    causal = cpu[True]
    shown = ", ".join(f"{c:.3f}" for c in causal)
    where = f"CPU s per rank, causal {WORK_SIZE} float64 case, least of {WORK_REPEATS} runs"
    if exercise.work == "skip":
        ok = causal[0] <= SKIP_RATIO * causal[-1]
        short = f"rank 0 {causal[0]:.3f} s, rank {P - 1} {causal[-1]:.3f} s"
        details = [] if ok else [f"compute time ({where}): {shown}"]
        hints = [] if ok else [("skip", f"rank 0 needs 1 block and rank {P - 1} all {P}, yet rank 0 computed "
                                        f"{causal[0] / causal[-1]:.2f} x as long (skipping gives about 1/P plus "
                                        f"the cost of the mask): skip the blocks that lie entirely after a "
                                        f"rank's queries")]
        return Verdict("ok" if ok else "FAIL", short, details, hints)
    balance = max(causal) / max(min(causal), 1e-9)
    saved = sum(causal) / max(sum(cpu[False]), 1e-9)
    # at P = 2 the masked diagonal block is half the work: the saving is too small to tell from noise
    ok = balance <= BALANCE_RATIO and (saved <= SAVED_RATIO or P < 3)
    short = f"max/min {balance:.2f}, causal/non-causal {saved:.2f}" + (" (not judged at P = 2)" if P < 3 else "")
    details, hints = [], []
    if balance > BALANCE_RATIO:
        details.append(f"compute time ({where}): {shown}, max/min {balance:.2f} > {BALANCE_RATIO}")
        hints.append(("balance", "with zigzag shards every rank has the same causal work: compute only the visible "
                                 "half of each off-diagonal block"))
    if saved > SAVED_RATIO and P >= 3:
        details.append(f"causal work is {saved:.2f} x the non-causal work (> {SAVED_RATIO})")
        hints.append(("saved", "a causal zigzag ring computes about half as much as a non-causal one, plus the "
                               "masked diagonal blocks: skip what is masked"))
    return Verdict("ok" if ok else "FAIL", short, details, hints)


# ---------------------------------------------------------------- report and main


@dataclass
class Options:
    path: str
    timeout: float
    time_limit: float

    @property
    def sync_timeout(self):
        """How long the grader waits for the other ranks: longer than any student call may take."""
        return self.time_limit + 2 * self.timeout + 30


def _say(rank, text=""):
    if rank == 0:
        print(text, flush=True)


def _show(rank, verdicts):
    for name, v in verdicts.items():
        for line in v.details:
            for part in line.splitlines():
                _say(rank, f"      {name}: {part}" if not part.startswith("  ") else f"      {part}")
        for _, hint in v.hints:
            _say(rank, f"      hint: {hint}")


class _Parser(argparse.ArgumentParser):
    """Prints usage and errors on rank 0 only."""

    rank = 0

    def _print_message(self, message, file=None):
        if self.rank == 0:
            super()._print_message(message, file)


def parser(rank=0):
    p = _Parser(prog="python -m mpiring.tools.grade", description=__doc__.splitlines()[0])
    p.rank = rank
    p.add_argument("student", help="the student's .py file")
    p.add_argument("--exercise", default="forward", choices=list(EXERCISES),
                   help="what to grade: forward (default, ring_attention causal and not) or an exercise of "
                        "docs/exercises.md")
    p.add_argument("--quick", action="store_true", help="4 cases instead of the full matrix")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds one MPI call may block before the ring is declared stuck "
                        f"(default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                   help=f"seconds one call of the student's function may take; past it the job is aborted "
                        f"(default {DEFAULT_TIME_LIMIT:g})")
    return p


def grade(comm, argv):
    """Grade ``argv``'s student file on ``comm`` (all ranks); returns the exit code, the same on every rank."""
    rank = comm.Get_rank()
    try:
        args = parser(rank).parse_args(argv)
    except SystemExit as exc:
        return exc.code
    if not (args.timeout > 0 and args.time_limit > 0):
        _say(rank, "grade: --timeout and --time-limit must be positive")
        return 2
    opts = Options(os.path.abspath(args.student), args.timeout, args.time_limit)
    gcomm = comm.Dup()
    try:
        code = _grade(gcomm, EXERCISES[args.exercise], args.quick, opts)
    except _Lost as exc:
        _fatal(comm, str(exc))
    if code is None:  # a collective of the student's could not be cleaned up: end the job the hard way
        _fatal(comm, "the student's code left an MPI collective unfinished", code=1)
    gcomm.Free()
    return code


def _grade(gcomm, exercise, quick, opts):
    rank, P = gcomm.Get_rank(), gcomm.Get_size()
    name = os.path.relpath(opts.path) if not os.path.relpath(opts.path).startswith("..") else opts.path
    try:
        fn, problem = load_student(opts.path, exercise.function), None
    except Exception as exc:  # noqa: BLE001  reported, then every rank exits 1
        fn, problem = None, f"cannot load {name}: {type(exc).__name__}: {exc}"
    problems = [p for p in _allgather(gcomm, problem, opts.sync_timeout, "loading the student's file") if p]
    if problems:
        _say(rank, f"grade: {problems[0]}")
        _say(rank, f"it must define {exercise.signature}")
        return 1
    start = time.perf_counter()
    if exercise.kind == "merge":
        cases = list(range(len(MERGE_CASES)))
        labels = [f"merge: {c[0]} ({np.dtype(c[5]).name})" for c in MERGE_CASES]
        checks = ("output", "safety")
    else:
        cases = make_cases(exercise, quick)
        labels = [f"{c.label} ({_size(c.message)}/msg)" for c in cases]
        checks = ("output", "traffic", "safety")
    _say(rank, f"grading {name}: {exercise.name} ({exercise.title}), P = {P}, {len(cases)} cases, "
               f"timeout {opts.timeout:g} s")
    _say(rank, f"  {exercise.signature}")
    table, hints, clean, stopped = [], {}, True, False
    for i, case in enumerate(cases):
        if exercise.kind == "merge":
            run, check, _, _ = run_merge_case(case, fn, gcomm, opts)
        elif exercise.kind == "backward":
            run, check = run_backward_case(case, exercise, fn, gcomm, opts)
        else:
            run, check = run_forward_case(case, exercise, fn, gcomm, opts)
        everyone = _allgather(gcomm, (run, check), opts.sync_timeout)
        runs = [r for r, _ in everyone]
        safety = safety_verdict(runs)
        verdicts = {"output": output_verdict([c for _, c in everyone]) if safety.status == "ok"
                    or all(r.outcome == "returned" for r in runs) else Verdict("not run")}
        if "traffic" in checks:
            verdicts["traffic"] = traffic_verdict(case, exercise, runs)
        verdicts["safety"] = safety
        table.append((labels[i], verdicts))
        line = " | ".join(f"{n} {v.status}" + (f" ({v.short})" if v.short and v.status != "not run" else "")
                          for n, v in verdicts.items())
        _say(rank, f"[{i + 1:2d}/{len(cases)}] {labels[i]}: {line}")
        _show(rank, verdicts)
        for v in verdicts.values():
            for kind, text in v.hints:
                hints.setdefault(kind, text)
        clean = all(r.clean for r in runs)
        if any(r.outcome != "returned" for r in runs):
            for label in labels[i + 1:]:
                table.append((label, {n: Verdict("not run") for n in checks}))
            _say(rank, f"stopped: the remaining {len(cases) - i - 1} cases are not run")
            stopped = True
            break
    if exercise.work:
        title = "work: causal skipping" if exercise.work == "skip" else "work: zigzag balance"
        work = work_verdict(exercise, None if stopped else measure_work(exercise, fn, gcomm, opts), P)
        table.append((title, {"output": work}))
        _say(rank, f"{title}: {work.status}" + (f" ({work.short})" if work.short else ""))
        _show(rank, {"work": work})
        for kind, text in work.hints:
            hints.setdefault(kind, text)
    _summary(rank, table, checks, P, time.perf_counter() - start, hints)
    passed = all(v.status == "ok" for _, verdicts in table for v in verdicts.values())
    if not clean:
        return None
    return 0 if passed else 1


def _summary(rank, table, checks, P, seconds, hints):
    width = max(len(label) for label, _ in table) + 2
    _say(rank, "")
    _say(rank, f"summary: P = {P}, {seconds:.1f} s")
    _say(rank, "  " + "case".ljust(width) + "".join(c.ljust(34) for c in checks).rstrip())
    counts = collections.Counter()
    for label, verdicts in table:
        cells = []
        for c in checks:
            v = verdicts.get(c)
            if v is None:
                cells.append("")
                continue
            counts[v.status] += 1
            cells.append((v.status + ("  " + v.short if v.short and v.status != "not run" else ""))[:32].ljust(34))
        _say(rank, "  " + label.ljust(width) + "".join(cells).rstrip())
    total = sum(counts.values())
    if counts["ok"] == total:
        _say(rank, f"PASS: all {total} checks passed")
    else:
        _say(rank, f"FAIL: {counts['ok']} of {total} checks passed, {counts['FAIL']} failed, "
                   f"{counts['not run']} not run")
        for hint in list(hints.values())[:4]:
            _say(rank, f"  hint: {hint}")


def main(argv=None):
    return grade(MPI.COMM_WORLD, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
