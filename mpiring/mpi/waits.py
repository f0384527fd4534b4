"""How a rank waits for MPI: timed waits that raise ``CommTimeout``, one thread per communicator, abandoned rings.

Every wait of mpiring goes through ``wait_until``: it polls, sleeps when the
others are still computing, and gives up after the timeout with the same
exception on every live rank (docs/reliability.md).
"""

import contextlib
import ctypes
import functools
import logging
import threading
import time

import numpy as np
from mpi4py import MPI

from ..core.tuning.threads import cores, launcher_local_ranks

__all__ = ["CommTimeout", "CAUSES", "polls", "wait_until", "wait_entry", "test_all", "completed", "exclusive",
           "abandon", "ABANDONED", "shares_cores", "Watch", "watching", "Announced", "cut_short"]


# what a timed-out wait says when it knows no better
CAUSES = "another rank may have failed or stalled, or its compute step outlasted the timeout"
# How a rank waits (docs/performance.md §10). It polls MPI without pause for SPIN_SECONDS, as
# MPI_Waitall would: a large transfer moves only while someone polls, and in a balanced ring the
# others finish about when this rank did. Past that they are still computing, and a rank that kept
# spinning took a core from the slower rank it waited for on a shared machine: the wait sleeps
# between polls, 50 us doubling to 1 ms, and after each nap polls for BURST_SECONDS, so data that
# starts to move keeps moving (naps alone slowed the idle backward). A wait that carries no data
# (a barrier, an agreement, the end-of-ring check: ``sync=True``) spins SYNC_SPIN_SECONDS and needs
# no bursts.
SPIN_SECONDS = 0.1
BURST_SECONDS = 1e-3
SYNC_SPIN_SECONDS = 0.02
NAP_SECONDS = (5e-5, 1e-3)
# A call's entry (every rank reaching it) may wait minutes, for another rank's evaluation or
# checkpoint: past LONG_WAIT_SECONDS it polls every LONG_NAP_SECONDS, and with timeout="auto"
# it logs a warning after ENTRY_REPORT_SECONDS, then each time the wait doubles.
LONG_WAIT_SECONDS = 1.0
LONG_NAP_SECONDS = 0.01
ENTRY_REPORT_SECONDS = 60.0
LOG = logging.getLogger("mpiring")


@functools.cache
def shares_cores():
    """Whether this node runs more ranks than this process may use cores (oversubscribed).

    From the launcher's environment (MPICH's Hydra: MPI_LOCALNRANKS; Open MPI:
    OMPI_COMM_WORLD_LOCAL_SIZE); unknown counts as not shared.
    """
    return launcher_local_ranks() > cores()


# rings given up on an error path: (communicator, pending requests, datatypes), kept alive, never freed
ABANDONED = []


def abandon(entry):
    """Keep ``entry`` (a communicator, its pending requests and their buffers, datatypes) alive for good.

    In ``ABANDONED`` for the life of the interpreter, and one reference more
    that nothing gives back: mpi4py finalizes MPI after the interpreter has
    torn its objects down, and MPI may still move data into or out of these
    buffers then (Open MPI's single-copy receive crashed on freed ones).
    """
    ABANDONED.append(entry)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry))


_IN_USE = {}  # communicator handle -> the thread running a call on it
_IN_USE_LOCK = threading.Lock()


@contextlib.contextmanager
def exclusive(comm):
    """Mark ``comm`` as used by this thread for a call; another thread's call on it raises RuntimeError.

    Two threads running collectives on one communicator at once is erroneous
    MPI (it gave UnpicklingErrors, absurd MemoryErrors or an abort): each
    thread needs its own ``comm.Dup()``. Detected on this rank only; the
    other ranks give up at their timeout.
    """
    key, me = MPI._handleof(comm), threading.get_ident()
    with _IN_USE_LOCK:
        owner = _IN_USE.get(key)
        if owner is not None and owner != me:
            raise RuntimeError("another thread is running mpiring on this communicator: concurrent calls on one "
                               "communicator are not supported; give each thread its own comm.Dup()")
        _IN_USE[key] = me
    try:
        yield
    finally:
        with _IN_USE_LOCK:
            if owner is None:
                _IN_USE.pop(key, None)


class CommTimeout(RuntimeError):
    """A ring transfer did not complete within the requested timeout (or failed with its peer)."""


class Announced(ValueError):
    """Another rank's failure inside a call, as it announced it (``Watch``): the error that rank raised."""


# A rank that fails inside a call tells the others at once (``Watch.announce``): a notice of NOTICE_BYTES on the
# call's private communicator with FAILURE_TAG (the ring's messages use tags below 8), which every wait of the
# call polls for (``watching``), so the others raise within one poll of their next wait, not at their timeout.
FAILURE_TAG = 32000
DRAIN_SECONDS = 1.0  # how long a rank told of a failure lets what it waits for complete before leaving it
WATCH_SECONDS = 1e-3  # a wait looks for a notice at most this often (an MPI test each: the polls stay cheap)
NOTICE_BYTES = 2048
_WATCHED = threading.local()


class Watch:
    """This rank's receive of the others' failure notices on a private communicator, posted once, polled by every
    wait inside ``watching(watch)``. ``token``: the same on every rank of the handle and new for each (``agree.Hosts``):
    a notice meant for an earlier handle whose communicator MPI has since reused is ignored. ``close()`` completes
    the receive with a notice of this rank's own: nothing is cancelled (docs/reliability.md §2)."""

    def __init__(self, comm, token=0):
        self.comm, self.rank, self.token = comm, comm.Get_rank(), int(token)
        self._notice = np.zeros(NOTICE_BYTES, np.uint8)
        self._request = self._post()

    def _post(self):
        return self.comm.Irecv(self._notice, source=MPI.ANY_SOURCE, tag=FAILURE_TAG)

    def _taken(self):
        """The notice received: ``(token, kind, text)``; the receive is posted again for the next one."""
        token = int(self._notice[:8].view(np.int64)[0])
        kind, text = chr(self._notice[8]), bytes(self._notice[9:]).rstrip(b"\0").decode(errors="replace")
        return token, kind, text

    def check(self):
        """Raise what another rank announced, if a notice has come: ``Announced`` (the same ValueError as on that
        rank) for a bad function of the user's, CommTimeout for any other failure."""
        while self._request is not None and completed([self._request]):
            token, kind, text = self._taken()
            if token != self.token:  # another handle's, late: not for this one
                self._request = self._post()
                continue
            self._request = None
            raise Announced(text) if kind == "V" else CommTimeout(f"rank {self.rank}: {text}")

    def _notice_of(self, text, kind):
        notice = np.zeros(NOTICE_BYTES, np.uint8)
        notice[:8] = np.frombuffer(np.int64(self.token).tobytes(), np.uint8)
        data = (kind + text).encode()[:NOTICE_BYTES - 9]
        notice[8:8 + len(data)] = np.frombuffer(data, np.uint8)
        return notice

    def announce(self, text, value=False):
        """Tell every other rank that this one failed (``value``: with the ValueError ``text``, which they raise
        as it is). The sends are never waited for nor freed (``abandon``): a notice is small (sent eagerly)."""
        notice = self._notice_of(text, "V" if value else "T")
        sends = [self.comm.Isend(notice, dest=r, tag=FAILURE_TAG) for r in range(self.comm.Get_size())
                 if r != self.rank]
        abandon((self.comm, sends, notice))

    def close(self):
        """Complete the pending receive: with this rank's own "closed" notice, after any that came before it."""
        if self._request is None:
            return
        mine = self._notice_of("", "C")
        sent = self.comm.Isend(mine, dest=self.rank, tag=FAILURE_TAG)
        status = MPI.Status()
        while True:
            self._request.Wait(status)
            if status.Get_source() == self.rank:  # a rank's notices to itself arrive in order: this is the one
                break
            self._request = self._post()
        sent.Wait()
        self._request = None


@contextlib.contextmanager
def watching(watch):
    """Every wait of this thread inside the block also polls ``watch`` for another rank's failure."""
    before = getattr(_WATCHED, "watch", None)
    _WATCHED.watch, _WATCHED.cut_short = watch, False
    try:
        watch.check()
        yield
    finally:
        _WATCHED.watch = before


def cut_short():
    """Whether a wait of this thread's call gave up because another rank failed (``watching``): requests of the
    call may be pending on any of its communicators (a collective the others joined), so none may be freed."""
    return getattr(_WATCHED, "cut_short", False)


def test_all(requests, rank, what):
    """``MPI.Request.Testall``; an MPI error on a transfer is raised as CommTimeout.

    Such an error means a peer failed: a rank that raised tears its
    connections down when it finalizes MPI, and whether a transfer it had
    started still completes first is a race. Either way the live rank
    reports the failure as it reports a stall.
    """
    try:
        return MPI.Request.Testall(requests)
    except MPI.Exception as exc:
        raise CommTimeout(f"rank {rank}: {what} failed ({exc.Get_error_string().splitlines()[0]}): another rank "
                          f"has likely failed") from None


def wait_until(requests, timeout, rank, what, start=None, note=None, sync=False):
    """Complete ``requests``, or raise CommTimeout ``timeout`` seconds after ``start`` (None: wait forever).

    ``note`` replaces the message's guess at the cause when the caller knows better. ``sync``: the
    requests carry no bulk data, so the polls start sleeping sooner (SYNC_SPIN_SECONDS).
    """
    start = time.perf_counter() if start is None else start
    for now in _polls(requests, rank, what, sync):
        if timeout is not None and now - start > timeout:
            raise CommTimeout(f"rank {rank}: {what} not complete after {timeout:g} s ({note or CAUSES})")


def polls(test, naps=NAP_SECONDS, spin=0.0, burst=0.0, pause=None):
    """The one polling loop: call ``test()`` until it is true, yielding the time of each call that found it false.

    The caller raises its own timeout. Between polls: ``pause(now, started)``'s sleep if it gives one,
    else none for the first ``spin`` seconds, then naps from ``naps[0]`` doubling to ``naps[1]``, each
    followed by ``burst`` seconds of polls without pause (data that starts to move keeps moving).
    """
    started, nap = time.perf_counter(), naps[0]
    while not test():
        now = time.perf_counter()
        yield now
        sleep = pause(now, started) if pause is not None else None
        if sleep is not None:
            time.sleep(sleep)
        elif now - started > spin:  # the others are still computing: leave the core to them
            time.sleep(nap)
            nap = min(2 * nap, naps[1])
            until = time.perf_counter() + burst
            while time.perf_counter() < until and not test():
                pass


def _polls(requests, rank, what, sync, patient=False):
    """Poll ``requests`` until they complete (``polls``), yielding the time of each poll that found them pending.

    ``patient``: a wait that may last minutes (a call's entry) naps LONG_NAP_SECONDS once it has
    lasted LONG_WAIT_SECONDS, so a rank waiting for another's evaluation or checkpoint costs no core.
    """
    spin, burst = (SYNC_SPIN_SECONDS, 0.0) if sync else (SPIN_SECONDS, BURST_SECONDS)
    watch, looked = getattr(_WATCHED, "watch", None), 0.0

    def pause(now, started):
        if patient and now - started > LONG_WAIT_SECONDS:
            return LONG_NAP_SECONDS
        return 1e-4 if shares_cores() else None  # more ranks than cores: a spinning rank slows the one computing

    for now in polls(lambda: test_all(requests, rank, what), NAP_SECONDS, spin, burst, pause):
        if watch is not None and now - looked > WATCH_SECONDS:
            looked = now
            try:
                watch.check()
            except BaseException:  # another rank failed: what this rank waits for may still complete (a
                _drained(requests)  # collective that rank had joined): given a moment to, else kept for good
                _WATCHED.cut_short = True  # the call's communicators are never freed (``cut_short``)
                raise
        yield now


def _drained(requests):
    """After another rank's failure: let ``requests`` complete if they can within DRAIN_SECONDS (a collective
    every rank had joined: leaving it half done corrupted MPICH's state at the next call), else keep them and
    their buffers for good (``abandon``)."""
    deadline = time.perf_counter() + DRAIN_SECONDS
    while not completed(requests):
        if time.perf_counter() > deadline:
            abandon(requests)
            return
        time.sleep(1e-4)


def wait_entry(requests, timeout, rank, what, roll=None):
    """Wait for every rank to enter a call (``requests``: its first collective).

    ``timeout`` None waits without limit (``timeout="auto"``: a rank busy before the call, with an
    evaluation or a checkpoint, is not a failed one); every ENTRY_REPORT_SECONDS, doubling, the wait
    is logged as a warning on the ``mpiring`` logger. A number raises CommTimeout past it. Both say
    for how long this rank has waited and, when a ``roll`` (``rollcall.RollCall``: a ``Ring``'s call)
    can tell, which ranks have not entered the call: it is polled while the wait lasts and calls the
    roll half way to the first warning or the timeout, so a short wait sends nothing more.
    """
    start = looked = time.perf_counter()
    report = ENTRY_REPORT_SECONDS
    ask = min(report, report if timeout is None else timeout) / 2
    for now in _polls(requests, rank, what, sync=True, patient=True):
        waited = now - start
        if roll is not None and now - looked > WATCH_SECONDS:
            looked = now
            roll.poll()
            if waited > ask:
                roll.ask()  # once per peer: a rank told already is not asked again
        if timeout is not None and waited > timeout:
            raise CommTimeout(f"rank {rank}: {what} not complete after {timeout:g} s: {_not_entered(roll)} (it may "
                              f"have failed, or be busy before the call: timeout={timeout:g} bounds that wait too; "
                              f"timeout='auto' waits without limit)")
        if waited > report:
            LOG.warning("rank %d: %s waiting for %.0f s: %s (with timeout='auto' a call waits without limit for every "
                        "rank to reach it: a rank busy with an evaluation or a checkpoint is fine, a failed one is "
                        "not; docs/training.md)", rank, what, waited, _not_entered(roll))
            report *= 2


def _not_entered(roll):
    """Who has not entered the call, as far as this rank can tell."""
    ranks = roll.absent() if roll is not None else None
    if not ranks:
        return "not every rank has entered the call"
    who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"
    return f"{who} not entered the call"


def completed(requests):
    """Whether ``requests`` are complete; one that failed (a peer gone) is not, and stays pending."""
    try:
        return MPI.Request.Testall(requests)
    except MPI.Exception:
        return False
