"""Ring attention over MPI, forward: every rank keeps its queries, K/V blocks travel the ring.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal

``mpiring.Ring`` (and ``ring_attention``, in ``mpiring.handle``) checks the
arguments and calls ``run_forward`` (``parallel.strategies``), which runs these loops
for the ring modes. The loop below is the whole algorithm: start passing the
held blocks on, compute on them (``block.attend``: the kernel and the
log-sum-exp merge; tests wrap it to inject faults), wait for the next ones,
swap. Which block is where at each step is the plan's (``mpiring.plans.plan``);
how it moves is ``mpiring.mpi.comm``'s.
"""

import time
from typing import NamedTuple

from ..core import block
from ..core.buffers import kv_slots, next_buffers
from ..mpi.collectives import allgathered
from ..mpi.comm import shift

__all__ = ["Call", "ring_loop", "allgather_loop"]


class Call(NamedTuple):
    """What every strategy's loop takes besides its arrays: the plan, the RingComms (the K/V ring first), the
    ``core.scores.Score``, the call's ``Record``, the timeout of every wait, the ``Precision`` (its wire codes
    what travels), and what the ring passes ("kv" or "q")."""

    plan: object
    rings: list
    score: object
    record: object
    timeout: float | None
    precision: object
    rotate: str = "kv"

    @property
    def ring(self):
        """The K/V RingComm."""
        return self.rings[0]

    @property
    def comm(self):
        """The K/V ring's communicator (the collective strategies' one)."""
        return self.rings[0].comm


def ring_loop(q, k, v, call):
    """The ring: start passing the held blocks on, compute on them, wait, swap (``call``: a ``Call``)."""
    plan, ring, score = call.plan, call.ring, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank, wire = ring.rank, precision.wire
    # out is returned converted to the input dtype: a copy, so its accumulator can be a kept buffer
    acc = block.accumulators(q, v, precision.out, precision.lse, keep=precision.out != precision.input, wire=wire)
    q = precision.widen(q)  # half inputs: tiles compute in float32
    longest = max(len(s) for s in plan.kv_shards)
    # K/V blocks are kept as the kernel backend takes them ([k | 1]^T and [v | 1]^T for the NumPy kernel,
    # (..., n, d) for torch's) or as the wire codes them (``precision.Wire``), in two slots per stream, kept
    # buffers of this thread; ``hold`` puts this rank's own block in the kernel's form.
    buffers = {stream: kv_slots(wire, (k, v), longest, f"ring.kv{stream}") for stream in plan.rounds or [+1]}
    slots = next(iter(buffers.values()))  # a stream's two slots (``kv_slots``): the form every block takes
    outgoing = slots.hold((k, v))
    own_block = outgoing if not wire.coded else wire.own((k, v), padded=slots.padded)  # computed on exactly
    holding = {stream: outgoing for stream in buffers}  # the block each stream holds now
    for step in range(plan.n_steps):
        incoming = next_buffers(plan, rank, step, buffers)
        shift(ring, {s: holding[s] for s in incoming}, incoming, record, step, pad=slots.pad)  # Isend/Irecv
        start = time.perf_counter()
        for task in plan.tasks(step, rank):  # one block (two when bidirectional)
            kv = own_block if task.source == rank else wire.arrived(holding[task.stream], padded=slots.padded)
            block.attend(q, kv, block.Visit(step, task, plan.pieces(rank, task.source)), score, acc, record,
                         ring.progress, padded=slots.padded)
        computed, start = time.perf_counter() - start, time.perf_counter()
        ring.wait(timeout, _slow_step_note(step, computed, timeout))
        record.event("wait", start, step=step)
        holding.update(incoming)  # the blocks that arrived are the ones to use next step
        record.step_done(step, plan.n_steps)
    return acc[0].astype(precision.input, copy=False), acc[1].astype(precision.compute, copy=False)


def allgather_loop(q, k, v, call, arrive=allgathered):
    """All-gather K/V once (overlapped with the local block), then compute locally.

    ``arrive``: how the blocks come, ``(k, v, plan, comm, rec, timeout) -> (step, task, (k, v), progress)`` for
    each task, K/V as the wire codes them: the all-gather's (``collectives.allgathered``) or the sparse
    movement's (``parallel.sparse.delivered``: only the needed blocks, straight from their owners).
    """
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank, wire = comm.Get_rank(), precision.wire
    acc = block.accumulators(q, v, precision.out, precision.lse, wire=wire)
    q = precision.widen(q)
    own_block = wire.own((k, v))
    for step, task, kv, progress in arrive(wire.encode(k), wire.encode(v), plan, comm, record, timeout):
        kv = own_block if task.source == rank else wire.arrived(kv)
        block.attend(q, kv, block.Visit(step, task, plan.pieces(rank, task.source)), score, acc, record, progress)
        record.step_done(step, plan.steps_of(rank))
    return acc[0].astype(precision.input, copy=False), acc[1].astype(precision.compute, copy=False)


def _slow_step_note(step, took, timeout):
    """If this rank's own compute of ``step`` (``took`` seconds) outlasted the timeout, say so."""
    if timeout is None or took <= timeout:
        return None
    return (f"this rank computed step {step} for {took:.3g} s, longer than the timeout: a neighbour's step "
            f"likely did too; give a larger timeout, or timeout='auto'")
