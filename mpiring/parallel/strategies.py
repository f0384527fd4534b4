"""The strategy table: one entry per way blocks move, its forward and backward loop; and the call that runs them.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --causal --backward

``STRATEGIES`` maps a strategy's name (``Spec.strategy``, ``plan.strategy``)
to its ``Strategy``: the forward loop, the backward loop and the private
communicators a handle makes for it once. Each loop lives in one module of
this package (``ring``, ``backward``, ``passq``, ``ulysses``, ``double_ring``,
``grid``, ``sparse``) over the shared block, merge and communication code; the entries
here only adapt their arguments. ``mpiring.Ring`` (``mpiring.handle``)
checks the arguments, agrees on the spec and plan and calls ``run_forward``
/ ``run_backward``, which run the loop of the plan's strategy, account its
bytes and waits in the call's ``Record``, and with a timeout check that
every rank finished in time (``agree_outcome``). Adding a strategy is one
module with its loops and one entry here (docs/extending.md).
"""

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from ..core.scores import sink_grads, with_sinks
from ..mpi.collectives import allreduced
from ..mpi.comm import RingComm
from ..mpi.waits import CommTimeout, wait_until
from .backward import allgather_backward, backward_ring_loop, gradient_rings
from .double_ring import double_ring_backward, double_ring_forward, nodes_of
from .grid import hybrid_backward, hybrid_forward
from .passq import chosen_rotation, passq_loop
from .ring import allgather_loop, ring_loop
from .sparse import delivered, sparse_backward
from .ulysses import ulysses_backward, ulysses_forward

__all__ = ["Strategy", "STRATEGIES", "strategy_of", "private_rings", "rotation", "run_forward", "run_backward",
           "agree_outcome", "scored_forward", "sink_gradients"]


class Call(NamedTuple):
    """What a loop needs besides its arrays: the plan, the RingComms (K/V first), the softmax scale, the call's
    ``Record``, the timeout of every wait, the ``Precision`` and (forward) what the ring passes."""

    plan: object
    rings: list
    scale: float
    rec: object
    timeout: float | None
    pr: object
    rotate: str = "kv"


@dataclass(frozen=True)
class Strategy:
    """How one strategy runs: ``forward(q, k, v, call) -> (out, lse)``, ``backward(arrays, call) -> (dq, dk, dv)``
    (arrays: dout, q, k, v, out, lse, delta), and ``rings(comm, plan, timeout) -> [RingComm]``: the
    communicators its backward needs beside the K/V ring."""

    forward: Callable
    backward: Callable
    rings: Callable = lambda comm, plan, timeout: []
    rotates: bool = False  # rotate="auto" may pick pass-Q for it
    latent: bool = True  # its loops take K/V blocks through the wire (own, arrived) and their gradients through
    # block.grads_of, so MLA's latent can travel in its place (parallel.latent); not where heads or queries move
    place: Callable = lambda plan, comm, node_size, timeout: plan  # the plan once MPI placed the ranks (collective)


def _counted(assign=True):
    """Account in the record what the call's RingComms counted (the loops that send through them)."""
    def wrap(loop):
        def run(arrays, call):
            before = [(r.bytes_sent, r.messages, r.wait_time) for r in call.rings]
            result = loop(arrays, call)
            sent, messages, waited = (sum(getattr(r, name) - b[i] for r, b in zip(call.rings, before))
                                      for i, name in enumerate(("bytes_sent", "messages", "wait_time")))
            rec = call.rec
            if assign:
                rec.bytes_sent, rec.messages = sent, messages
            else:  # the loop counted more (pass-Q's partials home) itself
                rec.bytes_sent, rec.messages = rec.bytes_sent + sent, rec.messages + messages
            rec.wait_time = waited
            return result
        return run
    return wrap


@_counted()
def _ring_forward(arrays, c):
    return ring_loop(*arrays, c.plan, c.rings[0], c.scale, c.rec, c.timeout, c.pr)


@_counted()
def _ring_backward(arrays, c):
    return backward_ring_loop(*arrays, c.plan, c.rings, c.scale, c.rec, c.timeout, c.pr)


@_counted(assign=False)
def _passq_forward(arrays, c):
    return passq_loop(*arrays, c.plan, c.rings[0], c.scale, c.rec, c.timeout, c.pr)


def _grid_forward(arrays, c):
    return hybrid_forward(*arrays, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr, c.rotate, run_forward)


def _grid_backward(arrays, c):
    dout, q, k, v, out, lse, _ = arrays
    return hybrid_backward(dout, q, k, v, out, lse, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr,
                           run_backward)


def _ulysses_backward(arrays, c):
    dout, q, k, v, _, lse, delta = arrays
    return ulysses_backward(dout, q, k, v, lse, delta, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr)


_RING = Strategy(_ring_forward, _ring_backward, gradient_rings)
STRATEGIES = {
    "ring": Strategy(_ring_forward, _ring_backward, gradient_rings, rotates=True),  # parallel.ring, .backward
    "bidirectional": _RING,  # two streams of the same loops
    "allgather": Strategy(  # K/V gathered once, dK/dV reduce-scattered (parallel.ring, .backward)
        lambda a, c: allgather_loop(*a, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr),
        lambda a, c: allgather_backward(*a, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr)),
    "pass-q": Strategy(_passq_forward, _ring_backward, gradient_rings, latent=False),  # queries travel (.passq)
    "ulysses": Strategy(  # heads move by all-to-all (parallel.ulysses)
        lambda a, c: ulysses_forward(*a, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr),
        _ulysses_backward, latent=False),
    "double_ring": Strategy(  # an inner ring per node, an outer ring across (parallel.double_ring)
        lambda a, c: double_ring_forward(*a, c.plan, c.rings[0], c.scale, c.rec, c.timeout, c.pr),
        lambda a, c: double_ring_backward(*a, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr),
        place=nodes_of),
    "grid": Strategy(_grid_forward, _grid_backward, latent=False),  # Ulysses in groups, a ring across (.grid)
    "sparse": Strategy(  # each block straight to the ranks that need it, partials straight home (parallel.sparse)
        lambda a, c: allgather_loop(*a, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr, arrive=delivered),
        lambda a, c: sparse_backward(*a, c.plan, c.rings[0].comm, c.scale, c.rec, c.timeout, c.pr)),
}


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
    out, lse = strategy_of(plan, rotate).forward((q, k, v), Call(plan, [ring], scale, rec, timeout, pr, rotate))
    if timeout is not None:
        agree_outcome(ring.comm, timeout, rec.t0)
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
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


def run_backward(arrays, plan, rings, scale, rec, timeout, pr):
    """The backward pass of contiguous, agreed ``arrays`` (dout, q, k, v, out, lse, delta), all ranks having met.

    ``rings``: the K/V RingComm, then those the strategy's ``rings`` made
    (the ring modes: the dK/dV onward RingComm and the HomeRing); ``pr``: the
    call's ``Precision``. Fills ``rec`` and returns float64 ``(dq, dk, dv)``.
    """
    rec.t0 = start = time.perf_counter()
    rec.wire_dtype = pr.wire.name
    dq, dk, dv = strategy_of(plan).backward(arrays, Call(plan, rings, scale, rec, timeout, pr))
    if timeout is not None:  # as in the forward pass: a failed rank skips this, the others time out
        agree_outcome(rings[0].comm, timeout, rec.t0)
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return dq, dk, dv
