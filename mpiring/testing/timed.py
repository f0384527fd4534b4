"""Timed waits for the strict communicator: the ledger of what a rank did, requests whose waits give up.

``poll`` completes requests by polling and raises ``Stuck`` (naming the call, the peer, the tag
and the timeout) once the ledger's timeout has passed. ``TimedRequest`` is an mpi4py Request
whose ``Wait``/``Waitall``/... poll so; ``instrument`` points a module's ``MPI`` name at a proxy
whose ``Request`` is that class, so code that calls ``MPI.Request.Waitall`` is timed too.
``settle`` brings the communicators back to a clean state after a call got ``Stuck``.
"""

import collections
import pickle
import time

import numpy as np
from mpi4py import MPI

from ..mpi.waits import polls

__all__ = ["DEFAULT_TIMEOUT", "Ledger", "Stuck", "TimedRequest", "instrument", "nbytes_of", "peer_text", "poll",
           "request_text", "settle", "size_text", "uninstrument"]

DEFAULT_TIMEOUT = 10.0  # seconds one MPI call may block
NAP = 5e-5  # first sleep between two polls; grows to NAP_MAX, so waiting ranks leave the cores to working ones
NAP_MAX = 2e-3


class Stuck(BaseException):
    """A blocking MPI call did not complete within the timeout (BaseException: ``except Exception`` can't hide it).

    ``call``: what blocked ("Send to rank 1 (tag 77, 2 KiB)"); ``waiting``: [(kind, peer, text)]
    of the requests still unfinished; ``seconds``: how long it waited; ``timeout``: the limit set.
    """

    def __init__(self, call, waiting, seconds, timeout=None, rank=None):
        self.call, self.waiting, self.seconds, self.timeout, self.rank = call, waiting, seconds, timeout, rank
        where = "" if rank is None else f"rank {rank}: "
        limit = "" if timeout is None else f" (timeout {timeout:g} s)"
        pending = [text for _, _, text in waiting if text != call]
        super().__init__(f"{where}{call} blocked for {seconds:.1f} s{limit}"
                         + (f"; unfinished: {', '.join(pending)}" if pending else ""))


class Ledger:
    """What one rank did through a strict communicator: traffic, requests, timeline, the call in progress."""

    def __init__(self, timeout=DEFAULT_TIMEOUT, rank=None):
        self.timeout, self.rank = timeout, rank
        self.requests = []  # every TimedRequest made (pending ones are those not yet REQUEST_NULL)
        self.comms = []  # every communicator the messages may be on, in creation order
        self.bytes = 0  # point-to-point bytes sent (pickled objects: their pickle)
        self.messages = 0
        self.pickled = 0  # messages of pickled objects (their bytes include the pickle's framing)
        self.sent_to = collections.Counter()  # dest rank -> bytes
        self.received = 0  # point-to-point bytes and messages received
        self.received_messages = 0
        self.received_from = collections.Counter()  # source rank -> bytes
        self.collective_bytes = 0  # what a direct algorithm of each collective would send from this rank
        self.collectives = collections.Counter()  # name -> calls
        self.calls = collections.Counter()  # name -> count, calls forwarded without being timed
        self.world_calls = 0
        self.current = None  # description of the blocking call in progress
        self.events = []  # the timeline: dicts with "what" (post, done, wait, product), "t" (and "end")
        self.on_object = None  # called on every object received pickled (the grader's counting arrays)

    def count(self, dest, nbytes):
        self.bytes += nbytes
        self.messages += 1
        self.sent_to[dest] += nbytes

    def note(self, what, **info):
        self.events.append(dict(info, what=what, t=info.get("t", time.perf_counter())))

    def pending(self):
        return [r for r in self.requests if r != MPI.REQUEST_NULL]

    def summary(self):
        """This rank's traffic as a dict of plain values."""
        return {"bytes_sent": self.bytes, "messages_sent": self.messages, "sent_to": dict(self.sent_to),
                "bytes_received": self.received, "messages_received": self.received_messages,
                "received_from": dict(self.received_from), "collective_bytes": self.collective_bytes,
                "collectives": dict(self.collectives), "untimed_calls": dict(self.calls),
                "unfinished": [request_text(r) for r in self.pending()]}

    def state_text(self):
        now = f"blocked in {self.current}" if self.current else "not in a call the strict communicator times"
        pending = self.pending()
        if pending:
            now += "; unfinished requests: " + ", ".join(request_text(r) for r in pending[:6])
        if self.calls:
            now += "; untimed calls made: " + ", ".join(f"{n} x{c}" for n, c in self.calls.items())
        return now


def request_text(request):
    return getattr(request, "text", "a request not made through the strict communicator")


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


def size_text(nbytes):
    """``1 KiB``, ``1.5 MiB``, ``512 B``; ``?`` for None."""
    if nbytes is None:
        return "?"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def peer_text(kind, peer, tag, nbytes):
    """"to rank 1 (tag 77, 2 KiB)", "from any rank (any tag)"."""
    where = "to" if kind == "send" else "from"
    who = "any rank" if peer == MPI.ANY_SOURCE else f"rank {peer}"
    tag_text = "any tag" if tag == MPI.ANY_TAG else f"tag {tag}"
    size = f", {size_text(nbytes)}" if nbytes is not None else ""
    return f"{where} {who} ({tag_text}{size})"


def _received(ledger, req, status, obj=None, objects=False):
    """Count a completed receive in the ledger (bytes from its status, or the pickle of the object)."""
    if ledger is None or getattr(req, "kind", None) != "recv":
        return
    n = len(pickle.dumps(obj)) if objects else (status.Get_count(MPI.BYTE) if status is not None else 0)
    ledger.received += n
    ledger.received_messages += 1
    source = status.Get_source() if status is not None and req.peer == MPI.ANY_SOURCE else req.peer
    ledger.received_from[source] += n


def poll(requests, call, statuses=None, objects=False, any_one=False, ledger=None, fallback=None):
    """Complete ``requests`` (or one of them, ``any_one``) by polling; raise Stuck past the timeout.

    The timeout is the ledger's (``ledger``, else that of the first request a strict communicator
    made), else ``fallback``, else DEFAULT_TIMEOUT. Returns the received objects (``objects``), the
    index of the completed request (``any_one``), or None.
    """
    if ledger is None:
        ledger = next((r.ledger for r in requests if getattr(r, "ledger", None) is not None), None)
    timeout = ledger.timeout if ledger is not None else fallback or DEFAULT_TIMEOUT
    start = time.perf_counter()
    results = [None] * len(requests)
    done = [False] * len(requests)
    found = []  # the index of the completed request (``any_one``)
    own = ledger is not None and ledger.current is None
    if own:
        ledger.current = call

    def test():
        for i, req in enumerate(requests):
            if done[i]:
                continue
            status = statuses[i] if statuses is not None and i < len(statuses) else None
            mine = getattr(req, "ledger", None)
            if status is None and getattr(req, "kind", None) == "recv":
                status = MPI.Status()
            if objects:
                done[i], results[i] = MPI.Request.test(req, status)
            else:
                done[i] = MPI.Request.Test(req, status)
            if done[i]:
                if mine is not None:
                    mine.note("done", request=req.id)
                _received(mine, req, status, results[i], objects)
                if any_one:
                    found.append(i)
                    return True
        return all(done)

    try:
        for now in polls(test, naps=(NAP, NAP_MAX)):
            waited = now - start
            if waited > timeout:
                left = [requests[i] for i in range(len(requests)) if not done[i]]
                raise Stuck(call, [(getattr(r, "kind", "?"), getattr(r, "peer", None), request_text(r))
                                   for r in left], waited, timeout, None if ledger is None else ledger.rank)
        if found:
            return found[0]
    finally:
        if own:
            ledger.current = None
            ledger.note("wait", start=start, end=time.perf_counter(), call=call)
    if not objects:
        return None
    hook = ledger.on_object if ledger is not None and ledger.on_object is not None else (lambda x: x)
    return [hook(x) for x in results]


class TimedRequest(MPI.Request):
    """An mpi4py Request whose waits give up after the timeout, saying what they waited for.

    ``MPI.Request.Waitall`` etc. are replaced by these timed versions in a module ``instrument``
    was given (its name ``MPI`` refers to a proxy whose ``Request`` is this class); they accept
    any requests, and take their timeout from the first request a strict communicator made.
    """

    ledger = None
    timeout = None  # for requests made elsewhere: instrument's timeout

    def Wait(self, status=None):
        poll([self], f"Wait for {request_text(self)}", [status], fallback=self.timeout)
        return True

    def wait(self, status=None):
        return poll([self], f"wait for {request_text(self)}", [status], objects=True, fallback=self.timeout)[0]

    @classmethod
    def Waitall(cls, requests, statuses=None):
        poll(list(requests), "Waitall", statuses, fallback=cls.timeout)
        return True

    @classmethod
    def waitall(cls, requests, statuses=None):
        return poll(list(requests), "waitall", statuses, objects=True, fallback=cls.timeout)

    @classmethod
    def Waitany(cls, requests, status=None):
        requests = list(requests)
        if all(r == MPI.REQUEST_NULL for r in requests):
            return MPI.UNDEFINED
        return poll(requests, "Waitany", [status] * len(requests), any_one=True, fallback=cls.timeout)

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
        poll(requests, "Waitsome", statuses, any_one=True, fallback=cls.timeout)
        return [i for i, r in enumerate(requests) if r == MPI.REQUEST_NULL]


def timed_request(req, kind, peer, text, ledger, comm=None, tag=None):
    """``req`` as a TimedRequest noted in ``ledger`` ("post" event; the receive or send it stands for)."""
    timed = TimedRequest(req)
    timed.kind, timed.peer, timed.text, timed.comm, timed.tag = kind, peer, text, comm, tag
    timed.ledger, timed.id, timed.posted = ledger, len(ledger.requests), time.perf_counter()
    ledger.requests.append(timed)
    ledger.note("post", request=timed.id, kind=kind, peer=peer, text=text)
    return timed


class MPIProxy:
    """Stands for ``mpi4py.MPI`` in an instrumented module: its ``Request`` waits are timed."""

    def __init__(self, timeout=DEFAULT_TIMEOUT):
        self.Request = type("TimedRequest", (TimedRequest,), {"timeout": timeout})

    def __getattr__(self, name):
        return getattr(MPI, name)


def instrument(module, timeout=DEFAULT_TIMEOUT, proxy=None):
    """Point a module's names for ``mpi4py.MPI`` (and ``MPI.Request``) at timed proxies; returns what to undo."""
    proxy = proxy or MPIProxy(timeout)
    undo = []
    for name, value in list(vars(module).items()):
        if value is MPI:
            undo.append((module, name, value))
            setattr(module, name, proxy)
        elif value is MPI.Request:
            undo.append((module, name, value))
            setattr(module, name, proxy.Request)
    return undo


def uninstrument(undo):
    """Put back what ``instrument`` replaced."""
    for module, name, value in undo:
        setattr(module, name, value)


def settle(control, ledger, timeout):
    """Bring communicators back to a clean state after code under test returned or got Stuck (every rank calls it).

    Unfinished receives are cancelled; unfinished sends are matched by receives posted here (every
    rank learns which sends are addressed to it), so no message is left in flight and every
    communicator can be freed. ``control``: an mpi4py communicator of the same ranks that carries
    no messages of the code under test. Returns ``(unfinished requests as text, clean)``; ``clean``
    is False when a collective was left unfinished somewhere (those cannot be cancelled).
    Raises CommTimeout if the other ranks do not join within ``timeout``.
    """
    from ..mpi.collectives import allgather, together
    from ..mpi.waits import wait_until

    left = [request_text(r) for r in ledger.pending()]
    states = allgather(control, (bool(left), any(getattr(r, "kind", None) == "collective" for r in ledger.pending())),
                       timeout)
    if not any(pending for pending, _ in states):
        return left, True
    if any(collective for _, collective in states):
        return left, False
    me = control.Get_rank()
    receives = [r for r in ledger.pending() if getattr(r, "kind", None) == "recv"]
    for req in receives:
        try:
            req.Cancel()
        except MPI.Exception:
            pass
    wait_until(receives, timeout, me, "cancelling unfinished receives")
    together(control, timeout, "clean-up")  # from here on no receive of the code under test can match
    # Rounds: every rank lists its sends still unfinished; each receiver takes the listed messages it
    # can probe. A listed send whose message was already matched (by a receive that completed before
    # it was cancelled) finishes on its own, and leaves the list in a later round.
    index = {id(c): i for i, c in enumerate(ledger.comms)}
    start = time.perf_counter()
    while True:
        sends = [r for r in ledger.pending() if getattr(r, "kind", None) == "send"]
        MPI.Request.Testall(sends)
        listed = [(index[id(r.comm)], r.peer, r.tag) for r in ledger.pending() if getattr(r, "kind", None) == "send"]
        everyone = allgather(control, listed, timeout)
        if not any(everyone):
            break
        if time.perf_counter() - start > timeout:
            waited = time.perf_counter() - start
            raise Stuck("clean-up: unfinished sends could not be matched", [], waited, timeout, me)
        for source, theirs in enumerate(everyone):
            for i, dest, tag in theirs:
                status = MPI.Status()
                if dest == me and ledger.comms[i].Iprobe(source, tag, status):
                    ledger.comms[i].Recv(bytearray(status.Get_count(MPI.BYTE)), source, status.Get_tag())
        time.sleep(1e-3)
    together(control, timeout, "clean-up")
    return left, True

