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

from . import block
from .agree import check_comm, grad_problem, resolve_timeout, setup
from .block import GRAD_DTYPE, add_grads, count_pairs
from .comm import Buffers, HomeRing, RingComm, allgathered, exclusive, flat_blocks, next_buffers, shift, wait_until
from .heads import HybridPlan, grid_problem, heads_problem
from .plan import chunks_in_order, home_chunks, key_chunks
from .record import Record
from .ring import agree_outcome

__all__ = ["ring_attention_backward"]


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
        incoming = next_buffers(plan, rank, step, kv_buffers)
        shift(kv_ring, {s: held[s] for s in incoming}, incoming, rec, step, "K/V")
        partials_due = step >= 2  # partials the previous visitors sent (the first visitor, step 1, starts them)
        onward = {}
        for task in plan.tasks(step, rank):
            stream, n = task.stream, len(plan.shards[task.source])
            pieces = plan.pieces(rank, task.source)
            count_pairs(rec, pieces)
            if step == 0:
                total = own  # the own block's share stays here
            elif step == 1:  # the first visitor starts the partial
                total = tuple(np.zeros(a.shape[:-2] + (n, a.shape[-1]), GRAD_DTYPE) for a in (k, v))
            else:
                total = arriving[stream]  # added to only after the wait below
            going_home = step > 0 and step == plan.rounds[stream]
            work = chunks_in_order(pieces, n, chunks) if going_home else [(None, 0, n, pieces)]
            for chunk, lo, hi, cut in work:
                grads = block.grads_of(queries, held[stream], task, cut, scale, dq, rec, progress, step,
                                 **({"keys": f"{lo}:{hi}"} if going_home else {}))
                if partials_due and (grads or going_home):  # once, when first needed: after a compute
                    wait_for([grad_ring], step, "dK/dV")
                    partials_due = False
                add_grads(total, grads)
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
        shift(grad_ring, onward, arriving, rec, step, "dK/dV")
        rec.step_done(step, plan.n_steps)
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
    sums = [flat_blocks(a, lengths, GRAD_DTYPE) for a in (k, v)]  # this rank's share of every block's dK, dV
    queries = (dout, q, out, lse, delta)
    dq = np.zeros(q.shape, GRAD_DTYPE)
    for step, task, kv, progress in allgathered(k, v, plan, comm, rec, timeout):  # as the forward pass
        pieces = plan.pieces(rank, task.source)
        count_pairs(rec, pieces)
        grads = block.grads_of(queries, kv, task, pieces, scale, dq, rec, progress, step)
        add_grads((sums[0][2][task.source], sums[1][2][task.source]), grads)
        rec.tasks.append((step, task))
        rec.step_done(step, plan.n_steps)
    own = [np.empty(a.shape, GRAD_DTYPE) for a in (k, v)]
    start = time.perf_counter()
    requests = [comm.Ireduce_scatter(flat, mine, counts) for (flat, counts, _), mine in zip(sums, own)]
    wait_until(requests, timeout, rank, "reduce-scatter")
    rec.wait_time += time.perf_counter() - start
    rec.events.append(("wait", start, time.perf_counter(), {"step": plan.n_steps - 1}))  # the reduce-scatter
    for _, counts, _ in sums:  # as a ring reduce-scatter moves it: every block but one's own, once
        rec.bytes_sent += (sum(counts) - counts[rank]) * GRAD_DTYPE.itemsize
        rec.messages += size - 1
    return dq, own[0], own[1]


def ring_attention_backward(
    dout: np.ndarray,  # (..., Hq, n, Dv): the loss's gradient w.r.t. this rank's out
    q: np.ndarray, k: np.ndarray, v: np.ndarray,  # as ring_attention: (..., Hq|Hk, n, D), v (..., Hk, n, Dv)
    out: np.ndarray, lse: np.ndarray,  # what ring_attention returned: (..., Hq, n, Dv), (..., Hq, n)
    comm=None, *, causal: bool = False, scale: float | None = None, layout: str = "contiguous",
    mode: str = "ring", window: tuple[int, int] | None = None, cu_seqlens=None,
    timeout: float | str | None = "auto", record: Record | None = None, node_size: int | None = None,
    ulysses_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # dq, dk, dv: the shapes of q, k, v
    """Gradients ``(dq, dk, dv)`` of this rank's shard, given the upstream gradient ``dout``.

    ``out`` and ``lse`` are what ``ring_attention`` returned on this rank, with
    the same options; all arrays are this rank's shard in the same layout.
    dk and dv have the shape of k and v (grouped-query: summed over each
    group's query heads). Results have the input dtype; gradients are
    accumulated in float64. Options are those of ``ring_attention``; bad
    input on any rank raises the same ValueError on every rank.
    """
    comm = check_comm(comm)
    with exclusive(comm):  # one call per communicator at a time (threads: one Dup each)
        options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens,
                       node_size=node_size, ulysses_size=ulysses_size)

        def prepare():  # what may fail on one rank alone (MemoryError) is done before the agreement
            arrays = [np.ascontiguousarray(a) for a in (dout, q, k, v, out, lse)]
            delta = np.sum(arrays[0].astype(GRAD_DTYPE) * arrays[4], axis=-1).astype(q.dtype)
            return arrays + [delta]

        problem = (grad_problem(dout, q, k, v, out, lse) or heads_problem(q, k, comm.Get_size(), mode)
                   or grid_problem(q, k, comm.Get_size(), mode, ulysses_size))
        plan, scale, (dout, q, k, v, out, lse, delta) = setup(q, k, v, comm, scale, options, timeout=timeout,
                                                              prepare=prepare, problem=problem)
        timeout = resolve_timeout(timeout, plan, q.size // (q.shape[-2] * q.shape[-1]), q.shape[-1], factor=2.5)
        rec = Record(comm.Get_rank()) if record is None else record
        rings = []
        try:  # private duplicates: K/V, dK/dV onward, dK/dV home (all-gather needs only the first)
            rings.append(RingComm(comm, timeout))
            if plan.mode not in ("allgather", "ulysses", "double_ring") and not isinstance(plan, HybridPlan):
                rings += [RingComm(comm, timeout), HomeRing(comm, plan, timeout)]
            wait_until([rings[0].comm.Ibarrier()], timeout, rings[0].rank, "start barrier")  # a common start
            rec.t0 = start = time.perf_counter()
            if isinstance(plan, HybridPlan):  # Ulysses in groups, this ring across them (mpiring.grid)
                from .grid import hybrid_backward

                dq, dk, dv = hybrid_backward(dout, q, k, v, out, lse, plan, rings[0].comm,
                                             dict(options, node_size=None, ulysses_size=None), scale, rec, timeout)
            elif plan.mode == "allgather":
                dq, dk, dv = _allgather_backward(dout, q, k, v, out, lse, delta, plan, rings[0].comm, scale, rec,
                                                 timeout)
            elif plan.mode == "ulysses":  # heads move, not K/V blocks (mpiring.ulysses)
                from .ulysses import ulysses_backward

                dq, dk, dv = ulysses_backward(dout, q, k, v, lse, delta, plan, rings[0].comm, scale, rec, timeout)
            elif plan.mode == "double_ring":  # an inner ring per node, an outer ring across (mpiring.double_ring)
                from .double_ring import double_ring_backward, nodes_of

                plan = nodes_of(plan, rings[0].comm, node_size)
                dq, dk, dv = double_ring_backward(dout, q, k, v, out, lse, delta, plan, rings[0].comm, scale, rec,
                                                  timeout)
            else:
                dq, dk, dv = _backward_ring_loop(dout, q, k, v, out, lse, delta, plan, rings, scale, rec, timeout)
                rec.bytes_sent = sum(ring.bytes_sent for ring in rings)
                rec.messages = sum(ring.messages for ring in rings)
                rec.wait_time = sum(ring.wait_time for ring in rings)
            if timeout is not None:  # as in the forward pass: a failed rank skips this, the others time out
                agree_outcome(rings[0].comm, timeout, rec.t0)
        finally:
            for ring in rings:
                ring.free()
        rec.wall_time = time.perf_counter() - start
        rec.plan = plan
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
