"""``demo deadlock``: why a ring of blocking sends deadlocks on this MPI, and the two fixes, shown live.

    mpiexec -n 2 python -m mpiring demo deadlock
    mpiexec -n 4 python -m mpiring demo deadlock --timeout 2

1. The eager limit, measured: a standard-mode ``Isend`` (the mode of ``Send``) with no receive posted
   completes at once when MPI copies it into its own buffers, and waits for the receive above that size.
2. The blocking ring: every rank calls ``Send`` to rank + 1 (in a helper thread, so the demo can watch
   it), then ``Recv`` from rank - 1; above the limit no ``Send`` returns. After ``--timeout`` seconds
   the main thread posts the ``Recv`` (MPI_THREAD_MULTIPLE) and the demo goes on.
3. The fixes, with the large message: ``Isend`` + ``Irecv`` + ``Waitall``, and ``Sendrecv``.

Exit code 0 when every rank saw the above (or MPI buffered every size tried), 1 otherwise. Rank 0 prints.
"""

import argparse
import threading
import time

import numpy as np
from mpi4py import MPI

from mpiring.testing.timed import size_text as _size

__all__ = ["demo", "demo_parser", "deadlock_demo", "eager_limit"]

PROBE_WAIT = 0.2  # seconds a probe Isend may take and still count as "completed without a receive"
LARGEST = 16 * 2**20


def _completes_alone(comm, nbytes, wait=PROBE_WAIT):
    """Does a standard-mode Isend of ``nbytes`` complete on every rank before its receive is posted?"""
    rank, size = comm.Get_rank(), comm.Get_size()
    data, into = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    request = comm.Isend(data, dest=(rank + 1) % size, tag=1)
    start, alone = time.perf_counter(), False
    while time.perf_counter() - start < wait:
        if request.Test():
            alone = True
            break
        time.sleep(1e-4)
    comm.Recv(into, source=(rank - 1) % size, tag=1)  # now let it complete either way
    request.Wait()
    return bool(comm.allreduce(alone, op=MPI.LAND))


def eager_limit(comm, largest=LARGEST, resolution=256):
    """``(largest size sent eagerly, smallest size that waits)`` in bytes, or ``(largest, None)`` if none waits."""
    low, high, n = 0, None, 64
    while n <= largest:
        if _completes_alone(comm, n):
            low = n
        else:
            high = n
            break
        n *= 2
    if high is None:
        return low, None
    while high - low > resolution:
        mid = (low + high) // 2
        if _completes_alone(comm, mid):
            low = mid
        else:
            high = mid
    return low, high


def blocking_ring(comm, nbytes, timeout):
    """Every rank: ``Send`` to rank + 1 (in a helper thread), then ``Recv`` from rank - 1.

    Returns ``(the Send returned before any Recv was posted, seconds until it returned, data right)``.
    If the Send has not returned after ``timeout`` s, the main thread posts the Recv, which lets
    every Send finish.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    data, into = np.full(nbytes, rank % 251, np.uint8), np.empty(nbytes, np.uint8)
    returned, start = threading.Event(), time.perf_counter()
    took = []

    def send():
        comm.Send(data, dest=(rank + 1) % size, tag=2)
        took.append(time.perf_counter() - start)
        returned.set()

    helper = threading.Thread(target=send, daemon=True)
    helper.start()
    alone = returned.wait(timeout)
    # no rank posts its Recv before every rank has watched its Send for the whole timeout
    _poll_all([comm.Ibarrier()], float("inf"))
    comm.Recv(into, source=(rank - 1) % size, tag=2)
    helper.join(timeout)
    right = bool(np.all(into == ((rank - 1) % size) % 251))
    return alone, took[0] if took else float("inf"), right


def _poll_all(requests, timeout):
    start = time.perf_counter()
    while not MPI.Request.Testall(requests):
        if time.perf_counter() - start > timeout:
            return None
        time.sleep(1e-4)
    return time.perf_counter() - start


def fix_nonblocking(comm, nbytes, timeout):
    """Isend + Irecv, then wait for both: nobody blocks before its receive is posted."""
    rank, size = comm.Get_rank(), comm.Get_size()
    data, into = np.full(nbytes, rank % 251, np.uint8), np.empty(nbytes, np.uint8)
    requests = [comm.Irecv(into, source=(rank - 1) % size, tag=3), comm.Isend(data, dest=(rank + 1) % size, tag=3)]
    seconds = _poll_all(requests, timeout)
    return seconds, seconds is not None and bool(np.all(into == ((rank - 1) % size) % 251))


def fix_sendrecv(comm, nbytes, timeout):
    """Sendrecv: MPI posts the send and the receive together."""
    rank, size = comm.Get_rank(), comm.Get_size()
    data, into = np.full(nbytes, rank % 251, np.uint8), np.empty(nbytes, np.uint8)
    start, took = time.perf_counter(), []

    def run():
        comm.Sendrecv(data, dest=(rank + 1) % size, sendtag=4, recvbuf=into, source=(rank - 1) % size, recvtag=4)
        took.append(time.perf_counter() - start)

    helper = threading.Thread(target=run, daemon=True)
    helper.start()
    helper.join(timeout)
    if not took:
        return None, False
    return took[0], bool(np.all(into == ((rank - 1) % size) % 251))


DEMOS = {"deadlock": "a ring of blocking Sends: fine below MPI's eager limit, deadlocked above; the two fixes"}


def demo_parser():
    p = argparse.ArgumentParser(prog="python -m mpiring demo", description="Demonstrations that run under mpiexec.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="demos:\n" + "".join(f"  {name:<10}{what}\n" for name, what in DEMOS.items()))
    p.add_argument("name", choices=list(DEMOS), help="which demo")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds to wait for a blocking Send before calling it deadlocked (default 2)")
    return p


def demo(comm, args=None):
    """Run a demo on every rank of ``comm``."""
    options = demo_parser().parse_args(list(args or []))
    return {"deadlock": deadlock_demo}[options.name](comm, options.timeout)


def deadlock_demo(comm, timeout=2.0):
    """Run the demo on ``comm`` (every rank); returns the exit code, the same on every rank."""
    rank = comm.Get_rank()

    def say(text=""):
        if rank == 0:
            print(text, flush=True)

    if comm.Get_size() < 2:
        say("the demo needs a ring of 2 or more ranks: mpiexec -n 2 python -m mpiring demo deadlock")
        return 2
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        say("this MPI does not provide MPI_THREAD_MULTIPLE: the demo needs it to watch a blocking Send")
        return 1
    comm = comm.Dup()
    try:
        return _deadlock_demo(comm, timeout, say)
    finally:
        comm.Free()


def _deadlock_demo(comm, timeout, say):
    size = comm.Get_size()
    say(f"{MPI.Get_library_version().splitlines()[0].strip()}, {size} ranks in a ring: rank r sends to "
        f"(r + 1) % {size} and receives from (r - 1) % {size}")
    say("")
    say("1. The eager limit: a standard-mode Isend, with no receive posted yet")
    low, high = eager_limit(comm)
    if high is None:
        say(f"   every size up to {_size(low)} completed without a receive: this MPI buffers them all,")
        say("   so a ring of blocking sends cannot deadlock here (it still would on another MPI)")
        return 0
    if low == 0:
        say("   even 64 B waits: this MPI sends nothing eagerly between these ranks")
    else:
        say(f"   {_size(low)} completes at once (copied into MPI's buffers: 'eager');")
    say(f"   {_size(high)} waits for the receive ('rendezvous'): the eager limit is between the two")
    say("")
    say("2. The blocking ring: comm.Send(to rank + 1), then comm.Recv(from rank - 1), on every rank")
    ok = True
    for n in sorted({max(64, low // 2), 2 * high, 2**20}):  # below the limit, above it, a ring attention block
        everyone = comm.allgather(blocking_ring(comm, n, timeout))
        all_alone, none_alone = all(a for a, _, _ in everyone), not any(a for a, _, _ in everyone)
        slowest = max(t for _, t, _ in everyone)
        if all_alone:
            say(f"   {_size(n):>9}: every Send returned before any Recv was posted (after at most "
                f"{slowest * 1e3:.2f} ms): works, but only because MPI buffered the message")
        elif none_alone:
            say(f"   {_size(n):>9}: DEADLOCK: no rank's Send returned within {timeout:g} s; every rank is in Send")
            say("              and none in Recv, so no send can complete. (The demo then posted each Recv from")
            say(f"              another thread: the Sends returned after {slowest:.2f} s.)")
        else:
            say(f"   {_size(n):>9}: some Sends returned and some did not: near the limit")
        ok &= all(r for _, _, r in everyone) and (all_alone if n <= low else none_alone or n <= high)
    say("")
    say(f"3. The fixes, with {_size(2**20)} messages")
    for label, fix in (("Isend + Irecv, then Waitall:", fix_nonblocking), ("Sendrecv:", fix_sendrecv)):
        everyone = comm.allgather(fix(comm, 2**20, timeout))
        good = all(s is not None and r for s, r in everyone)
        ok &= good
        say(f"   {label:<29}" + (f"completed on every rank in at most {max(s for s, _ in everyone) * 1e3:.1f} ms, "
                                  f"data right" if good else "FAILED"))
    say("")
    say("A program that is only correct while MPI buffers its sends is unsafe: the MPI standard allows any")
    say("standard-mode Send to wait for its receive. Post receives before (or together with) blocking sends.")
    say("python -m mpiring grade runs every student send in synchronous mode, so an unsafe ring fails at")
    say("every size there, not only above this limit.")
    return 0 if ok else 1
