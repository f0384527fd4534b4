"""The grader's own communication between ranks: exchanges with a deadline, clean-up, abort.

Every call here polls with a timeout longer than any student call may take, so a rank that
never joins ends the job (``Lost``, then ``fatal``) instead of hanging it.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from .wire import request_text

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
    """Bring the student's communicators back to a clean state after a call, whatever it left behind.

    Unfinished receives are cancelled; unfinished sends are matched by receives posted here (every
    rank learns which sends are addressed to it), so no message is left in flight and every
    communicator can be freed. Returns ``(unfinished requests as text, clean)``; ``clean`` is False
    when a collective was left unfinished somewhere (those cannot be cancelled: the job must abort).
    """
    left = [request_text(r) for r in ledger.pending()]
    states = allgather(gcomm, (bool(left), any(getattr(r, "kind", None) == "collective" for r in ledger.pending())),
                        timeout, "clean-up")
    if not any(pending for pending, _ in states):
        return left, True
    if any(collective for _, collective in states):
        return left, False
    receives = [r for r in ledger.pending() if getattr(r, "kind", None) == "recv"]
    for req in receives:
        try:
            req.Cancel()
        except MPI.Exception:
            pass
    wait_for(receives, timeout, "cancelling unfinished receives")
    wait_for([gcomm.Ibarrier()], timeout, "clean-up")  # from here on no receive of the student's can match
    # Rounds: every rank lists its sends still unfinished; each receiver takes the listed messages it
    # can probe. A listed send whose message was already matched (by a receive that completed before
    # it was cancelled) finishes on its own, and leaves the list in a later round.
    index = {id(c): i for i, c in enumerate(ledger.comms)}
    me, start = gcomm.Get_rank(), time.perf_counter()
    while True:
        sends = [r for r in ledger.pending() if getattr(r, "kind", None) == "send"]
        MPI.Request.Testall(sends)
        listed = [(index[id(r.comm)], r.peer, r.tag) for r in ledger.pending()
                  if getattr(r, "kind", None) == "send"]
        everyone = allgather(gcomm, listed, timeout, "clean-up")
        if not any(everyone):
            break
        if time.perf_counter() - start > timeout:
            raise Lost("clean-up: unfinished sends of the student's could not be matched")
        for source, theirs in enumerate(everyone):
            for i, dest, tag in theirs:
                status = MPI.Status()
                if dest == me and ledger.comms[i].Iprobe(source, tag, status):
                    ledger.comms[i].Recv(bytearray(status.Get_count(MPI.BYTE)), source, status.Get_tag())
        time.sleep(1e-3)
    wait_for([gcomm.Ibarrier()], timeout, "clean-up")
    return left, True


def timed_sum(comm, a, timeout):
    out = np.empty_like(a)
    wait_for([comm.Iallreduce(a, out, MPI.SUM)], timeout, "reference gradients")
    return out
