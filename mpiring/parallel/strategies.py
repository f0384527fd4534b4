"""The strategy table: one entry per way blocks move, its forward and backward loop; and the call that runs them.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --causal --backward

``STRATEGIES`` maps a strategy's name (``Spec.strategy``, ``plan.strategy``)
to its ``Strategy``: the forward loop, the backward loop and the private
communicators a handle makes for it once. Each loop lives in one module of
this package (``ring``, ``backward``, ``passq``, ``ulysses``, ``double_ring``,
``grid``, ``sparse``) over the shared block, merge and communication code, and takes
its arrays and one ``Call`` (``parallel.ring``). ``mpiring.Ring`` (``mpiring.handle``)
checks the arguments, agrees on the spec and plan and calls ``run_forward``
/ ``run_backward``, which run the loop of the plan's strategy, account its
bytes and waits in the call's ``Record``, and with a timeout check that
every rank finished in time (``agree_outcome``). Adding a strategy is one
module with its loops and one entry here (docs/extending.md).
"""

import functools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..core.scores import sink_grads, with_sinks
from ..core.tuning.machine import one_trim
from ..mpi.collectives import allreduced
from ..mpi.comm import RingComm
from ..mpi.waits import CommTimeout, wait_until
from .backward import allgather_backward, backward_ring_loop, gradient_rings
from .double_ring import double_ring_backward, double_ring_forward, nodes_of
from .grid import hybrid_backward, hybrid_forward
from .passq import chosen_rotation, passq_loop
from .ring import Call, allgather_loop, ring_loop
from .sparse import delivered, sparse_backward
from .ulysses import ulysses_backward, ulysses_forward

__all__ = ["Call", "Strategy", "STRATEGIES", "counted", "strategy_of", "private_rings", "grad_rings", "rotation",
           "run_forward", "run_backward", "agree_outcome", "scored_forward", "sink_gradients", "table_gradients"]


@dataclass(frozen=True)
class Strategy:
    """How one strategy runs: ``forward(q, k, v, call) -> (out, lse)``,
    ``backward(dout, q, k, v, out, lse, delta, call) -> (dq, dk, dv)`` (``call``: a ``Call``), and
    ``rings(comm, plan, timeout) -> [RingComm]``: the communicators its backward needs beside the K/V ring."""

    forward: Callable
    backward: Callable
    rings: Callable = lambda comm, plan, timeout: []
    rotates: bool = False  # rotate="auto" may pick pass-Q for it
    latent: bool = True  # its loops take K/V blocks through the wire (own, arrived) and their gradients through
    # block.grads_of, so MLA's latent can travel in its place (parallel.latent); not where heads or queries move
    place: Callable = lambda plan, comm, node_size, timeout: plan  # the plan once MPI placed the ranks (collective)


def counted(loop, assign=True):
    """``loop`` accounting in the call's record what its RingComms counted (the loops that send through them);
    ``assign`` False: the loop counted more (pass-Q's partials home) itself, and these add to it."""
    def run(*arrays_and_call):
        call = arrays_and_call[-1]
        before = [(r.bytes_sent, r.messages, r.wait_time) for r in call.rings]
        result = loop(*arrays_and_call)
        sent, messages, waited = (sum(getattr(r, name) - b[i] for r, b in zip(call.rings, before))
                                  for i, name in enumerate(("bytes_sent", "messages", "wait_time")))
        record = call.record
        if assign:
            record.bytes_sent, record.messages = sent, messages
        else:
            record.bytes_sent, record.messages = record.bytes_sent + sent, record.messages + messages
        record.wait_time = waited
        return result
    return run


def strategy_of(plan, rotate="kv"):
    """The table's entry for a call under ``plan`` whose ring passes ``rotate`` ("kv" or "q")."""
    return STRATEGIES["pass-q" if rotate == "q" and plan.strategy == "ring" else plan.strategy]


def rotation(rotate, plan, q, k, v, wire_dtype=None):
    """What the ring passes: ``rotate``, with "auto" decided by the bytes (``passq.chosen_rotation``) where the
    strategy can pass queries, "kv" elsewhere. The same on every rank."""
    if rotate == "auto" and not STRATEGIES[plan.strategy].rotates:
        return "kv"
    return chosen_rotation(rotate, plan, q, k, v, wire_dtype)


def private_rings(comm, plan, node_size, timeout, backward):
    """``(plan, rings)``: the communicators a handle keeps for ``plan``'s strategy (collective), the K/V ring
    first; the double ring's plan learns its nodes here (as MPI placed the ranks unless ``node_size`` says)."""
    rings = [RingComm(comm, timeout)]
    try:
        strategy = STRATEGIES[plan.strategy]
        plan = strategy.place(plan, rings[0].comm, node_size, timeout)
        if backward:
            rings += strategy.rings(comm, plan, timeout)
    except BaseException:
        for ring in rings:
            ring.free()
        raise
    return plan, rings


def grad_rings(comm, plan, timeout):
    """The communicators the strategy's backward adds to a forward's (collective): for a handle whose first call
    was a forward."""
    return STRATEGIES[plan.strategy].rings(comm, plan, timeout)


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


def run_forward(arrays, call):
    """The forward pass of contiguous, agreed ``arrays`` (q, k, v) under ``call`` (a ``Call``: its ring the K/V
    RingComm, its precision's wire codes what travels in every mode, its ``rotate`` "kv" or "q": the pass-Q
    ring, ``mpiring.parallel.passq``), all ranks having just met. Fills the call's record (events, bytes,
    times) and returns ``(out, lse)``.
    """
    record = call.record
    record.t0 = start = time.perf_counter()  # event times minus record.t0 compare across ranks
    record.wire_dtype, record.rotate = call.precision.wire.name, call.rotate
    with one_trim():  # the torch blocks' heap trims, once at the end of the loop (docs/performance.md §23)
        out, lse = strategy_of(call.plan, call.rotate).forward(*arrays, call)
    if call.timeout is not None:
        agree_outcome(call.comm, call.timeout, record.t0)
    record.wall_time = time.perf_counter() - start
    record.plan = call.plan
    return out, lse


def scored_forward(spec, score, out, lse, comm, timeout):
    """After a forward's loop, what the scores add once per call: the sinks in every row's denominator, and the
    largest logit over every rank (``(out, lse, max_logit or None)``; collective when it is asked for)."""
    if spec.sinks is not None:
        out, lse = with_sinks(out, lse, spec.sinks)
    top = allreduced(comm, score.max_logit, MPI.MAX, timeout, "max logit") if spec.return_max_logit else None
    return out, lse, top


def sink_gradients(spec, lse, delta, comm, timeout):
    """d loss / d sinks: each rank's rows' share summed over the ranks (every row once), or None without sinks."""
    if spec.sinks is None:
        return None
    return allreduced(comm, sink_grads(lse, delta, spec.sinks), MPI.SUM, timeout, "sink gradients")


def table_gradients(score, comm, timeout):
    """d loss / d table of a ``TableBias`` bias: each rank's pairs' share summed over the ranks (every pair once),
    or None without one."""
    if score.dtable is None:
        return None
    return allreduced(comm, score.dtable, MPI.SUM, timeout, "bias table gradients")


def run_backward(arrays, call):
    """The backward pass of contiguous, agreed ``arrays`` (dout, q, k, v, out, lse, delta) under ``call``, all ranks
    having met: its rings the K/V RingComm, then those the strategy's ``rings`` made (the ring modes: the dK/dV
    onward RingComm and the HomeRing). Fills the call's record and returns ``(dq, dk, dv)`` in ``precision.sums``.
    """
    record = call.record
    record.t0 = start = time.perf_counter()
    record.wire_dtype = call.precision.wire.name
    with one_trim():  # the torch blocks' heap trims, once at the end of the loop (docs/performance.md §23)
        dq, dk, dv = strategy_of(call.plan).backward(*arrays, call)
    if call.timeout is not None:  # as in the forward pass: a failed rank skips this, the others time out
        agree_outcome(call.comm, call.timeout, record.t0)
    record.wall_time = time.perf_counter() - start
    record.plan = call.plan
    return dq, dk, dv


_RING = Strategy(counted(ring_loop), counted(backward_ring_loop), gradient_rings)
STRATEGIES = {
    "ring": Strategy(counted(ring_loop), counted(backward_ring_loop), gradient_rings, rotates=True),  # .ring
    "bidirectional": _RING,  # two streams of the same loops
    "allgather": Strategy(allgather_loop, allgather_backward),  # K/V gathered once, dK/dV reduce-scattered
    "pass-q": Strategy(counted(passq_loop, assign=False), counted(backward_ring_loop), gradient_rings,
                       latent=False),  # queries travel (.passq)
    "ulysses": Strategy(ulysses_forward, ulysses_backward, latent=False),  # heads move by all-to-all (.ulysses)
    "double_ring": Strategy(double_ring_forward, double_ring_backward, place=nodes_of),  # inner and outer rings
    "grid": Strategy(functools.partial(hybrid_forward, across=run_forward),  # Ulysses in groups, a ring across
                     functools.partial(hybrid_backward, across=run_backward), latent=False),
    "sparse": Strategy(functools.partial(allgather_loop, arrive=delivered),  # each block straight to its users,
                       sparse_backward),  # partials straight home (.sparse)
}
