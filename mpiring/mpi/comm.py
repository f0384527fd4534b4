"""How blocks move: the ring's transfers on a private communicator, the hop home, the all-gather.

Everything here talks to MPI; what to send when comes from the plan
(``mpiring.plans.plan``), what to compute from ``mpiring.core.block``.
"""

import contextlib
import ctypes
import functools
import pickle
import threading
import time

import numpy as np
from mpi4py import MPI

from ..core.threads import cores, launcher_local_ranks
from ..core.tiles import scratch, transpose_into

__all__ = ["RingComm", "HomeRing", "CommTimeout", "exclusive", "wait_until", "allgather", "gather", "Buffers",
           "KVBuffers", "CodedBuffers", "kv_slots", "mpi_view", "next_buffers", "shift", "flat_blocks", "allgathered",
           "payload_bytes"]


# what a timed-out wait says when it knows no better
CAUSES = "another rank may have failed or stalled, or its compute step outlasted the timeout"
# How a rank waits (docs/performance.md §10). It polls MPI without pause for SPIN_SECONDS, as
# MPI_Waitall would: a large transfer moves only while someone polls, and in a balanced ring the
# others finish about when this rank did. Past that they are still computing, and a rank that kept
# spinning took a core from the slower rank it waited for on a shared machine (the backward under
# one busy process: 11.3 s against 5.4 s): the wait sleeps between polls, 50 us doubling to 1 ms,
# and after each nap polls for BURST_SECONDS, so data that starts to move keeps moving (naps alone
# slowed the idle backward by 10-20 %). A wait that carries no data (a barrier, an agreement, the
# end-of-ring check: ``sync=True``) spins SYNC_SPIN_SECONDS and needs no bursts.
SPIN_SECONDS = 0.1
BURST_SECONDS = 1e-3
SYNC_SPIN_SECONDS = 0.02
NAP_SECONDS = (5e-5, 1e-3)


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
    spin, burst = (SYNC_SPIN_SECONDS, 0.0) if sync else (SPIN_SECONDS, BURST_SECONDS)
    polled, nap = time.perf_counter(), NAP_SECONDS[0]
    while not test_all(requests, rank, what):
        now = time.perf_counter()
        if timeout is not None and now - start > timeout:
            raise CommTimeout(f"rank {rank}: {what} not complete after {timeout:g} s ({note or CAUSES})")
        if shares_cores():  # more ranks than cores here: a spinning rank would slow the one computing
            time.sleep(1e-4)
        elif now - polled > spin:  # the others are still computing: leave the core to them
            time.sleep(nap)
            nap = min(2 * nap, NAP_SECONDS[1])
            until = time.perf_counter() + burst  # data: a burst of polls after each nap keeps it moving
            while time.perf_counter() < until and not test_all(requests, rank, what):
                pass


def allgather(comm, obj, timeout=None):
    """``comm.allgather(obj)`` that raises CommTimeout if some rank does not join in time.

    Always non-blocking collectives (they never match blocking ones), so ranks
    with and without a timeout still pair up.
    """
    start, rank = time.perf_counter(), comm.Get_rank()
    data = _pickled(obj)
    sizes = np.empty(comm.Get_size(), np.int64)
    wait_until([comm.Iallgather(np.array([data.size], np.int64), sizes)], timeout, rank, "agreement", start,
               sync=True)
    flat = np.empty(int(sizes.sum()), np.uint8)
    wait_until([comm.Iallgatherv(data, [flat, sizes])], timeout, rank, "agreement", start, sync=True)
    return _unpickled(flat, sizes)


def gather(comm, obj, root, timeout=None):
    """``comm.gather(obj, root)`` (a list on root, None elsewhere) that raises CommTimeout past ``timeout``."""
    start, rank = time.perf_counter(), comm.Get_rank()
    data = _pickled(obj)
    sizes = np.empty(comm.Get_size(), np.int64) if rank == root else None
    wait_until([comm.Igather(np.array([data.size], np.int64), sizes, root=root)], timeout, rank, "gather", start,
               sync=True)
    flat = np.empty(int(sizes.sum()), np.uint8) if rank == root else None
    wait_until([comm.Igatherv(data, [flat, sizes] if rank == root else None, root=root)], timeout, rank, "gather",
               start)
    return _unpickled(flat, sizes) if rank == root else None


def _pickled(obj):
    """``obj`` as a byte array for the v-collectives."""
    return np.frombuffer(pickle.dumps(obj), np.uint8)


def _unpickled(flat, sizes):
    """The objects of every rank from the concatenated bytes ``flat`` (``sizes[r]`` bytes of rank r)."""
    offsets = np.cumsum(np.concatenate([[0], sizes]))
    return [pickle.loads(flat[offsets[r]:offsets[r + 1]].tobytes()) for r in range(len(sizes))]


class RingComm:
    """Neighbours of this rank and the non-blocking K/V transfers between them.

    Three verbs: ``shift`` starts sending blocks to the next rank of each stream
    while receiving the following blocks from the previous one, ``progress``
    lets MPI move data while the caller computes, and ``wait`` completes the
    transfers. Counters record bytes, messages and time spent blocked in wait.
    Owns a duplicate of the caller's communicator: use it as a context manager
    (``with RingComm(comm) as ring:``) or call ``free()``.
    """

    def __init__(self, comm, timeout=None):
        # the ring's messages never mix with the caller's; a non-blocking duplicate, so a rank
        # that failed before joining it cannot leave this one waiting beyond the timeout
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
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
                self._requests.append(self.comm.Irecv(_message(recv, pad), source=self.recv_rank[stream], tag=tag))
                self._requests.append(self.comm.Isend(_message(send, pad), dest=self.send_rank[stream], tag=tag))
                self.bytes_sent += payload_bytes(send, pad)
                self.messages += 1

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
        """Release the private communicator, or abandon it if transfers are still pending.

        Pending transfers exist only on an error path (another rank failed or
        stalled). They are never cancelled (cancelling a pending send crashed
        MPICH) nor freed: the requests, their buffers and the communicator are
        kept alive in ``ABANDONED`` for the life of the process, so MPI can
        never touch freed memory, and the caller's error propagates.
        """
        if self._requests and not _completed(self._requests):
            abandon((self.comm, self._requests, getattr(self, "_types", None)))
            self._requests = []
            return False
        self._requests = []
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        return True


def _completed(requests):
    """Whether ``requests`` are complete; one that failed (a peer gone) is not, and stays pending."""
    try:
        return MPI.Request.Testall(requests)
    except MPI.Exception:
        return False


_vector_types = {}


def mpi_view(a):
    """``a`` as every MPI can take it: half floats viewed as the same bytes of uint16.

    bfloat16 has no buffer format, and float16 no MPI type in MPIs without
    MPI_C_FLOAT16 (Open MPI 4: mpi4py raises KeyError 'e'); the bytes travel alike.
    """
    if a is None or a.dtype.itemsize != 2 or a.dtype.kind not in "fV":
        return a
    return a.view(np.uint16)


def _message(a, pad):
    """MPI buffer of ``a`` (..., rows, n) without its last ``pad`` rows per leading index.

    For the ring's [k | 1]^T blocks: the D*n data values of every head are
    contiguous, so the message is one MPI vector of big contiguous pieces.
    """
    a = mpi_view(a)
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

    def __init__(self, templates, max_len, name=None):
        # one (2, n_elements) buffer per template array (K, V), sized for the longest shard; with a name,
        # this thread's kept buffers of that name (``tiles.scratch``): no fresh memory, no page faults
        shapes = [(2, int(np.prod(self._shape(t, max_len)))) for t in templates]
        self._flat = [np.empty(shape, t.dtype) if name is None else scratch(f"{name}.{i}", shape, t.dtype)
                      for i, (shape, t) in enumerate(zip(shapes, templates))]
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
            transpose_into(a, view[..., :-1, :])
        return views


class CodedBuffers(Buffers):
    """The forward ring's K/V slots when blocks travel coded (``precision.Wire``): two slots of the wire form."""

    def __init__(self, wire, arrays, max_len, name=None):
        super().__init__(tuple(wire.template(a) for a in arrays), max_len, name)
        self._wire = wire

    def hold(self, arrays):
        """Code this rank's own (k, v) into the next slot and return it."""
        views = self.take(arrays[0].shape[-2])
        for view, a in zip(views, arrays):
            self._wire.encode(a, view)
        return views


def kv_slots(wire, arrays, max_len, name=None):
    """The forward ring's receive slots for ``wire``: the kernel's own form (``KVBuffers``) unless it codes blocks.

    ``name``: in this thread's kept buffers of that name (``Buffers``)."""
    return CodedBuffers(wire, arrays, max_len, name) if wire.coded else KVBuffers(arrays, max_len, name)


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
        self._types = {}

    @staticmethod
    def _chunk_tag(stream, chunk, index):
        return 4 * chunk + (0 if stream > 0 else 2) + index

    def _keys(self, a, lo, hi):
        """Keys lo:hi of the contiguous (..., n, d) array ``a`` as an MPI message (a subarray datatype)."""
        rows, n, d = int(np.prod(a.shape[:-2])), a.shape[-2], a.shape[-1]
        key = (a.dtype.char, rows, n, d, lo, hi)
        if key not in self._types:
            base = MPI._typedict[a.dtype.char]
            self._types[key] = base.Create_subarray([rows, n, d], [rows, hi - lo, d], [0, lo, 0]).Commit()
        return [a, 1, self._types[key]]

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

    def free(self):
        if super().free():  # abandoned transfers may still use the datatypes: then they are kept too
            for t in self._types.values():
                t.Free()
        self._types = {}


def next_buffers(plan, rank, step, buffers):
    """Per stream, a buffer for the block it brings next step, where some rank still needs it."""
    incoming = {}
    for stream, rounds in plan.rounds.items():
        if step < rounds:
            source = plan.held_source(rank, stream, step + 1)
            incoming[stream] = buffers[stream].take(len(plan.kv_shards[source]))
    return incoming


def shift(ring, sends, recvs, rec, step, data="K/V", pad=0):
    """Start the next transfers (``ring.shift``) and note one "send" event per stream in ``rec``."""
    posted = time.perf_counter()
    ring.shift(sends, recvs, pad)
    for stream, arrays in sends.items():
        rec.event("send", posted, step=step, stream=stream, data=data, dest=ring.send_rank[stream],
                  bytes=sum(payload_bytes(a, pad) for a in arrays))


def flat_blocks(template, lengths, dtype, empty=False):
    """One flat buffer holding a block per rank (``lengths[j]`` tokens shaped like ``template``), and its views.

    Returns ``(flat, counts, views)``: counts are elements per rank, as MPI's
    v-collectives take them. Zeros unless ``empty``.
    """
    per_token = int(np.prod(template.shape[:-2])) * template.shape[-1]
    counts = [n * per_token for n in lengths]
    flat = (np.empty if empty else np.zeros)(sum(counts), dtype)
    offsets = np.cumsum([0] + counts)
    views = [flat[offsets[j]:offsets[j + 1]].reshape(template.shape[:-2] + (n, template.shape[-1]))
             for j, n in enumerate(lengths)]
    return flat, counts, views


def start_allgather(k, v, plan, comm, rec):
    """Post the all-gather of every rank's K and V; returns (per-rank K views, per-rank V views) and the requests.

    Bytes and messages are counted as a ring all-gather moves them.
    """
    size = comm.Get_size()
    lengths = [len(s) for s in plan.kv_shards]
    gathered, requests = [], []
    for a in (k, v):
        flat, counts, views = flat_blocks(a, lengths, a.dtype, empty=True)
        requests.append(comm.Iallgatherv(mpi_view(a), [mpi_view(flat), counts]))
        gathered.append(views)
        rec.bytes_sent += a.nbytes * (size - 1)
        rec.messages += size - 1
    return gathered, requests


def allgathered(k, v, plan, comm, rec, timeout):
    """The all-gather as a loop: post it, then yield ``(step, task, (k, v) of the task's block, progress)``.

    Step 0 is this rank's own block, computed while the all-gather moves; it
    is completed (with the timeout) before step 1, or after step 0 when P = 1.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    posted = time.perf_counter()
    gathered, requests = start_allgather(k, v, plan, comm, rec)
    rec.event("send", posted, step=0, stream=0, dest="all", bytes=(k.nbytes + v.nbytes) * (size - 1))

    def progress():
        test_all(requests, rank, "all-gather")

    for step in range(plan.n_steps):
        task = plan.tasks(step, rank)[0]
        if step == 1:
            wait_allgather(requests, timeout, rank, rec)
        yield step, task, (k, v) if step == 0 else (gathered[0][task.source], gathered[1][task.source]), progress
    if plan.n_steps == 1:
        wait_until(requests, timeout, rank, "all-gather")


def wait_allgather(requests, timeout, rank, rec):
    """Complete the all-gather (with the timeout) and note the time blocked as step 0's wait."""
    start = time.perf_counter()
    wait_until(requests, timeout, rank, "all-gather")
    end = time.perf_counter()
    rec.wait_time += end - start
    rec.events.append(("wait", start, end, {"step": 0}))
