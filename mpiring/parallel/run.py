"""Which loop runs a call: the strategy its plan names, forward or backward, then the end-of-ring check.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --causal --backward

``mpiring.Ring`` (``mpiring.handle``) checks the arguments, agrees on the
plan and calls ``run_forward`` / ``run_backward``; they pick the loop of the
plan's strategy (the flat ring's, the all-gather's, pass-Q's, Ulysses', the
double ring's or the ring x Ulysses grid's: one module each), account its
bytes and waits in the call's ``Record``, and with a timeout check that every
rank finished in time (``agree_outcome``).
"""

import time

import numpy as np
from mpi4py import MPI

from ..mpi.waits import CommTimeout, wait_until
from ..plans.heads import HybridPlan
from .backward import allgather_backward, backward_ring_loop
from .double_ring import double_ring_backward, double_ring_forward
from .grid import hybrid_backward, hybrid_forward
from .passq import passq_loop
from .ring import allgather_loop, ring_loop
from .ulysses import ulysses_backward, ulysses_forward

__all__ = ["run_forward", "run_backward", "agree_outcome"]


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


def run_forward(q, k, v, plan, ring, scale, rec, timeout, pr, rotate="kv"):
    """The forward pass of contiguous, agreed arrays over ``ring`` (a RingComm), all ranks having just met.

    ``pr``: the call's ``Precision`` (its wire codes what travels in every
    mode: K/V, or under pass-Q the query blocks); ``rotate``: "kv" or "q"
    (the pass-Q ring, ``mpiring.parallel.passq``; the grid's ring across its
    groups passes what it says). Fills ``rec`` (this call's events, bytes and
    times) and returns ``(out, lse)``.
    """
    rec.t0 = start = time.perf_counter()  # event times minus rec.t0 compare across ranks
    rec.wire_dtype, rec.rotate = pr.wire.name, rotate
    sent, messages, waited = ring.bytes_sent, ring.messages, ring.wait_time
    if isinstance(plan, HybridPlan):  # Ulysses in groups, the ring across them (mpiring.parallel.grid)
        out, lse = hybrid_forward(q, k, v, plan, ring.comm, scale, rec, timeout, pr, rotate, run_forward)
    elif plan.mode == "allgather":
        out, lse = allgather_loop(q, k, v, plan, ring.comm, scale, rec, timeout, pr)
    elif plan.mode == "ulysses":  # heads move, not K/V blocks (mpiring.parallel.ulysses)
        out, lse = ulysses_forward(q, k, v, plan, ring.comm, scale, rec, timeout, pr)
    elif plan.mode == "double_ring":  # an inner ring per node, an outer ring across (mpiring.parallel.double_ring)
        out, lse = double_ring_forward(q, k, v, plan, ring, scale, rec, timeout, pr)
    elif rotate == "q":  # the queries travel, K/V stay; the partial results go home (mpiring.parallel.passq)
        out, lse = passq_loop(q, k, v, plan, ring, scale, rec, timeout, pr)
        rec.bytes_sent += ring.bytes_sent - sent  # passq_loop counted the partials' bytes and messages home
        rec.messages += ring.messages - messages
        rec.wait_time = ring.wait_time - waited
    else:
        out, lse = ring_loop(q, k, v, plan, ring, scale, rec, timeout, pr)
        rec.bytes_sent, rec.messages = ring.bytes_sent - sent, ring.messages - messages
        rec.wait_time = ring.wait_time - waited
    if timeout is not None:
        agree_outcome(ring.comm, timeout, rec.t0)
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return out, lse


def run_backward(arrays, plan, rings, scale, rec, timeout, pr):
    """The backward pass of contiguous, agreed ``arrays`` (dout, q, k, v, out, lse, delta), all ranks having met.

    ``rings``: the K/V RingComm, then (but for all-gather) the dK/dV onward
    RingComm and the HomeRing; ``pr``: the call's ``Precision``. Fills ``rec``
    and returns float64 ``(dq, dk, dv)``.
    """
    rec.t0 = start = time.perf_counter()
    rec.wire_dtype = pr.wire.name
    counters = [(ring.bytes_sent, ring.messages, ring.wait_time) for ring in rings]
    dout, q, k, v, out, lse, delta = arrays
    if isinstance(plan, HybridPlan):  # Ulysses in groups, the ring across them (mpiring.parallel.grid)
        dq, dk, dv = hybrid_backward(dout, q, k, v, out, lse, plan, rings[0].comm, scale, rec, timeout, pr,
                                     run_backward)
    elif plan.mode == "allgather":
        dq, dk, dv = allgather_backward(*arrays, plan, rings[0].comm, scale, rec, timeout, pr)
    elif plan.mode == "ulysses":  # heads move, not K/V blocks (mpiring.parallel.ulysses)
        dq, dk, dv = ulysses_backward(dout, q, k, v, lse, delta, plan, rings[0].comm, scale, rec, timeout, pr)
    elif plan.mode == "double_ring":  # an inner ring per node, an outer ring across (mpiring.parallel.double_ring)
        dq, dk, dv = double_ring_backward(*arrays, plan, rings[0].comm, scale, rec, timeout, pr)
    else:
        dq, dk, dv = backward_ring_loop(*arrays, plan, rings, scale, rec, timeout, pr)
        rec.bytes_sent = sum(ring.bytes_sent - c[0] for ring, c in zip(rings, counters))
        rec.messages = sum(ring.messages - c[1] for ring, c in zip(rings, counters))
        rec.wait_time = sum(ring.wait_time - c[2] for ring, c in zip(rings, counters))
    if timeout is not None:  # as in the forward pass: a failed rank skips this, the others time out
        agree_outcome(rings[0].comm, timeout, rec.t0)
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return dq, dk, dv
