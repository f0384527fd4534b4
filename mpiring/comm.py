"""Point-to-point traffic of the ring, on a private duplicate of the communicator."""

import time

import numpy as np
from mpi4py import MPI

__all__ = ["RingComm", "CommTimeout", "wait_until", "Buffers", "KVBuffers"]


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
                self._requests.append(self.comm.Irecv(_message(recv, pad), source=self.recv_rank[stream], tag=tag))
                self._requests.append(self.comm.Isend(_message(send, pad), dest=self.send_rank[stream], tag=tag))
                self.bytes_sent += payload_bytes(send, pad)
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


_vector_types = {}


def _message(a, pad):
    """MPI buffer of ``a`` (..., rows, n) without its last ``pad`` rows per leading index.

    For the ring's [k | 1]^T blocks: the D*n data values of every head are
    contiguous, so the message is one MPI vector of big contiguous pieces.
    """
    if not pad:
        return a
    count, width, n = a.size // (a.shape[-2] * a.shape[-1]), a.shape[-2], a.shape[-1]
    key = (a.dtype.char, count, (width - pad) * n, width * n)
    if key not in _vector_types:
        _vector_types[key] = MPI._typedict[a.dtype.char].Create_vector(count, (width - pad) * n, width * n).Commit()
    return [a, 1, _vector_types[key]]


def payload_bytes(a, pad=0):
    """Bytes of ``a`` that travel when its last ``pad`` rows stay behind."""
    return a.nbytes if not pad else a.nbytes // a.shape[-2] * (a.shape[-2] - pad)


class Buffers:
    """Two flat receive buffers per array, so a block can arrive while another is used."""

    def __init__(self, templates, max_len):
        # one (2, n_elements) buffer per template array (K, V), sized for the longest shard
        self._flat = [np.empty((2, int(np.prod(self._shape(t, max_len)))), t.dtype) for t in templates]
        self._templates = templates
        self._next = 0

    @staticmethod
    def _shape(template, seq_len):
        """A block of ``seq_len`` tokens shaped like ``template`` (..., n, d)."""
        return template.shape[:-2] + (seq_len, template.shape[-1])

    def take(self, seq_len):
        """Contiguous views for a block of ``seq_len`` tokens, alternating buffers."""
        i, self._next = self._next, 1 - self._next
        views = []
        for flat, t in zip(self._flat, self._templates):
            shape = self._shape(t, seq_len)
            views.append(flat[i, : int(np.prod(shape))].reshape(shape))
        return tuple(views)


class KVBuffers(Buffers):
    """The forward ring's K/V blocks: two slots, each block kept as [x | 1]^T.

    A slot holds K and V transposed with a last row of ones, (..., D+1, n),
    the form the forward kernel takes (``kernels.pad_ones``). The ones are
    written here; ``RingComm.shift(..., pad=1)`` moves only the data rows, so
    a received block is ready for the kernel without a copy.
    """

    @staticmethod
    def _shape(template, seq_len):
        return template.shape[:-2] + (template.shape[-1] + 1, seq_len)

    def take(self, seq_len):
        """The next slot's (K, V) views for a block of ``seq_len`` tokens, their rows of ones set."""
        views = super().take(seq_len)
        for view in views:
            view[..., -1, :] = 1
        return views

    def hold(self, arrays):
        """Copy this rank's own (k, v) into the next slot, in the kernel's form, and return it."""
        views = self.take(arrays[0].shape[-2])
        for view, a in zip(views, arrays):
            view[..., :-1, :] = np.swapaxes(a, -1, -2)
        return views
