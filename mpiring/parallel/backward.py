"""Backward pass of ring attention: K/V travel the ring again, and their gradients travel with them.

    mpiexec -n 4 python -m mpiring run --backward --causal --layout zigzag --heads 8 --kv-heads 2

Every rank keeps its q, dout, out, lse and delta = rowsum(dout * out); the
K/V blocks move exactly as in the forward plan. The partial dK/dV of a block
joins it at its first visitor after the owner, is accumulated by every rank
it visits, and its last hop takes it home, in key chunks sent while the rest
of the block still computes (docs/backward.md). The softmax is
recomputed from the saved lse, one block tile at a time, so memory per rank
stays O(S/P). Partial gradients travel in float32 (float64 for float64
inputs; ``grad_wire_dtype``), and every rank sums its own in that dtype
(``Precision.sums``).
"""

import time

import numpy as np

from ..core import block
from ..core.block import KEPT_OUT, add_grads, count_pairs
from ..core.buffers import Buffers, flat_blocks, next_buffers
from ..core.tiles import filled
from ..mpi.collectives import allgathered
from ..mpi.comm import HomeRing, RingComm, shift
from ..mpi.waits import wait_until
from ..plans.plan import chunks_in_order, home_chunks, key_chunks

__all__ = ["backward_ring_loop", "allgather_backward", "gradient_rings"]


def gradient_rings(comm, plan, timeout=None):
    """The communicators the backward ring needs beside its K/V ring (``backward_ring_loop``'s ``rings[1:]``):
    the dK/dV partials' onward ring and their hop home; none when no stream rotates (the all-gather, which
    reduce-scatters)."""
    if not plan.rounds:
        return []
    grads = RingComm(comm, timeout)
    try:
        return [grads, HomeRing(comm, plan, timeout)]
    except BaseException:
        grads.free()
        raise


class _Partials:
    """The dK/dV partials of the blocks a rank visits: started by a block's first visitor, added to by each
    visitor, passed on with the block one step behind it (``grad_ring``), and sent home in key chunks from the
    last visitor (``home_ring``), whose receives are posted before the ring starts."""

    def __init__(self, plan, rank, k, v, grad, rings, rec, timeout):
        self.plan, self.rank, self.rec, self.timeout, self.grad = plan, rank, rec, timeout, grad
        _, self.grad_ring, self.home_ring = rings
        self.rings, self.k, self.v = rings, k, v
        longest = max(len(s) for s in plan.kv_shards)
        empty = tuple(np.empty(a.shape[:-2] + (0, a.shape[-1]), grad) for a in (k, v))
        self.buffers = {stream: Buffers(empty, longest, f"bwd.grad{stream}") for stream in plan.rounds}
        self.arriving = {}  # stream -> the dK/dV partial of the held block, sent by its previous visitor
        self.homecoming = {}  # stream -> this rank's block's partial, from its last visitor on that stream
        self.due = False  # partials sent by the previous visitors still to wait for
        chunks = home_chunks(plan)
        for stream, rounds in plan.rounds.items():
            if rounds > 0:  # its receives, one per key chunk (dK and dV), are posted now
                # written now, so the pages are mapped before the last chunk lands
                self.homecoming[stream] = (filled(f"bwd.home{stream}k", k.shape, grad, 0),
                                           filled(f"bwd.home{stream}v", v.shape, grad, 0))
                self.home_ring.expect(stream, self.homecoming[stream], key_chunks(k.shape[-2], chunks))

    def progress(self):
        for ring in self.rings:
            ring.progress()

    def wait_for(self, waited, step, data):
        start = time.perf_counter()
        for ring in waited:
            ring.wait(self.timeout)
        self.rec.event("wait", start, step=step, data=data)

    def of(self, step, stream, n, own):
        """The partial a visit at ``step`` adds to: the own block's (step 0), a new one (the first visitor,
        step 1), or the one that arrived with the block."""
        if step == 0:
            return own
        if step == 1:
            return tuple(filled(f"bwd.start{stream}{name}", a.shape[:-2] + (n, a.shape[-1]), self.grad, 0)
                         for name, a in (("k", self.k), ("v", self.v)))
        return self.arriving[stream]  # added to only after ``wait_once``

    def wait_once(self, step):
        """Wait for the partials the previous visitors sent, once a step: when first needed, after a compute."""
        if self.due:
            self.wait_for([self.grad_ring], step, "dK/dV")
            self.due = False

    def send_home(self, stream, total, chunk, lo, hi, step):
        posted = time.perf_counter()
        sent = self.home_ring.send_chunk(stream, total, chunk, lo, hi)
        self.rec.event("send", posted, step=step, stream=stream, data="dK/dV home",
                       dest=self.home_ring.send_rank[stream], bytes=sent, keys=f"{lo}:{hi}")

    def pass_on(self, step, onward):
        """Each partial goes on with its block; the next ones arrive with the next blocks."""
        self.arriving = {}
        for stream in onward:
            source = self.plan.held_source(self.rank, stream, step + 1)
            self.arriving[stream] = self.buffers[stream].take(len(self.plan.kv_shards[source]))
        shift(self.grad_ring, onward, self.arriving, self.rec, step, "dK/dV")
        self.due = step + 1 >= 2  # the first visitor (step 1) starts its partial; later ones wait for theirs

    def home(self, own):
        """This rank's dK, dV: its own block's share plus what came home (only the last chunks can still be on
        their way)."""
        if self.homecoming:
            self.wait_for([self.grad_ring, self.home_ring], self.plan.n_steps - 1, "dK/dV home")
        for dk, dv in self.homecoming.values():
            own[0] += dk
            own[1] += dv
        return own


def backward_ring_loop(dout, q, k, v, out, lse, delta, call):
    """Start passing K/V on, compute, wait, swap; a block's dK/dV follows it one step behind, then goes home.

    At a stream's last round the block is computed in key chunks, and each
    chunk's dK/dV is sent home as soon as its keys are done, while the next
    chunk computes: only the last chunk's transfer is left to wait for.
    """
    plan, rings, score = call.plan, call.rings, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    kv_ring = rings[0]
    rank, wire, chunks = kv_ring.rank, precision.wire, home_chunks(plan)
    queries = block.queries(dout, q, out, lse, delta)
    # the sums are kept buffers (no page faults: docs/performance.md §11) when the caller converts them to a copy;
    # dq and the K/V slots take the forward ring's names, whose buffers are free while a backward runs
    keep = precision.input != precision.sums
    dq, dk, dv = (filled(name if keep else None, a.shape, precision.sums, 0)
                  for name, a in ((KEPT_OUT, q), ("bwd.dk", k), ("bwd.dv", v)))
    own = [dk, dv]  # step 0: this rank's own block
    mine = wire.own((k, v))  # the own block, computed on exactly
    coded = (wire.encode(k), wire.encode(v))  # as the wire carries it: coded once, here
    held = {stream: coded for stream in plan.rounds or [+1]}  # the K/V block each stream holds now
    longest = max(len(s) for s in plan.kv_shards)
    kv_buffers = {stream: Buffers(coded, longest, f"ring.kv{stream}") for stream in plan.rounds}
    partials = _Partials(plan, rank, k, v, precision.grad, rings, record, timeout)
    for step in range(plan.n_steps):
        incoming = next_buffers(plan, rank, step, kv_buffers)
        shift(kv_ring, {s: held[s] for s in incoming}, incoming, record, step, "K/V")  # pass K/V on
        onward = {}
        for task in plan.tasks(step, rank):
            stream, n = task.stream, len(plan.kv_shards[task.source])
            pieces = plan.pieces(rank, task.source)
            count_pairs(record, pieces)
            kv = mine if task.source == rank else wire.arrived(held[stream])
            total = partials.of(step, stream, n, own)
            going_home = step > 0 and step == plan.rounds[stream]  # the last visitor: key chunks, sent home
            work = chunks_in_order(pieces, n, chunks) if going_home else [(None, 0, n, pieces)]
            for chunk, lo, hi, cut in work:
                grads = block.grads_of(queries, kv, block.Visit(step, task, cut), score, dq, record, partials.progress,
                                       **({"keys": f"{lo}:{hi}"} if going_home else {}))
                if grads or going_home:
                    partials.wait_once(step)
                add_grads(total, grads)
                if going_home:  # keys lo:hi are done: off they go, while the next chunk computes
                    partials.send_home(stream, total, chunk, lo, hi, step)
            if 0 < step < plan.rounds[stream]:
                onward[stream] = total
            record.tasks.append((step, task))
        partials.wait_once(step)  # skips only: the partials are passed on unchanged
        if incoming:
            partials.wait_for([kv_ring], step, "K/V")
        held.update(incoming)  # swap
        partials.pass_on(step, onward)
        record.step_done(step, plan.n_steps)
    dk, dv = partials.home(own)
    return dq, dk, dv


def allgather_backward(dout, q, k, v, out, lse, delta, call):
    """All-gather K/V once, compute every block's dK/dV contribution here, reduce-scatter them to their owners."""
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank, size, wire = comm.Get_rank(), comm.Get_size(), precision.wire
    lengths = [len(s) for s in plan.kv_shards]
    sums = [flat_blocks(a, lengths, precision.grad) for a in (k, v)]  # this rank's share of every block's dK, dV
    queries = block.queries(dout, q, out, lse, delta)
    dq = np.zeros(q.shape, precision.sums)
    mine = wire.own((k, v))
    for step, task, kv, progress in allgathered(wire.encode(k), wire.encode(v), plan, comm, record, timeout):
        kv = mine if task.source == rank else wire.arrived(kv)  # as the forward pass
        pieces = plan.pieces(rank, task.source)
        count_pairs(record, pieces)
        grads = block.grads_of(queries, kv, block.Visit(step, task, pieces), score, dq, record, progress)
        add_grads((sums[0][2][task.source], sums[1][2][task.source]), grads)
        record.tasks.append((step, task))
        record.step_done(step, plan.n_steps)
    own = [np.empty(a.shape, precision.grad) for a in (k, v)]
    start = time.perf_counter()
    requests = [comm.Ireduce_scatter(flat, mine, counts) for (flat, counts, _), mine in zip(sums, own)]
    wait_until(requests, timeout, rank, "reduce-scatter")
    record.wait_time += time.perf_counter() - start
    record.events.append(("wait", start, time.perf_counter(), {"step": plan.n_steps - 1}))  # the reduce-scatter
    for _, counts, _ in sums:  # as a ring reduce-scatter moves it: every block but one's own, once
        record.bytes_sent += (sum(counts) - counts[rank]) * precision.grad.itemsize
        record.messages += size - 1
    return dq, own[0], own[1]
