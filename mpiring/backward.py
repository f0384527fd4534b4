"""Backward pass of ring attention: K/V travel the ring again, and their gradients travel with them.

    mpiexec -n 4 python -m mpiring run --backward --causal --layout zigzag --heads 8 --kv-heads 2

Every rank keeps its q, dout, out, lse and delta = rowsum(dout * out); the
K/V blocks move exactly as in the forward plan. The partial dK/dV of a block
joins it at its first visitor after the owner, is accumulated by every rank
it visits, and its last hop takes it home (docs/backward.md). The softmax is
recomputed from the saved lse, one block tile at a time, so memory per rank
stays O(S/P). Partial gradients travel in float64 whatever the input dtype.
"""

import time

import numpy as np
from mpi4py import MPI

from .comm import Buffers, RingComm, wait_until
from .costmodel import predicted_bytes_sent
from .kernels import attention_block_backward
from .ring import (Record, _receive_buffers, _shift, _agree_outcome, _allgather, _canonical, _compared, _describe, _differences, _gather,
                   _local_problem, _recorded_schedule, _root_problem, _scatter, _setup, _summary, _timeout_problem,
                   _verdict, agree, ring_attention)
from .schedule import make_plan

__all__ = ["ring_attention_backward", "distributed_attention_backward", "predicted_backward_bytes"]

GRAD_DTYPE = np.dtype(np.float64)  # travelling and accumulated gradients: no precision lost as P grows


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
    except Exception as exc:  # reported collectively, never raised alone
        return _describe(exc)
    return None


# ---------------------------------------------------------------- one block


def _block_grads(dout, q, out, lse, delta, kv, task, plan, rank, scale, dq, rec, progress, step):
    """This rank's queries against one K/V block: add into ``dq``, return the block's ``[dk, dv]`` (None if skipped)."""
    if task.kind == "skip":
        return None
    start = time.perf_counter()
    k, v = kv
    grads = [np.zeros(k.shape, GRAD_DTYPE), np.zeros(v.shape, GRAD_DTYPE)]
    for a, b, c, d, klo, khi in plan.pieces(rank, task.source):
        rec.computed_pairs += (b - a) * (d - c)
        rec.visible_pairs += (b - a) * (d - c) if klo is None else int(np.sum(khi - klo))
        bq, bk, bv = attention_block_backward(dout[..., a:b, :], q[..., a:b, :], k[..., c:d, :], v[..., c:d, :],
                                              out[..., a:b, :], lse[..., a:b], scale, klo, khi,
                                              delta=delta[..., a:b], progress=progress)
        dq[..., a:b, :] += bq
        grads[0][..., c:d, :] += bk
        grads[1][..., c:d, :] += bv
        progress()
    end = time.perf_counter()
    rec.compute_time += end - start
    rec.events.append(("compute", start, end, {"step": step, "source": task.source, "kind": task.kind,
                                               "stream": task.stream, "pass": "backward"}))
    return grads


# ---------------------------------------------------------------- the ring


def _home_ring(comm, plan):
    """A RingComm whose 'neighbours' are a stream's rounds away: the last visitor of a block sends it home."""
    home = RingComm(comm)
    for stream, rounds in plan.rounds.items():
        home.send_rank[stream] = (home.rank - stream * rounds) % home.size
        home.recv_rank[stream] = (home.rank + stream * rounds) % home.size
    return home


def _backward_ring_loop(dout, q, k, v, out, lse, delta, plan, rings, scale, rec, timeout):
    """Start passing K/V on, compute, wait, swap; a block's dK/dV follows it one step behind, then goes home."""
    kv_ring, grad_ring, home_ring = rings
    rank = kv_ring.rank
    dq = np.zeros(q.shape, GRAD_DTYPE)
    own = [np.zeros(k.shape, GRAD_DTYPE), np.zeros(v.shape, GRAD_DTYPE)]  # step 0: this rank's own block
    held = {stream: (k, v) for stream in plan.rounds or [+1]}  # the K/V block each stream holds now
    arriving = {}  # stream -> the dK/dV partial of the held block, sent by its previous visitor
    longest = max(len(s) for s in plan.shards)
    empty = tuple(np.empty(a.shape[:-2] + (0, a.shape[-1]), GRAD_DTYPE) for a in (k, v))
    kv_buffers = {stream: Buffers((k, v), longest) for stream in plan.rounds}
    grad_buffers = {stream: Buffers(empty, longest) for stream in plan.rounds}
    homecoming = {stream: (np.empty(k.shape, GRAD_DTYPE), np.empty(v.shape, GRAD_DTYPE)) for stream in plan.rounds}

    def progress():
        for ring in rings:
            ring.progress()

    for step in range(plan.n_steps):
        incoming = _receive_buffers(plan, rank, step, kv_buffers)
        _shift(kv_ring, {s: held[s] for s in incoming}, incoming, rec, step, "K/V")
        mine = {}
        for task in plan.tasks(step, rank):
            mine[task.stream] = _block_grads(dout, q, out, lse, delta, held[task.stream], task, plan, rank, scale,
                                             dq, rec, progress, step)
            rec.tasks.append((step, task))
        start = time.perf_counter()
        grad_ring.wait(timeout)  # the partials of the blocks held now have arrived
        partial = {}
        for stream, grads in mine.items():
            # step 0: the own block's share stays here; step 1: the first visitor starts the partial
            total = own if step == 0 else arriving.get(stream) or [np.zeros(a.shape, GRAD_DTYPE) for a in held[stream]]
            if grads is not None:
                total[0] += grads[0]
                total[1] += grads[1]
            if step > 0:
                partial[stream] = total
        kv_ring.wait(timeout)
        rec.events.append(("wait", start, time.perf_counter(), {"step": step}))
        held.update(incoming)
        # pass each partial on with its block, or home after the stream's last round
        onward = {s: p for s, p in partial.items() if step < plan.rounds[s]}
        arriving = {}
        for stream in onward:
            source = plan.held_source(rank, stream, step + 1)
            arriving[stream] = list(grad_buffers[stream].take(len(plan.shards[source])))
        _shift(grad_ring, onward, arriving, rec, step, "dK/dV")
        home = {s: p for s, p in partial.items() if step == plan.rounds[s]}
        if home:
            home_ring.wait(timeout)  # a previous stream's homecoming (bidirectional, uneven rounds)
            _shift(home_ring, home, {s: homecoming[s] for s in home}, rec, step, "dK/dV home")
        if getattr(rec, "on_step", None) is not None:
            rec.on_step(step + 1, plan.n_steps)
    start = time.perf_counter()
    grad_ring.wait(timeout)
    home_ring.wait(timeout)
    rec.events.append(("wait", start, time.perf_counter(), {"step": plan.n_steps - 1}))  # the partials home
    for stream, rounds in plan.rounds.items():
        if rounds > 0:
            own[0] += homecoming[stream][0]
            own[1] += homecoming[stream][1]
    return dq, own[0], own[1]


def _flat_blocks(template, lengths, dtype):
    """One flat buffer holding a block per rank, and the per-rank views of it."""
    per_token = int(np.prod(template.shape[:-2])) * template.shape[-1]
    counts = [n * per_token for n in lengths]
    flat = np.zeros(sum(counts), dtype)
    offsets = np.cumsum([0] + counts)
    views = [flat[offsets[j]:offsets[j + 1]].reshape(template.shape[:-2] + (n, template.shape[-1]))
             for j, n in enumerate(lengths)]
    return flat, counts, views


def _allgather_backward(dout, q, k, v, out, lse, delta, plan, comm, scale, rec, timeout):
    """All-gather K/V once, compute every block's dK/dV contribution here, reduce-scatter them to their owners."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = [len(s) for s in plan.shards]
    gathered, requests = [], []
    for a in (k, v):
        flat, counts, views = _flat_blocks(a, lengths, a.dtype)
        requests.append(comm.Iallgatherv(a, [flat, counts]))
        gathered.append(views)
        rec.bytes_sent += a.nbytes * (size - 1)  # as a ring all-gather moves it (as the forward pass counts)
        rec.messages += size - 1
    sums = [_flat_blocks(a, lengths, GRAD_DTYPE) for a in (k, v)]  # this rank's share of every block's dK, dV
    dq = np.zeros(q.shape, GRAD_DTYPE)
    progress = lambda: MPI.Request.Testall(requests)  # noqa: E731
    for step in range(plan.n_steps):
        task = plan.tasks(step, rank)[0]
        if step == 1:
            start = time.perf_counter()
            wait_until(requests, timeout, rank, "all-gather")
            rec.wait_time += time.perf_counter() - start
            rec.events.append(("wait", start, time.perf_counter(), {"step": 0}))
        kv = (k, v) if step == 0 else (gathered[0][task.source], gathered[1][task.source])
        grads = _block_grads(dout, q, out, lse, delta, kv, task, plan, rank, scale, dq, rec, progress, step)
        if grads is not None:
            sums[0][2][task.source][...] += grads[0]
            sums[1][2][task.source][...] += grads[1]
        rec.tasks.append((step, task))
        if getattr(rec, "on_step", None) is not None:
            rec.on_step(step + 1, plan.n_steps)
    MPI.Request.Waitall(requests)  # P = 1: no step waited
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
            rings += [RingComm(comm), _home_ring(comm, plan)]
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
