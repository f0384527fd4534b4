"""Ring attention over MPI, forward: every rank keeps its queries, K/V blocks travel the ring.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal

``mpiring.Ring`` (and ``ring_attention``, in ``mpiring.handle``) checks the
arguments and calls ``run_forward``. The loop below is the whole algorithm:
start passing the held blocks on, compute on them (``block.attend``: the kernel and the log-sum-exp merge; tests
wrap it to inject faults), wait for the next ones, swap. Which block is where
at each step is the plan's (``mpiring.plans.plan``); how it moves is ``mpiring.mpi.comm``'s.
"""

import time

import numpy as np
from mpi4py import MPI

from ..core import block
from ..core.precision import Precision
from ..mpi.buffers import kv_slots, next_buffers
from ..mpi.collectives import allgathered
from ..mpi.comm import shift
from ..mpi.waits import CommTimeout, wait_until
from ..plans.heads import HybridPlan
from .passq import passq_loop

__all__ = ["run_forward", "agree_outcome"]


def _ring_loop(q, k, v, plan, ring, scale, rec, timeout, pr=None):
    """The ring: start passing the held blocks on, compute on them, wait, swap. ``pr``: the call's ``Precision``."""
    pr = pr or Precision(k.dtype)
    rank, wire = ring.rank, pr.wire
    # out is returned converted to the input dtype: a copy, so its accumulator can be a kept buffer
    acc = block.accumulators(q, v, pr.out, pr.lse, keep=pr.out != pr.input)
    q = pr.widen(q)  # half inputs: tiles compute in float32
    longest = max(len(s) for s in plan.kv_shards)
    # K/V blocks are kept as the kernel takes them, [k | 1]^T and [v | 1]^T (or as the wire codes them,
    # ``precision.Wire``), in two slots per stream, kept buffers of this thread; the first slot of the
    # first stream starts with this rank's own block.
    buffers = {stream: kv_slots(wire, (k, v), longest, f"ring.kv{stream}") for stream in plan.rounds or [+1]}
    own = next(iter(buffers.values())).hold((k, v))
    mine = own if not wire.coded else wire.own((k, v), padded=True)  # computed on exactly
    held = {stream: own for stream in buffers}  # the block each stream holds now
    for step in range(plan.n_steps):
        incoming = next_buffers(plan, rank, step, buffers)
        shift(ring, {s: held[s] for s in incoming}, incoming, rec, step, pad=wire.pad)  # Isend/Irecv, non-blocking
        start = time.perf_counter()
        for task in plan.tasks(step, rank):  # one block (two when bidirectional)
            kv = mine if task.source == rank else wire.arrived(held[task.stream], padded=True)
            block.attend(q, kv, task, plan.pieces(rank, task.source), scale, acc, rec, ring.progress, step, padded=True)
        computed, start = time.perf_counter() - start, time.perf_counter()
        ring.wait(timeout, _slow_step_note(step, computed, timeout))
        rec.event("wait", start, step=step)
        held.update(incoming)  # the blocks that arrived are the ones to use next step
        rec.step_done(step, plan.n_steps)
    return acc[0].astype(pr.input, copy=False), acc[1].astype(pr.compute, copy=False)


def _allgather_loop(q, k, v, plan, comm, scale, rec, timeout, pr=None):
    """All-gather K/V once (overlapped with the local block), then compute locally."""
    pr = pr or Precision(k.dtype)
    rank, wire = comm.Get_rank(), pr.wire
    acc = block.accumulators(q, v, pr.out, pr.lse)
    q = pr.widen(q)
    mine = wire.own((k, v))
    for step, task, kv, progress in allgathered(wire.encode(k), wire.encode(v), plan, comm, rec, timeout):
        kv = mine if task.source == rank else wire.arrived(kv)
        block.attend(q, kv, task, plan.pieces(rank, task.source), scale, acc, rec, progress, step)
        rec.step_done(step, plan.n_steps)
    return acc[0].astype(pr.input, copy=False), acc[1].astype(pr.compute, copy=False)


def _slow_step_note(step, took, timeout):
    """If this rank's own compute of ``step`` (``took`` seconds) outlasted the timeout, say so."""
    if timeout is None or took <= timeout:
        return None
    return (f"this rank computed step {step} for {took:.3g} s, longer than the timeout: a neighbour's step "
            f"likely did too; give a larger timeout, or timeout='auto'")


def agree_outcome(comm, timeout, t0):
    """After a ring, with a timeout: did every rank finish it in time? The same answer on every rank.

    Each rank contributes when it got here (seconds since the common start
    barrier, ``t0``). Ranks that arrived more than ``timeout`` apart mean one
    was stalled and the early one gave up on it: then every rank that sees the
    result raises CommTimeout, the late one included, instead of returning as
    if all went well. An early rank waits ``timeout`` plus a margin for the
    result, so it gives up only when the others will decide the same; a rank
    that failed never joins, and the others time out here.
    """
    arrived = time.perf_counter() - t0
    times = np.array([arrived, -arrived])
    spread = np.empty(2)
    rank = comm.Get_rank()
    wait_until([comm.Iallreduce(times, spread, op=MPI.MAX)], round(timeout * 1.5 + 0.5, 2), rank, "end-of-ring check",
               sync=True)
    latest, earliest = spread[0], -spread[1]
    if latest - earliest > timeout:
        raise CommTimeout(f"rank {rank}: the ranks finished the ring {latest - earliest:.3g} s apart, more than "
                          f"the timeout ({timeout:g} s): one was stalled and the others gave up on it")


def run_forward(q, k, v, plan, ring, scale, rec, timeout, pr, options=None, rotate="kv"):
    """The forward pass of contiguous, agreed arrays over ``ring`` (a RingComm), all ranks having just met.

    ``pr``: the call's ``Precision`` (its wire codes what travels in every
    mode: K/V, or under pass-Q the query blocks); ``options``: the ring's
    (layout, mode, causal, window, cu_seqlens) for the grid's ring across
    Ulysses groups; ``rotate``: "kv" or "q" (the pass-Q ring, ``mpiring.parallel.passq``). Fills
    ``rec`` (this call's events, bytes and times) and returns ``(out, lse)``.
    """
    rec.t0 = start = time.perf_counter()  # event times minus rec.t0 compare across ranks
    rec.wire_dtype, rec.rotate = pr.wire.name, rotate
    sent, messages, waited = ring.bytes_sent, ring.messages, ring.wait_time
    if isinstance(plan, HybridPlan):  # Ulysses in groups, the ring across them (mpiring.parallel.grid)
        from .grid import hybrid_forward

        inner = dict(options or {}, rotate=rotate)  # the ring across the groups may pass the queries
        out, lse = hybrid_forward(q, k, v, plan, ring.comm, inner, scale, rec, timeout, pr)
    elif plan.mode == "allgather":
        out, lse = _allgather_loop(q, k, v, plan, ring.comm, scale, rec, timeout, pr)
    elif plan.mode == "ulysses":  # heads move, not K/V blocks (mpiring.parallel.ulysses)
        from .ulysses import ulysses_forward

        out, lse = ulysses_forward(q, k, v, plan, ring.comm, scale, rec, timeout, pr)
    elif plan.mode == "double_ring":  # an inner ring per node, an outer ring across (mpiring.parallel.double_ring)
        from .double_ring import double_ring_forward

        out, lse = double_ring_forward(q, k, v, plan, ring, scale, rec, timeout, pr)
    elif rotate == "q":  # the queries travel, K/V stay; the partial results go home (mpiring.parallel.passq)
        out, lse = passq_loop(q, k, v, plan, ring, scale, rec, timeout, pr.wire)
        rec.bytes_sent += ring.bytes_sent - sent  # passq_loop counted the partials' bytes and messages home
        rec.messages += ring.messages - messages
        rec.wait_time = ring.wait_time - waited
    else:
        out, lse = _ring_loop(q, k, v, plan, ring, scale, rec, timeout, pr)
        rec.bytes_sent, rec.messages = ring.bytes_sent - sent, ring.messages - messages
        rec.wait_time = ring.wait_time - waited
    if timeout is not None:
        agree_outcome(ring.comm, timeout, rec.t0)
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return out, lse
