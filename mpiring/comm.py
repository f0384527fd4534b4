"""Point-to-point traffic of the ring, on a private duplicate of the communicator."""

import time

import numpy as np
from mpi4py import MPI

__all__ = ["RingComm", "CommTimeout", "wait_until"]


class CommTimeout(RuntimeError):
    """A ring transfer did not complete within the requested timeout."""


def wait_until(requests, timeout, rank, what, start=None):
    """Complete ``requests``, or raise CommTimeout ``timeout`` seconds after ``start`` (None: wait forever)."""
    if timeout is None:
        MPI.Request.Waitall(requests)
        return
    start = time.perf_counter() if start is None else start
    while not MPI.Request.Testall(requests):
        if time.perf_counter() - start > timeout:
            raise CommTimeout(f"rank {rank}: {what} not complete after {timeout:g} s "
                              f"(another rank may have failed or stalled)")
        time.sleep(1e-4)


class RingComm:
    """Neighbours of this rank and the non-blocking K/V transfers between them.

    Three verbs: ``shift`` starts sending blocks to the next rank of each stream
    while receiving the following blocks from the previous one, ``progress``
    lets MPI move data while the caller computes, and ``wait`` completes the
    transfers. Counters record bytes, messages and time spent blocked in wait.
    """

    def __init__(self, comm):
        self.comm = comm.Dup()  # the ring's messages never mix with the caller's
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # stream +1 sends to rank + 1 and receives from rank - 1; stream -1 the reverse
        self.send_rank = {+1: (self.rank + 1) % self.size, -1: (self.rank - 1) % self.size}
        self.recv_rank = {+1: (self.rank - 1) % self.size, -1: (self.rank + 1) % self.size}
        self._requests = []
        self.bytes_sent = 0
        self.messages = 0
        self.wait_time = 0.0

    @staticmethod
    def _tag(stream, index):
        """K and V (index 0, 1) of each stream get their own tag: with P = 2 both neighbours are one rank."""
        return (0 if stream > 0 else 2) + index

    def shift(self, sends, recvs):
        """Start moving ``sends[stream]`` arrays on and receiving into ``recvs[stream]``."""
        if self._requests:
            raise RuntimeError("shift called again before wait")
        for stream, arrays in sends.items():
            for index, (send, recv) in enumerate(zip(arrays, recvs[stream])):
                tag = self._tag(stream, index)
                self._requests.append(self.comm.Irecv(recv, source=self.recv_rank[stream], tag=tag))
                self._requests.append(self.comm.Isend(send, dest=self.send_rank[stream], tag=tag))
                self.bytes_sent += send.nbytes
                self.messages += 1

    def progress(self):
        """Let MPI advance pending transfers (call between compute tiles)."""
        if self._requests:
            MPI.Request.Testall(self._requests)

    def wait(self, timeout=None):
        """Complete the transfers started by ``shift``; blocked time goes to ``wait_time``."""
        start = time.perf_counter()
        try:
            wait_until(self._requests, timeout, self.rank, "ring transfer", start)
        finally:
            self.wait_time += time.perf_counter() - start
        self._requests = []

    def free(self):
        """Release the private communicator (pending requests are cancelled first)."""
        for req in self._requests:
            try:
                req.Cancel()
                req.Free()
            except MPI.Exception:
                pass
        self._requests = []
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


class Buffers:
    """Two flat receive buffers per array, so a block can arrive while another is used."""

    def __init__(self, templates, max_len):
        # one (2, n_elements) buffer per template array (K, V), sized for the longest shard
        self._flat = [np.empty((2, int(np.prod(t.shape[:-2])) * max_len * t.shape[-1]), t.dtype) for t in templates]
        self._templates = templates
        self._next = 0

    def take(self, seq_len):
        """Contiguous views shaped like the templates with ``seq_len`` rows, alternating buffers."""
        i, self._next = self._next, 1 - self._next
        views = []
        for flat, t in zip(self._flat, self._templates):
            shape = t.shape[:-2] + (seq_len, t.shape[-1])
            views.append(flat[i, : int(np.prod(shape))].reshape(shape))
        return tuple(views)
