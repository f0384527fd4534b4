"""Backward pass of ring attention: K/V travel the ring again, and their gradients travel with them.

    mpiexec -n 4 python -m mpiring run --backward --causal --layout zigzag --heads 8 --kv-heads 2

Every rank keeps its q, dout, out, lse and delta = rowsum(dout * out); the
K/V blocks move exactly as in the forward plan. The partial dK/dV of a block
joins it at its first visitor after the owner, is accumulated by every rank
it visits, and its last hop takes it home, in key chunks sent while the rest
of the block still computes (docs/backward.md). The softmax is
recomputed from the saved lse, one block tile at a time, so memory per rank
stays O(S/P). Partial gradients travel in float64 whatever the input dtype.
"""

import time

import numpy as np
from mpi4py import MPI

from .comm import Buffers, RingComm, wait_until
from .costmodel import predicted_bytes_sent
from .kernels import LSE_LIMIT, attention_block_backward
from .ring import (Record, _agree_outcome, _allgather, _canonical, _compared, _describe, _differences,
                   _flat_blocks, _gather, _local_problem, _receive_buffers, _recorded_schedule, _root_problem,
                   _scatter, _setup, _shift, _start_allgather, _summary, _timeout_problem, _verdict,
                   _wait_allgather, agree, ring_attention)
from .schedule import make_plan

__all__ = ["ring_attention_backward", "distributed_attention_backward", "predicted_backward_bytes"]

GRAD_DTYPE = np.dtype(np.float64)  # travelling and accumulated gradients: no precision lost as P grows
HOME_CHUNKS = 4  # a partial goes home in this many key chunks, each sent as soon as its keys are done


# ---------------------------------------------------------------- validation


def _grad_problem(dout, q, k, v, out, lse):
    """What is wrong with this rank's dout, out or lse, or None (q, k, v are checked by ``_setup``)."""
    try:
        if _local_problem(q, k, v, None):
            return None
        rows = q.shape[:-1]
        for name, a, shape in (("dout", dout, rows + v.shape[-1:]), ("out", out, rows + v.shape[-1:]),
                               ("lse", lse, rows)):
            if not isinstance(a, np.ndarray):
                return f"{name} must be a NumPy array, got {type(a).__name__}"
            if a.shape != shape:
                return f"{name} must have shape {shape} (from q and v), got {a.shape}"
            if a.dtype != q.dtype:
                return f"{name} must have the dtype of q ({q.dtype}), got {a.dtype}"
        peak = float(np.max(np.abs(lse), initial=0, where=np.isfinite(lse)))
        if peak > LSE_LIMIT[q.dtype]:
            return (f"lse reaches {peak:.3g}: the probabilities exp(scale q.k - lse) are recomputed from lse, "
                    f"and in {q.dtype} beyond |lse| = {LSE_LIMIT[q.dtype]:g} they lose more than 0.1 % "
                    f"(the gradient would be wrong); rescale q, k or the softmax scale")
    except Exception as exc:  # reported collectively, never raised alone
        return _describe(exc)
    return None


# ---------------------------------------------------------------- one block


def _block_grads(queries, kv, pieces, scale, dq, progress):
    """This rank's queries against ``pieces`` of one K/V block: add into ``dq``, return the keys' shares.

    ``queries = (dout, q, out, lse, delta)`` are this rank's arrays that never move.
    Returns ``[(c, d, dk, dv), ...]``, the kernel's dK and dV of keys c:d (in
    the input dtype); ``_add_grads`` adds them into the block's float64 partial.
    """
    dout, q, out, lse, delta = queries
    k, v = kv
    grads = []
    for a, b, c, d, klo, khi in pieces:
        bq, bk, bv = attention_block_backward(dout[..., a:b, :], q[..., a:b, :], k[..., c:d, :], v[..., c:d, :],
                                              out[..., a:b, :], lse[..., a:b], scale, klo, khi,
                                              delta=delta[..., a:b], progress=progress)
        dq[..., a:b, :] += bq
        grads.append((c, d, bk, bv))
        progress()
    return grads


def _add_grads(total, grads):
    """Add ``_block_grads``' shares into ``total = (dk, dv)``, the block's float64 partial, in place."""
    for c, d, bk, bv in grads:
        total[0][..., c:d, :] += bk
        total[1][..., c:d, :] += bv


def _count_pairs(rec, pieces):
    """Note the score entries of a block's pieces, and how many of them are visible, as the forward pass does."""
    for a, b, c, d, klo, khi in pieces:
        rec.computed_pairs += (b - a) * (d - c)
        rec.visible_pairs += (b - a) * (d - c) if klo is None else int(np.sum(khi - klo))


def _compute(queries, kv, task, pieces, scale, dq, rec, progress, step, **info):
    """``_block_grads`` of one block (or key chunk of it), noted as a "compute" event; [] if nothing to compute."""
    if not pieces:
        return []
    start = time.perf_counter()
    grads = _block_grads(queries, kv, pieces, scale, dq, progress)
    info = {"step": step, "source": task.source, "kind": task.kind, "stream": task.stream, "pass": "backward", **info}
    end = rec.event("compute", start, **info)
    rec.compute_time += end - start
    return grads


# ---------------------------------------------------------------- key chunks of the hop home


def home_chunks(plan):
    """Key chunks of every hop home: HOME_CHUNKS, or fewer if a shard is shorter (the same on every rank)."""
    return min(HOME_CHUNKS, min(len(s) for s in plan.shards))


def key_chunks(n, chunks):
    """``chunks`` near-equal, non-empty key ranges ``(lo, hi)`` that cover 0:n in order (needs chunks <= n)."""
    return [(i * n // chunks, (i + 1) * n // chunks) for i in range(chunks)]


def _cut_to_keys(pieces, lo, hi):
    """The parts of ``pieces`` (as ``plan.pieces`` gives them) on keys lo:hi, with the query rows that see them.

    Together, the cuts of a block's key chunks cover exactly its pieces' visible
    (query, key) pairs, so the dK/dV of keys lo:hi are complete once these are done.
    """
    cut = []
    for a, b, c, d, klo, khi in pieces:
        c2, d2 = max(c, lo), min(d, hi)
        if d2 <= c2:
            continue
        if klo is None:  # every row sees every key
            cut.append((a, b, c2, d2, None, None))
            continue
        first, last = np.clip(c + klo, c2, d2), np.clip(c + khi, c2, d2)  # each row's visible keys in lo:hi
        seen = np.flatnonzero(last > first)
        if seen.size == 0:
            continue
        r0, r1 = int(seen[0]), int(seen[-1]) + 1
        first, last = first[r0:r1], last[r0:r1]
        if np.all(first == c2) and np.all(last == d2):
            cut.append((a + r0, a + r1, c2, d2, None, None))
        else:
            cut.append((a + r0, a + r1, c2, d2, first - c2, last - c2))
    return cut


def _chunks_in_order(pieces, n, chunks):
    """A block's key chunks as ``(chunk, lo, hi, pieces)``, in the order to compute and send them home.

    Chunks in key order, except those this rank adds nothing to: they are
    complete as soon as the arriving partial is, so they go right after the
    first chunk with work (by then that partial has been waited for) rather
    than add to the transfers left at the end.
    """
    cuts = [(chunk, lo, hi, _cut_to_keys(pieces, lo, hi)) for chunk, (lo, hi) in enumerate(key_chunks(n, chunks))]
    busy = [c for c in cuts if c[3]]
    return busy[:1] + [c for c in cuts if not c[3]] + busy[1:]


class _HomeRing(RingComm):
    """The hop home: a stream's last visitor sends each block's partial to its owner, R ranks back.

    Unlike ``RingComm.shift`` (all arrays at once), a partial goes home in key
    chunks: ``send_chunk`` sends keys lo:hi of dK and dV as soon as they are
    done, and the owner posts the matching receives early (``expect``). A chunk
    is an MPI subarray datatype (keys lo:hi of every head), so nothing is copied
    into a send buffer. Tags tell streams, chunks, dK and dV apart; K/V and the
    onward partials use other communicators.
    """

    def __init__(self, comm, plan):
        super().__init__(comm)
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
        super().free()
        for t in self._types.values():
            t.Free()
        self._types = {}


# ---------------------------------------------------------------- the ring


def _backward_ring_loop(dout, q, k, v, out, lse, delta, plan, rings, scale, rec, timeout):
    """Start passing K/V on, compute, wait, swap; a block's dK/dV follows it one step behind, then goes home.

    At a stream's last round the block is computed in key chunks, and each
    chunk's dK/dV is sent home as soon as its keys are done, while the next
    chunk computes: only the last chunk's transfer is left to wait for.
    """
    kv_ring, grad_ring, home_ring = rings
    rank = kv_ring.rank
    queries = (dout, q, out, lse, delta)
    chunks = home_chunks(plan)
    dq = np.zeros(q.shape, GRAD_DTYPE)
    own = [np.zeros(k.shape, GRAD_DTYPE), np.zeros(v.shape, GRAD_DTYPE)]  # step 0: this rank's own block
    held = {stream: (k, v) for stream in plan.rounds or [+1]}  # the K/V block each stream holds now
    arriving = {}  # stream -> the dK/dV partial of the held block, sent by its previous visitor
    longest = max(len(s) for s in plan.shards)
    empty = tuple(np.empty(a.shape[:-2] + (0, a.shape[-1]), GRAD_DTYPE) for a in (k, v))
    kv_buffers = {stream: Buffers((k, v), longest) for stream in plan.rounds}
    grad_buffers = {stream: Buffers(empty, longest) for stream in plan.rounds}
    homecoming = {}  # stream -> this rank's block's partial, from its last visitor on that stream
    for stream, rounds in plan.rounds.items():
        if rounds > 0:  # its receives, one per key chunk (dK and dV), are posted now
            # written now (np.full, not np.empty or calloc'd np.zeros), so the pages are mapped before
            # the last chunk lands: a first touch costs ~2 ms per MiB on the development VM
            homecoming[stream] = (np.full(k.shape, 0, GRAD_DTYPE), np.full(v.shape, 0, GRAD_DTYPE))
            home_ring.expect(stream, homecoming[stream], key_chunks(k.shape[-2], chunks))

    def progress():
        for ring in rings:
            ring.progress()

    def wait_for(waited, step, data):
        start = time.perf_counter()
        for ring in waited:
            ring.wait(timeout)
        rec.event("wait", start, step=step, data=data)

    def send_home(stream, total, chunk, lo, hi, step):
        posted = time.perf_counter()
        sent = home_ring.send_chunk(stream, total, chunk, lo, hi)
        rec.event("send", posted, step=step, stream=stream, data="dK/dV home", dest=home_ring.send_rank[stream],
                  bytes=sent, keys=f"{lo}:{hi}")

    for step in range(plan.n_steps):
        incoming = _receive_buffers(plan, rank, step, kv_buffers)
        _shift(kv_ring, {s: held[s] for s in incoming}, incoming, rec, step, "K/V")
        partials_due = step >= 2  # partials the previous visitors sent (the first visitor, step 1, starts them)
        onward = {}
        for task in plan.tasks(step, rank):
            stream, n = task.stream, len(plan.shards[task.source])
            pieces = plan.pieces(rank, task.source)
            _count_pairs(rec, pieces)
            if step == 0:
                total = own  # the own block's share stays here
            elif step == 1:  # the first visitor starts the partial
                total = tuple(np.zeros(a.shape[:-2] + (n, a.shape[-1]), GRAD_DTYPE) for a in (k, v))
            else:
                total = arriving[stream]  # added to only after the wait below
            going_home = step > 0 and step == plan.rounds[stream]
            work = _chunks_in_order(pieces, n, chunks) if going_home else [(None, 0, n, pieces)]
            for chunk, lo, hi, cut in work:
                grads = _compute(queries, held[stream], task, cut, scale, dq, rec, progress, step,
                                 **({"keys": f"{lo}:{hi}"} if going_home else {}))
                if partials_due and (grads or going_home):  # once, when first needed: after a compute
                    wait_for([grad_ring], step, "dK/dV")
                    partials_due = False
                _add_grads(total, grads)
                if going_home:  # keys lo:hi are done: off they go, while the next chunk computes
                    send_home(stream, total, chunk, lo, hi, step)
            if 0 < step < plan.rounds[stream]:
                onward[stream] = total
            rec.tasks.append((step, task))
        if partials_due:  # skips only: the partials are passed on unchanged
            wait_for([grad_ring], step, "dK/dV")
        if incoming:
            wait_for([kv_ring], step, "K/V")
        held.update(incoming)
        arriving = {}  # pass each partial on with its block
        for stream in onward:
            source = plan.held_source(rank, stream, step + 1)
            arriving[stream] = grad_buffers[stream].take(len(plan.shards[source]))
        _shift(grad_ring, onward, arriving, rec, step, "dK/dV")
        if getattr(rec, "on_step", None) is not None:
            rec.on_step(step + 1, plan.n_steps)
    if homecoming:  # only the last chunks can still be on their way
        wait_for([grad_ring, home_ring], plan.n_steps - 1, "dK/dV home")
    for dk, dv in homecoming.values():
        own[0] += dk
        own[1] += dv
    return dq, own[0], own[1]


def _allgather_backward(dout, q, k, v, out, lse, delta, plan, comm, scale, rec, timeout):
    """All-gather K/V once, compute every block's dK/dV contribution here, reduce-scatter them to their owners."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = [len(s) for s in plan.shards]
    gathered, requests = _start_allgather(k, v, plan, comm, rec)  # as the forward pass
    sums = [_flat_blocks(a, lengths, GRAD_DTYPE) for a in (k, v)]  # this rank's share of every block's dK, dV
    queries = (dout, q, out, lse, delta)
    dq = np.zeros(q.shape, GRAD_DTYPE)
    progress = lambda: MPI.Request.Testall(requests)  # noqa: E731
    for step in range(plan.n_steps):
        task = plan.tasks(step, rank)[0]
        if step == 1:
            _wait_allgather(requests, timeout, rank, rec)
        kv = (k, v) if step == 0 else (gathered[0][task.source], gathered[1][task.source])
        pieces = plan.pieces(rank, task.source)
        _count_pairs(rec, pieces)
        grads = _compute(queries, kv, task, pieces, scale, dq, rec, progress, step)
        _add_grads((sums[0][2][task.source], sums[1][2][task.source]), grads)
        rec.tasks.append((step, task))
        if getattr(rec, "on_step", None) is not None:
            rec.on_step(step + 1, plan.n_steps)
    if plan.n_steps == 1:  # P = 1: no step waited
        wait_until(requests, timeout, rank, "all-gather")
    own = [np.empty(a.shape, GRAD_DTYPE) for a in (k, v)]
    start = time.perf_counter()
    requests = [comm.Ireduce_scatter(flat, mine, counts) for (flat, counts, _), mine in zip(sums, own)]
    wait_until(requests, timeout, rank, "reduce-scatter")
    rec.wait_time += time.perf_counter() - start
    rec.events.append(("wait", start, time.perf_counter(), {"step": plan.n_steps - 1}))  # the reduce-scatter
    for flat, counts, _ in sums:  # as a ring reduce-scatter moves it: every block but one's own, once
        rec.bytes_sent += (sum(counts) - counts[rank]) * GRAD_DTYPE.itemsize
        rec.messages += size - 1
    return dq, own[0], own[1]


def ring_attention_backward(dout, q, k, v, out, lse, comm=None, *, causal=False, scale=None, layout="contiguous",
                            mode="ring", window=None, cu_seqlens=None, timeout=None, record=None):
    """Gradients ``(dq, dk, dv)`` of this rank's shard, given the upstream gradient ``dout``.

    ``out`` and ``lse`` are what ``ring_attention`` returned on this rank, with
    the same options; all arrays are this rank's shard in the same layout.
    dk and dv have the shape of k and v (grouped-query: summed over each
    group's query heads). Results have the input dtype; gradients are
    accumulated in float64. Options are those of ``ring_attention``; bad
    input on any rank raises the same ValueError on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    agree(comm, _grad_problem(dout, q, k, v, out, lse), timeout)
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens)
    plan, scale = _setup(q, k, v, comm, scale, options, timeout=timeout)
    dout, q, k, v, out, lse = (np.ascontiguousarray(a) for a in (dout, q, k, v, out, lse))
    delta = np.sum(dout.astype(GRAD_DTYPE) * out, axis=-1).astype(q.dtype)
    rec = Record(comm.Get_rank()) if record is None else record
    rings = []
    try:  # private duplicates: K/V, dK/dV onward, dK/dV home (all-gather needs only the first)
        rings.append(RingComm(comm))
        if plan.mode != "allgather":
            rings += [RingComm(comm), _HomeRing(comm, plan)]
        wait_until([rings[0].comm.Ibarrier()], timeout, rings[0].rank, "start barrier")  # a common start
        rec.t0 = start = time.perf_counter()
        if plan.mode == "allgather":
            dq, dk, dv = _allgather_backward(dout, q, k, v, out, lse, delta, plan, rings[0].comm, scale, rec,
                                             timeout)
        else:
            dq, dk, dv = _backward_ring_loop(dout, q, k, v, out, lse, delta, plan, rings, scale, rec, timeout)
            rec.bytes_sent = sum(ring.bytes_sent for ring in rings)
            rec.messages = sum(ring.messages for ring in rings)
            rec.wait_time = sum(ring.wait_time for ring in rings)
        if timeout is not None:  # as in the forward pass: a failed rank skips this, the others time out
            _agree_outcome(rings[0], timeout)
    finally:
        for ring in rings:
            ring.free()
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def predicted_backward_bytes(plan, kv_width, itemsize, grad_itemsize=GRAD_DTYPE.itemsize):
    """Bytes each rank sends in the backward pass; ``kv_width`` = elements of K plus V per token.

    Ring modes: at steps 0 .. R-1 of a stream the rank sends the K/V block it
    holds, at steps 1 .. R the dK/dV partial of the block it holds (in
    ``grad_itemsize`` bytes per element). All-gather: K/V as the forward pass
    counts them, then every block but the rank's own once as dK/dV.
    """
    n = [len(s) for s in plan.shards]
    sent = []
    for rank, kv_bytes in enumerate(predicted_bytes_sent(plan, kv_width, itemsize)):  # K/V: as forward
        if plan.mode == "allgather":
            grads = sum(n) - n[rank]
        else:
            grads = sum(n[plan.held_source(rank, d, s)] for d, rounds in plan.rounds.items()
                        for s in range(1, rounds + 1))
        sent.append(kv_bytes + kv_width * grads * grad_itemsize)
    return sent


# ---------------------------------------------------------------- scatter / gather on root


def _root_grad_problem(Q, K, V, dOut, scale, size):
    """What is wrong with root's full arrays, or None."""
    problem = _root_problem(Q, K, V) or _local_problem(Q, K, V, scale)
    if problem:
        return problem
    want = Q.shape[:-1] + V.shape[-1:]
    if not isinstance(dOut, np.ndarray) or dOut.shape != want or dOut.dtype != Q.dtype:
        got = f"{dOut.shape} {dOut.dtype}" if isinstance(dOut, np.ndarray) else type(dOut).__name__
        return f"dOut must be a {Q.dtype} array of shape {want}, got {got}"
    if Q.shape[-2] < size:
        return f"sequence length {Q.shape[-2]} is shorter than the number of ranks {size}"
    return None


def distributed_attention_backward(Q, K, V, dOut, comm=None, *, root=0, causal=False, scale=None,
                                   layout="contiguous", mode="ring", window=None, cu_seqlens=None, timeout=None,
                                   return_out=False):
    """Root scatters Q, K, V and dOut; the ring runs forward then backward; root gathers the gradients.

    Returns ``(dQ, dK, dV, schedule)`` on root and Nones elsewhere.
    ``schedule.table[step][rank]`` holds the Tasks each rank recorded in the
    backward pass, ``schedule.records[rank]`` its counters (bytes, messages,
    times), with the forward pass's under ``"forward"``. With
    ``return_out=True`` root gets ``(out, dQ, dK, dV, schedule)``.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens)
    problem = meta = values = None
    try:  # root checks the arrays, every rank its options; one all-gather gives all the same verdict
        problem = _timeout_problem(timeout)
        if problem is None and rank == root:
            problem = _root_grad_problem(Q, K, V, dOut, scale, size)
            if problem is None:
                meta = [(a.shape[:-2], a.shape[-1], a.dtype) for a in (Q, K, V, dOut)] + [Q.shape[-2]]
        if problem is None:
            options = _canonical(options)
            values = _compared(options, timeout)
    except Exception as exc:
        problem, values = _describe(exc), None
    gathered = _allgather(comm, (problem, meta, values), timeout)
    problems = [p for p, _, _ in gathered]
    message = "; ".join(m for m in (f"root rank {root}: {problems[root]}" if problems[root] else None,
                                    _verdict([None if r == root else p for r, p in enumerate(problems)]),
                                    _verdict(_differences([m for _, _, m in gathered], root))) if m)
    if message:
        raise ValueError(message)
    meta = gathered[root][1]
    plan = make_plan(meta[4], size, **options)  # same options everywhere: raises everywhere or nowhere
    q, k, v, dout = (_scatter(x, m, plan, comm, root, timeout) for x, m in zip((Q, K, V, dOut), meta[:4]))
    forward, backward = Record(rank), Record(rank)
    out, lse = ring_attention(q, k, v, comm, scale=scale, timeout=timeout, record=forward, **options)
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, comm, scale=scale, timeout=timeout,
                                         record=backward, **options)
    full = [_gather(a, plan, comm, root, timeout) for a in ((out,) if return_out else ()) + (dq, dk, dv)]
    summary = dict(_summary(backward), forward=_summary(forward))
    columns = comm.gather((backward.table(plan.n_steps), summary), root=root)
    if rank != root:
        return (None,) * (len(full) + 1)
    return (*full, _recorded_schedule(columns, plan))
