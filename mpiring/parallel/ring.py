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

from ..core import block
from ..core.precision import Precision
from ..mpi.buffers import kv_slots, next_buffers
from ..mpi.collectives import allgathered
from ..mpi.comm import shift

__all__ = ["ring_loop", "allgather_loop"]


def ring_loop(q, k, v, plan, ring, scale, rec, timeout, pr=None):
    """The ring: start passing the held blocks on, compute on them, wait, swap. ``pr``: the call's ``Precision``."""
    pr = pr or Precision(k.dtype)
    rank, wire = ring.rank, pr.wire
    # out is returned converted to the input dtype: a copy, so its accumulator can be a kept buffer
    acc = block.accumulators(q, v, pr.out, pr.lse, keep=pr.out != pr.input, wire=wire)
    q = pr.widen(q)  # half inputs: tiles compute in float32
    longest = max(len(s) for s in plan.kv_shards)
    # K/V blocks are kept as the kernel backend takes them ([k | 1]^T and [v | 1]^T for the NumPy kernel,
    # (..., n, d) for torch's) or as the wire codes them (``precision.Wire``), in two slots per stream, kept
    # buffers of this thread; ``hold`` puts this rank's own block in the kernel's form.
    buffers = {stream: kv_slots(wire, (k, v), longest, f"ring.kv{stream}") for stream in plan.rounds or [+1]}
    form = next(iter(buffers.values()))  # [k | 1]^T for the NumPy kernel, (..., n, d) for torch's (``kv_slots``)
    own = form.hold((k, v))
    mine = own if not wire.coded else wire.own((k, v), padded=form.padded)  # computed on exactly
    held = {stream: own for stream in buffers}  # the block each stream holds now
    for step in range(plan.n_steps):
        incoming = next_buffers(plan, rank, step, buffers)
        shift(ring, {s: held[s] for s in incoming}, incoming, rec, step, pad=form.pad)  # Isend/Irecv, non-blocking
        start = time.perf_counter()
        for task in plan.tasks(step, rank):  # one block (two when bidirectional)
            kv = mine if task.source == rank else wire.arrived(held[task.stream], padded=form.padded)
            block.attend(q, kv, task, plan.pieces(rank, task.source), scale, acc, rec, ring.progress, step,
                         padded=form.padded)
        computed, start = time.perf_counter() - start, time.perf_counter()
        ring.wait(timeout, _slow_step_note(step, computed, timeout))
        rec.event("wait", start, step=step)
        held.update(incoming)  # the blocks that arrived are the ones to use next step
        rec.step_done(step, plan.n_steps)
    return acc[0].astype(pr.input, copy=False), acc[1].astype(pr.compute, copy=False)


def allgather_loop(q, k, v, plan, comm, scale, rec, timeout, pr=None, arrive=allgathered):
    """All-gather K/V once (overlapped with the local block), then compute locally.

    ``arrive``: how the blocks come, ``(k, v, plan, comm, rec, timeout) -> (step, task, (k, v), progress)`` for
    each task, K/V as the wire codes them: the all-gather's (``collectives.allgathered``) or the sparse
    movement's (``parallel.sparse.delivered``: only the needed blocks, straight from their owners).
    """
    pr = pr or Precision(k.dtype)
    rank, wire = comm.Get_rank(), pr.wire
    acc = block.accumulators(q, v, pr.out, pr.lse, wire=wire)
    q = pr.widen(q)
    mine = wire.own((k, v))
    for step, task, kv, progress in arrive(wire.encode(k), wire.encode(v), plan, comm, rec, timeout):
        kv = mine if task.source == rank else wire.arrived(kv)
        block.attend(q, kv, task, plan.pieces(rank, task.source), scale, acc, rec, progress, step)
        rec.step_done(step, plan.steps_of(rank))
    return acc[0].astype(pr.input, copy=False), acc[1].astype(pr.compute, copy=False)


def _slow_step_note(step, took, timeout):
    """If this rank's own compute of ``step`` (``took`` seconds) outlasted the timeout, say so."""
    if timeout is None or took <= timeout:
        return None
    return (f"this rank computed step {step} for {took:.3g} s, longer than the timeout: a neighbour's step "
            f"likely did too; give a larger timeout, or timeout='auto'")
