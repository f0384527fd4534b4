"""The ring's communicator: ``RingComm`` moves blocks to the next rank of each stream, ``HomeRing`` sends partials home.

Each owns a private duplicate of the caller's communicator and the MPI
datatypes its messages use (committed at first use, kept for its life), and
frees both (``free()``, or ``with``). What to send when comes from the plan
(``mpiring.plans.plan``), what to compute from ``mpiring.core.block``; waits,
collectives and receive slots are ``waits``, ``collectives`` and ``buffers``.
"""

import time

import numpy as np
from mpi4py import MPI

from ..core.buffers import mpi_view, payload_bytes
from ..core.tiles import as_view
from .waits import abandon, completed, cut_short, test_all, wait_until

__all__ = ["RingComm", "HomeRing", "shift"]


class RingComm:
    """Neighbours of this rank and the non-blocking K/V transfers between them.

    Three verbs: ``shift`` starts sending blocks to the next rank of each stream
    while receiving the following blocks from the previous one, ``progress``
    lets MPI move data while the caller computes, and ``wait`` completes the
    transfers. Counters record bytes, messages and time spent blocked in wait.
    Owns a duplicate of the caller's communicator and its messages' datatypes:
    use it as a context manager (``with RingComm(comm) as ring:``) or call ``free()``.
    """

    def __init__(self, comm, timeout=None):
        # the ring's messages never mix with the caller's; a non-blocking duplicate, so a rank
        # that failed before joining it cannot leave this one waiting beyond the timeout
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._types = {}  # the committed datatypes of this ring's messages, by shape: freed with it
        self.comm, request = comm.Idup()
        self._requests = [request]
        try:
            wait_until(self._requests, timeout, self.rank, "communicator duplicate", sync=True)
        except BaseException:
            self.free()
            raise
        self._requests = []
        # stream +1 sends to rank + 1 and receives from rank - 1; stream -1 the reverse
        self.send_rank = {+1: (self.rank + 1) % self.size, -1: (self.rank - 1) % self.size}
        self.recv_rank = {+1: (self.rank - 1) % self.size, -1: (self.rank + 1) % self.size}
        self.bytes_sent = 0
        self.messages = 0
        self.wait_time = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    @staticmethod
    def _tag(stream, index):
        """K and V (index 0, 1) of each stream get their own tag: with P = 2 both neighbours are one rank."""
        return (0 if stream > 0 else 2) + index

    def shift(self, sends, recvs, pad=0):
        """Start moving ``sends[stream]`` arrays on and receiving into ``recvs[stream]``.

        With ``pad``, the last ``pad`` rows of every (..., rows, n) array (the
        forward ring's row of ones) stay where they are: only the data travels.
        """
        if self._requests:
            raise RuntimeError("shift called again before wait")
        for stream, arrays in sends.items():
            for index, (send, recv) in enumerate(zip(arrays, recvs[stream])):
                tag = self._tag(stream, index)
                self._requests.append(self.comm.Irecv(self._message(recv, pad), source=self.recv_rank[stream], tag=tag))
                self._requests.append(self.comm.Isend(self._message(send, pad), dest=self.send_rank[stream], tag=tag))
                self.bytes_sent += payload_bytes(send, pad)
                self.messages += 1

    def _message(self, a, pad):
        """MPI buffer of ``a`` (..., rows, n) without its last ``pad`` rows per leading index.

        For the ring's [k | 1]^T blocks: the D*n data values of every head are
        contiguous, so the message is one MPI vector of big contiguous pieces.
        """
        a = mpi_view(a)
        if not pad:
            return a
        count, width, n = a.size // (a.shape[-2] * a.shape[-1]), a.shape[-2], a.shape[-1]
        key = (a.dtype.char, count, (width - pad) * n, width * n)
        if key not in self._types:
            self._types[key] = MPI._typedict[a.dtype.char].Create_vector(count, (width - pad) * n, width * n).Commit()
        return [a, 1, self._types[key]]

    def progress(self):
        """Let MPI advance pending transfers (call between compute tiles)."""
        if self._requests:
            test_all(self._requests, self.rank, "ring transfer")

    def wait(self, timeout=None, note=None):
        """Complete the transfers started by ``shift``; blocked time goes to ``wait_time``."""
        start = time.perf_counter()
        try:
            wait_until(self._requests, timeout, self.rank, "ring transfer", start, note)
        finally:
            self.wait_time += time.perf_counter() - start
        self._requests = []

    def free(self):
        """Release the private communicator and the datatypes, or abandon them if transfers are still pending.

        Pending transfers exist only on an error path (another rank failed or
        stalled). They are never cancelled (cancelling a pending send crashed
        MPICH) nor freed: the requests, their buffers, the datatypes and the
        communicator are kept alive in ``ABANDONED`` for the life of the
        process, so MPI can never touch freed memory, and the caller's error
        propagates. Returns whether everything was freed.
        """
        if (self._requests and not completed(self._requests)) or cut_short():
            abandon((self.comm, self._requests, self._types))  # the datatypes too: pending transfers use them
            self._requests, self._types = [], {}
            return False
        self._requests = []
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        for datatype in self._types.values():
            datatype.Free()
        self._types = {}
        return True


class HomeRing(RingComm):
    """The hop home: a stream's last visitor sends each block's partial to its owner, R ranks back.

    Unlike ``RingComm.shift`` (all arrays at once), a partial goes home in key
    chunks: ``send_chunk`` sends keys lo:hi of dK and dV as soon as they are
    done, and the owner posts the matching receives early (``expect``). A chunk
    is an MPI subarray datatype (keys lo:hi of every head), so nothing is copied
    into a send buffer. Tags tell streams, chunks, dK and dV apart; K/V and the
    onward partials use other communicators.
    """

    def __init__(self, comm, plan, timeout=None):
        super().__init__(comm, timeout)
        for stream, rounds in plan.rounds.items():  # the 'neighbours' are a stream's rounds away
            self.send_rank[stream] = (self.rank - stream * rounds) % self.size
            self.recv_rank[stream] = (self.rank + stream * rounds) % self.size

    @staticmethod
    def _chunk_tag(stream, chunk, index):
        return 4 * chunk + (0 if stream > 0 else 2) + index

    def _keys(self, a, lo, hi):
        """Keys lo:hi of the contiguous (..., n, d) array ``a`` as an MPI message: a vector datatype (one
        contiguous run of (hi - lo) * d values per head) from key lo on.

        Not a subarray datatype: MPICH moved such a message between two processes of one node through its
        small copy cells, a few KiB per poll (4 MiB took 514 polls), where a vector of long runs moves in one
        poll, as a contiguous message does (docs/performance.md §15).
        """
        a = mpi_view(a)
        rows, n, d = int(np.prod(a.shape[:-2])), a.shape[-2], a.shape[-1]
        key = (a.dtype.char, rows, n, d, hi - lo)
        if key not in self._types:
            self._types[key] = MPI._typedict[a.dtype.char].Create_vector(rows, (hi - lo) * d, n * d).Commit()
        return [as_view(a, (a.size,))[lo * d:], 1, self._types[key]]  # as_view: raises rather than copy

    def expect(self, stream, arrays, chunks):
        """Post the receives of every key chunk of ``arrays`` (dK, dV of this rank's block) on ``stream``."""
        for chunk, (lo, hi) in enumerate(chunks):
            for index, a in enumerate(arrays):
                self._requests.append(self.comm.Irecv(self._keys(a, lo, hi), source=self.recv_rank[stream],
                                                      tag=self._chunk_tag(stream, chunk, index)))

    def send_chunk(self, stream, arrays, chunk, lo, hi):
        """Start sending keys lo:hi of ``arrays`` (a partial's dK, dV) home; returns the bytes."""
        sent = 0
        for index, a in enumerate(arrays):
            self._requests.append(self.comm.Isend(self._keys(a, lo, hi), dest=self.send_rank[stream],
                                                  tag=self._chunk_tag(stream, chunk, index)))
            sent += a.nbytes // a.shape[-2] * (hi - lo)
            self.messages += 1
        self.bytes_sent += sent
        return sent


def shift(ring, sends, recvs, rec, step, data="K/V", pad=0):
    """Start the next transfers (``ring.shift``) and note one "send" event per stream in ``rec``."""
    posted = time.perf_counter()
    ring.shift(sends, recvs, pad)
    for stream, arrays in sends.items():
        rec.event("send", posted, step=step, stream=stream, data=data, dest=ring.send_rank[stream],
                  bytes=sum(payload_bytes(a, pad) for a in arrays))
