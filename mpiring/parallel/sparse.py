"""The sparse movement over MPI, forward and backward: each K/V block goes straight to the ranks that need it.

    mpiexec -n 4 python -m mpiring run --mode sparse --causal --window 64 0 --backward

``mpiring.plans.delivery`` has the plan: the graph of needed blocks, from the
plan's pieces alone. Every transfer is posted at the start, non-blocking and
point to point: the receives of the blocks this rank needs, the sends of its
own block to each rank that needs it. The forward pass is the all-gather's
loop (``ring.allgather_loop``) over the blocks ``delivered`` yields: the own
block while the others travel, then each needed block once it has arrived.
The backward pass computes the same blocks and sends each one's dK/dV partial
home as soon as it is done; the owner's receives of them are posted at the
start and added up, in the order of the users' ranks, at the end. Under a
top-k choice (``plan.kept``) only the chosen keys of a block travel, and
their partial comes home into those rows.
"""

import time

import numpy as np

from ..core import block
from ..core.block import add_grads, count_pairs
from ..core.buffers import flat_blocks, mpi_view
from ..mpi.waits import abandon, completed, test_all, wait_until

__all__ = ["delivered", "sparse_backward"]

KV_TAGS, GRAD_TAGS = (0, 1), (2, 3)  # K and V; dK and dV (on the call's private communicator)


class _Transfers:
    """This rank's posted transfers: requests by what they complete, with the bytes and events they count."""

    def __init__(self, comm, rec, timeout, what):
        self.comm, self.rec, self.timeout, self.what = comm, rec, timeout, what
        self.rank = comm.Get_rank()
        self.receives, self.sends, self.kept = {}, [], []  # kept: every buffer a pending request uses

    def receive(self, key, arrays, source, tags):
        self.kept.append(arrays)
        self.receives[key] = [self.comm.Irecv(mpi_view(a), source=source, tag=t) for a, t in zip(arrays, tags)]

    def send(self, arrays, dest, tags, step, data):
        posted = time.perf_counter()
        self.kept.append(arrays)
        self.sends += [self.comm.Isend(mpi_view(a), dest=dest, tag=t) for a, t in zip(arrays, tags)]
        nbytes = sum(a.nbytes for a in arrays)
        self.rec.bytes_sent += nbytes
        self.rec.messages += len(arrays)
        self.rec.event("send", posted, step=step, stream=0, data=data, dest=dest, bytes=nbytes)

    def pending(self):
        return self.sends + [r for rs in self.receives.values() for r in rs]

    def progress(self):
        test_all(self.pending(), self.rank, self.what)

    def wait(self, requests, step, data):
        """Complete ``requests`` (CommTimeout past the timeout); the time blocked is this step's wait."""
        start = time.perf_counter()
        wait_until(requests, self.timeout, self.rank, self.what, start)
        self.rec.wait_time += time.perf_counter() - start
        self.rec.event("wait", start, step=step, data=data)

    def give_up(self):
        """On an error path: keep what is still pending (and its buffers) alive for good (``waits.abandon``)."""
        if not completed(self.pending()):
            abandon((self.pending(), self.kept))


def _received(plan, rank, template, dtype):
    """Per source rank, (..., n_j, d) views of one flat buffer for the blocks ``rank`` needs (empty for others):
    n_j the tokens of j's block that travel to ``rank`` (``SparsePlan.tokens``)."""
    needed = set(plan.needs[rank])
    lengths = [plan.tokens(rank, j) if j in needed else 0 for j in range(plan.size)]
    return flat_blocks(template, lengths, dtype, empty=True)[2]


def _taken(arrays, rows):
    """``arrays`` (..., n, d), or only their ``rows`` (contiguous copies) when rows is not None."""
    return arrays if rows is None else tuple(np.take(a, rows, axis=-2) for a in arrays)


def delivered(k, v, plan, comm, rec, timeout):
    """Post every K/V transfer of the plan, then yield ``(step, task, (k, v) of the task's block, progress)``.

    ``k``, ``v``: this rank's block as the wire carries it. Step 0 is the own
    block; each later block is yielded once its K and V have arrived. Every
    send is complete when the loop ends.
    """
    rank = comm.Get_rank()
    moves = _Transfers(comm, rec, timeout, "sparse K/V transfer")
    try:
        blocks = [_received(plan, rank, a, a.dtype) for a in (k, v)]
        for source in plan.needs[rank]:
            moves.receive(source, (blocks[0][source], blocks[1][source]), source, KV_TAGS)
        for dest in plan.users[rank]:  # the whole block, or the keys dest's queries see (``plan.kept``)
            moves.send(_taken((k, v), plan.kept(dest, rank)), dest, KV_TAGS, 0, "K/V")
        for step in range(plan.steps_of(rank)):
            for task in plan.tasks(step, rank):
                if task.source != rank:  # (still pending, so abandoned, if this wait gives up)
                    moves.wait(moves.receives[task.source], step, "K/V")
                kv = (k, v) if task.source == rank else (blocks[0][task.source], blocks[1][task.source])
                yield step, task, kv, moves.progress
        moves.wait(moves.sends, plan.steps_of(rank) - 1, "K/V sent")
    except BaseException:
        moves.give_up()
        raise


def _both(first, second):
    """One progress callback that lets MPI move both kinds of transfer."""
    def progress():
        first()
        second()
    return progress


def sparse_backward(dout, q, k, v, out, lse, delta, call):
    """This rank's ``(dq, dk, dv)`` in ``precision.sums``: K/V arrive as in the forward pass, partials go home."""
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank, wire = comm.Get_rank(), precision.wire
    queries = block.queries(dout, q, out, lse, delta)
    dq = np.zeros(q.shape, precision.sums)
    own = [np.zeros(a.shape, precision.sums) for a in (k, v)]  # this rank's block: its own share, then what came home
    mine = wire.own((k, v))
    users = plan.users[rank]
    homes = _Transfers(comm, record, timeout, "sparse dK/dV transfer")
    try:
        home = [flat_blocks(a, [plan.tokens(user, rank) for user in users], precision.grad, empty=True)[2]
                for a in (k, v)]
        for i, user in enumerate(users):
            homes.receive(user, (home[0][i], home[1][i]), user, GRAD_TAGS)
        for step, task, kv, kv_progress in delivered(wire.encode(k), wire.encode(v), plan, comm, record, timeout):
            kv = mine if task.source == rank else wire.arrived(kv)
            pieces = plan.pieces(rank, task.source)
            count_pairs(record, pieces)
            grads = block.grads_of(queries, kv, block.Visit(step, task, pieces), score, dq, record,
                                   _both(homes.progress, kv_progress))
            if task.source == rank:
                add_grads(own, grads)
            else:  # this rank's share of the block's dK, dV: straight home
                partial = [np.zeros(a.shape[:-2] + (plan.tokens(rank, task.source), a.shape[-1]), precision.grad)
                           for a in (k, v)]
                add_grads(partial, grads)
                homes.send(partial, task.source, GRAD_TAGS, step, "dK/dV home")
            record.tasks.append((step, task))
            record.step_done(step, plan.steps_of(rank))
        homes.wait(homes.pending(), plan.steps_of(rank) - 1, "dK/dV home")
    except BaseException:
        homes.give_up()
        raise
    for i, user in enumerate(users):  # in the users' rank order: the same sum whatever arrived first
        rows = plan.kept(user, rank)
        at = np.s_[...] if rows is None else np.s_[..., rows, :]
        own[0][at] += home[0][i]
        own[1][at] += home[1][i]
    return dq, own[0], own[1]
