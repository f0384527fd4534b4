"""Why a ring of blocking sends deadlocks on this MPI, and the two fixes, shown live.

    mpiexec -n 2 python -m mpiring.tools.deadlock
    mpiexec -n 4 python -m mpiring.tools.deadlock --timeout 2

1. The eager limit, measured: each rank starts a standard-mode ``Isend`` (the mode of ``Send``)
   to its neighbour with no receive posted, and polls it. A small message completes at once:
   MPI copied it into its own buffers ("eager"). A large one waits until the receive is posted
   ("rendezvous"). Powers of two from 64 B, then bisection, give the limit.
2. The blocking ring: on a duplicate of COMM_WORLD every rank calls ``comm.Send`` to rank + 1,
   then ``comm.Recv`` from rank - 1. The ``Send`` runs in a helper thread so that the demo can
   watch it: below the eager limit it returns at once; above it no rank's ``Send`` returns, as
   every rank is in ``Send`` and none in ``Recv``: a deadlock. After ``--timeout`` seconds the
   main thread posts the ``Recv`` itself (MPI_THREAD_MULTIPLE), the ``Send``s return, and the
   demo goes on.
3. The fixes, with the large message: ``Isend`` + ``Irecv`` + ``Waitall``, and ``Sendrecv``.
   Both complete, at any size.

Exit code 0 when every rank saw what is described above (or the MPI buffered every size tried,
which is reported), 1 otherwise. Rank 0 prints.
"""

import argparse
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

__all__ = ["deadlock_demo", "eager_limit", "main"]

PROBE_WAIT = 0.2  # seconds a probe Isend may take and still count as "completed without a receive"
LARGEST = 16 * 2**20


def _size(nbytes):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


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


def deadlock_demo(comm, argv):
    """Run the demo on ``comm`` (every rank); returns the exit code, the same on every rank."""
    rank = comm.Get_rank()
    parser = argparse.ArgumentParser(prog="python -m mpiring.tools.deadlock", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="seconds to wait for a blocking Send before calling it deadlocked (default 2)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code

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
    size = comm.Get_size()
    say(f"{MPI.Get_library_version().splitlines()[0].strip()}, {size} ranks in a ring: rank r sends to "
        f"(r + 1) % {size} and receives from (r - 1) % {size}")
    say("")
    say("1. The eager limit: a standard-mode Isend, with no receive posted yet")
    low, high = eager_limit(comm)
    if high is None:
        say(f"   every size up to {_size(low)} completed without a receive: this MPI buffers them all,")
        say("   so a ring of blocking sends cannot deadlock here (it still would on another MPI)")
        comm.Free()
        return 0
    if low == 0:
        say("   even 64 B waits: this MPI sends nothing eagerly between these ranks")
    else:
        say(f"   {_size(low)} completes at once (copied into MPI's buffers: 'eager');")
    say(f"   {_size(high)} waits for the receive ('rendezvous'): the eager limit is between the two")
    say("")
    say("2. The blocking ring: comm.Send(to rank + 1), then comm.Recv(from rank - 1), on every rank")
    sizes = [max(64, low // 2), 2 * high, 2**20]  # below the limit, above it, and a ring attention-sized block
    sizes = sorted(set(sizes))
    ok = True
    for n in sizes:
        alone, took, right = blocking_ring(comm, n, args.timeout)
        everyone = comm.allgather((alone, took, right))
        all_alone = all(a for a, _, _ in everyone)
        none_alone = not any(a for a, _, _ in everyone)
        data_ok = all(r for _, _, r in everyone)
        if all_alone:
            say(f"   {_size(n):>9}: every Send returned before any Recv was posted (after at most "
                f"{max(t for _, t, _ in everyone) * 1e3:.2f} ms): works, but only because MPI buffered the message")
        elif none_alone:
            say(f"   {_size(n):>9}: DEADLOCK: no rank's Send returned within {args.timeout:g} s; every rank is in Send")
            say("              and none in Recv, so no send can complete. (The demo then posted each Recv from")
            say(f"              another thread: the Sends returned after {max(t for _, t, _ in everyone):.2f} s.)")
        else:
            say(f"   {_size(n):>9}: some Sends returned and some did not: near the limit")
        expected_alone = n <= low
        ok &= data_ok and (all_alone if expected_alone else none_alone or n <= high)
    say("")
    say(f"3. The fixes, with {_size(2**20)} messages")
    seconds, right = fix_nonblocking(comm, 2**20, args.timeout)
    everyone = comm.allgather((seconds, right))
    good = all(s is not None and r for s, r in everyone)
    ok &= good
    say("   Isend + Irecv, then Waitall: " + (
        f"completed on every rank in at most {max(s for s, _ in everyone) * 1e3:.1f} ms, data right" if good
        else "FAILED"))
    seconds, right = fix_sendrecv(comm, 2**20, args.timeout)
    everyone = comm.allgather((seconds, right))
    good = all(s is not None and r for s, r in everyone)
    ok &= good
    say("   Sendrecv:                    " + (
        f"completed on every rank in at most {max(s for s, _ in everyone) * 1e3:.1f} ms, data right" if good
        else "FAILED"))
    say("")
    say("A program that is only correct while MPI buffers its sends is unsafe: the MPI standard allows any")
    say("standard-mode Send to wait for its receive. Post receives before (or together with) blocking sends.")
    say("python -m mpiring grade runs every student send in synchronous mode, so an unsafe ring fails at")
    say("every size there, not only above this limit.")
    comm.Free()
    return 0 if ok else 1


def main(argv=None):
    return deadlock_demo(MPI.COMM_WORLD, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
