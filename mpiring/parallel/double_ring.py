"""The double ring over MPI, forward and backward: an inner ring per node, an outer ring across nodes.

    mpiexec -n 4 python -m mpiring run --mode double_ring --node-size 2 --causal --backward
    run/cluster run -n 4 python -m mpiring run --mode double_ring --causal    # nodes from MPI

``ring_attention`` and ``ring_attention_backward`` call these when the plan's
mode is "double_ring" (``mpiring.plans.hierarchy`` has the plan: who holds which
block when, who sends what where). Blocks go through the ring's own code
(``block.attend``, ``block.grads_of``) and move with ``RingComm``: one for
the inner ring and one for the outer, each with its own neighbours. Every
"send" event names its link (``hierarchy.INNER`` or ``OUTER``).
"""

import time

import numpy as np
from mpi4py import MPI

from ..core import block
from ..core.block import add_grads, count_pairs
from ..core.buffers import kv_slots, payload_bytes
from ..cost.nodes import node_ids
from ..mpi.collectives import together
from ..mpi.comm import RingComm
from ..mpi.waits import wait_until
from ..plans.hierarchy import INNER, OUTER, double_ring_plan

__all__ = ["nodes_of", "double_ring_forward", "double_ring_backward"]


def nodes_of(plan, comm, node_size, timeout=None):
    """The plan with MPI's ranks per node (``Split_type(COMM_TYPE_SHARED)``) unless ``node_size`` was given.

    Collective; called after the agreement, so every rank calls it. Every wait
    gives up after ``timeout`` (CommTimeout): MPI has no non-blocking split, so
    the ranks first meet in a non-blocking barrier (``collectives.together``).
    Nodes of unequal size or with ranks out of order raise the same ValueError on every rank.
    """
    if node_size is not None:
        return plan
    rank = comm.Get_rank()
    together(comm, timeout, "node grouping")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leader, leaders = np.array([rank]), np.empty(comm.Get_size(), int)
    try:
        wait_until([node.Iallreduce(np.array([rank]), leader, op=MPI.MIN)], timeout, rank, "node grouping", sync=True)
    finally:
        node.Free()
    wait_until([comm.Iallgather(leader, leaders)], timeout, rank, "node grouping", sync=True)
    node_of = node_ids(leaders.tolist())
    n = node_of.count(0)
    if node_of != [r // n for r in range(plan.size)]:
        raise ValueError(f"mode='double_ring' needs nodes of equal size holding consecutive ranks; MPI places the "
                         f"ranks on nodes {node_of}: pass node_size to choose the groups")
    return double_ring_plan(plan, n)


def _rings(comm, plan, timeout, inner=None):
    """Two RingComms (``inner`` if given, and a new one): +1 is the next rank in the node, and on the next node."""
    rings = [inner or RingComm(comm, timeout), RingComm(comm, timeout)]
    rank = rings[0].rank
    for ring, step in zip(rings, (plan.inner_next, plan.outer_next)):
        ring.send_rank[+1], ring.recv_rank[+1] = step(rank), step(rank, -1)
    return rings


def _shift(ring, send, recv, rec, step, link, data="K/V", pad=0):
    posted = time.perf_counter()
    ring.shift({+1: send}, {+1: recv}, pad)
    rec.event("send", posted, step=step, stream=+1, data=data, dest=ring.send_rank[+1], link=link,
              bytes=sum(payload_bytes(a, pad) for a in send))


def _wait(rings, rec, step, timeout, data="K/V"):
    """Complete the transfers of ``rings``, each within ``timeout`` (CommTimeout otherwise)."""
    start = time.perf_counter()
    for ring in rings:
        ring.wait(timeout)
    rec.event("wait", start, step=step, data=data)


def double_ring_forward(q, k, v, call):
    """This rank's (out, lse); ``ring`` (a RingComm of the caller's) becomes the inner ring.

    K/V travel both rings on the wire of ``precision`` (the call's ``Precision``), as in the flat ring: coded once
    here, decoded where used; this rank computes on its own block exactly.
    """
    plan, ring, score = call.plan, call.ring, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    wire = precision.wire
    inner, outer = _rings(ring.comm, plan, timeout, inner=ring)
    before = (inner.bytes_sent, inner.messages, inner.wait_time)  # the caller's ring may have served earlier calls
    try:
        rank = inner.rank
        acc = block.accumulators(q, v, precision.out, precision.lse, wire=wire)  # accumulate= as in the ring modes
        longest = max(len(s) for s in plan.kv_shards)
        inner_slots, outer_slots = kv_slots(wire, (k, v), longest), kv_slots(wire, (k, v), longest)
        first = outer_slots.hold((k, v))  # a round's first block: this rank's own, then what the outer ring brings
        held = first
        mine = first if not wire.coded else wire.own((k, v), padded=outer_slots.padded)  # computed on exactly

        def progress():
            inner.progress()
            outer.progress()

        n, m = plan.node_size, plan.nodes
        for step in range(plan.n_steps):
            o, i = plan.round_step(step)
            waiting = []
            if i == 0 and o < m - 1:  # the next round's first block, behind this whole round
                nxt = outer_slots.take(len(plan.kv_shards[plan.source_at(rank, step + n)]))
                _shift(outer, first, nxt, record, step, OUTER, pad=outer_slots.pad)
            if i < n - 1:
                incoming = inner_slots.take(len(plan.kv_shards[plan.source_at(rank, step + 1)]))
                _shift(inner, held, incoming, record, step, INNER, pad=outer_slots.pad)
                waiting.append(inner)
            for task in plan.tasks(step, rank):
                kv = mine if task.source == rank else wire.arrived(held, padded=outer_slots.padded)
                block.attend(q, kv, block.Visit(step, task, plan.pieces(rank, task.source)), score, acc, record,
                             progress, padded=outer_slots.padded)
            if i == n - 1 and o < m - 1:
                waiting.append(outer)
            if waiting:
                _wait(waiting, record, step, timeout)
            if i < n - 1:
                held = incoming
            elif o < m - 1:
                first = held = nxt
            record.step_done(step, plan.n_steps)
        record.bytes_sent = inner.bytes_sent - before[0] + outer.bytes_sent
        record.messages = inner.messages - before[1] + outer.messages
        record.wait_time = inner.wait_time - before[2] + outer.wait_time
    finally:
        outer.free()
    return acc[0].astype(q.dtype, copy=False), acc[1].astype(precision.compute, copy=False)


def double_ring_backward(dout, q, k, v, out, lse, delta, call):
    """This rank's (dq, dk, dv) in ``precision.sums``. K/V move as in the forward pass, on the call's wire.

    A block's partial starts at its first visitor in a node (zeros), goes to the next rank with the block (one
    step behind, so the wait for it follows a compute), and the node's last visitor sends it home; partials
    travel in the ``grad`` dtype (``grad_wire_dtype``) and add up at home in ``precision.sums``. At a round's last step
    every rank sends one partial home and receives one of its own block's (``plan.last_visitor``), so the hop
    home is one more ring shift, waited for a round later.
    """
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    wire = precision.wire
    kv_inner, kv_outer = _rings(comm, plan, timeout)
    grads_inner, home = _rings(comm, plan, timeout)
    rings = (kv_inner, kv_outer, grads_inner, home)
    try:
        rank = kv_inner.rank
        n, m = plan.node_size, plan.nodes
        queries = block.queries(dout, q, out, lse, delta)
        dq = np.zeros(q.shape, precision.sums)
        own_grads = (np.zeros(k.shape, precision.sums), np.zeros(v.shape, precision.sums))
        own_block = wire.own((k, v))  # this rank's own block, computed on exactly
        travelling = first = (wire.encode(k), wire.encode(v))  # as the wire carries it: coded once, here
        arriving = None  # the travelling block's partial, from the previous visitor in this node
        coming_home = None  # the own block's partial from a node's last visitor, on its way

        def progress():
            for ring in rings:
                ring.progress()

        def block_of(source, dtype=None, make=np.zeros, like=(k, v)):
            return tuple(make(a.shape[:-2] + (len(plan.kv_shards[source]), a.shape[-1]), dtype or a.dtype)
                         for a in like)

        for step in range(plan.n_steps):
            o, i = plan.round_step(step)
            source = plan.source_at(rank, step)
            kv_waiting = []
            if i == 0 and o < m - 1:
                nxt = block_of(plan.source_at(rank, step + n), make=np.empty, like=first)
                _shift(kv_outer, first, nxt, record, step, OUTER)
            if i < n - 1:
                incoming = block_of(plan.source_at(rank, step + 1), make=np.empty, like=travelling)
                _shift(kv_inner, travelling, incoming, record, step, INNER)
                kv_waiting.append(kv_inner)
            task = plan.tasks(step, rank)[0]
            pieces = plan.pieces(rank, task.source)
            count_pairs(record, pieces)
            kv = own_block if source == rank else wire.arrived(travelling)
            grads = block.grads_of(queries, kv, block.Visit(step, task, pieces), score, dq, record, progress)
            record.tasks.append((step, task))
            if i == 0:  # the first visitor in this node; with one rank per node the own block's share stays here
                total = own_grads if source == rank and n == 1 else block_of(source, precision.grad)
            else:
                _wait([grads_inner], record, step, timeout, "dK/dV")
                total = arriving
            add_grads(total, grads)
            if i == n - 1 and o < m - 1:
                kv_waiting.append(kv_outer)
            if kv_waiting:
                _wait(kv_waiting, record, step, timeout)
            if i < n - 1:  # the partial goes on with its block
                arriving = block_of(plan.source_at(rank, step + 1), precision.grad)
                _shift(grads_inner, total, arriving, record, step, INNER, "dK/dV")
            elif source != rank:  # the node's last visitor: the partial goes home, one comes home
                _arrive_home(home, coming_home, own_grads, record, step, timeout)
                coming_home = _send_home(home, total, plan, o, record, step, block_of(rank, precision.grad))
            if i < n - 1:
                travelling = incoming
            elif o < m - 1:
                first = travelling = nxt
            record.step_done(step, plan.n_steps)
        _arrive_home(home, coming_home, own_grads, record, plan.n_steps - 1, timeout)
        for counter in ("bytes_sent", "messages", "wait_time"):
            setattr(record, counter, sum(getattr(ring, counter) for ring in rings))
    finally:
        for ring in rings:
            ring.free()
    return dq, own_grads[0], own_grads[1]


def _arrive_home(home, coming_home, own_grads, rec, step, timeout):
    """Finish the previous hop home (if any): wait for the own block's partial and add it into ``own_grads``."""
    if coming_home is not None:
        _wait([home], rec, step, timeout, "dK/dV home")
        own_grads[0][...] += coming_home[0]
        own_grads[1][...] += coming_home[1]


def _send_home(home, total, plan, rnd, rec, step, receive):
    """Start the hop home of round ``rnd``: ``total`` to its block's owner, the own block's partial into
    ``receive``. Returns ``receive``, the arrays the own block's partial is arriving in."""
    rank = home.rank
    source = plan.source_at(rank, rnd * plan.node_size + plan.node_size - 1)
    home.send_rank[+1], home.recv_rank[+1] = source, plan.last_visitor(rank, rnd)
    same = plan.place(source)[0] == plan.place(rank)[0]
    _shift(home, total, receive, rec, step, INNER if same else OUTER, "dK/dV home")
    return receive
