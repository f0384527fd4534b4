"""Ring x Ulysses over MPI (``ulysses_size=u``): Ulysses inside groups of u ranks, a ring across the groups.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_grid_mpi.py

Ranks form a u x (P/u) grid with two communicators (``Split``): the group,
u consecutive ranks, and the cross ring, the ranks at the same place of
every group. Every rank holds the tokens its layout gives it, as in every
mode (``shard_indices``). The group's all-to-all gives each rank the
group's tokens for its share of the heads (``ulysses.heads_out``; any
number of heads from u up: ``heads.deal_heads``), member after member;
the ring across groups is the ring modes' own loop (``strategies.run_forward``,
``run_backward``, handed in: no loop calls the public API) over the plan of
the groups, whose tokens are its ``positions`` (``heads.HybridPlan.ring_plan``),
on duplicates of the cross communicator; a second all-to-all brings every
rank its tokens back. The inner loop's events, tasks and counters join this
call's record.

A coded ``wire_dtype`` codes K/V on both: the group's all-to-all (each
rank's own share stays exact) and the ring across groups (the inner call,
given the same wire). A token from another member so crosses two coded
hops, but coding is idempotent (a half rounding exactly; int8 and FP8 to
within float32 rounding of the scale), so it carries one coding's error. The ring
across groups accumulates as ``accumulate=`` says, as the ring modes do
(results bit for bit those of ``ring_attention`` on the cross communicator).
Gradients come back in ``grad_wire_dtype``, which the inner ring's partials use too.
"""

import numpy as np

from ..core.precision import Precision
from ..core.record import Record
from ..mpi.collectives import together
from ..mpi.comm import RingComm
from ..plans.heads import deal_heads
from ..plans.layouts import take_rows
from .backward import gradient_rings
from .ring import Call
from .ulysses import gradients_home, heads_out, result_dtypes, tokens_back

__all__ = ["grid_comms", "hybrid_forward", "hybrid_backward"]

SUMS = ("bytes_sent", "messages", "wait_time", "compute_time", "computed_pairs", "visible_pairs")


def grid_comms(comm, plan, timeout=None):
    """``(group, cross)``: this rank's group of u and its ring across groups (collective; free both after).

    MPI has no non-blocking ``Split``: the ranks first meet in a non-blocking
    barrier waited for with ``timeout`` (``collectives.together``), so a rank
    that failed before it makes the others raise CommTimeout, not wait forever.
    """
    g, j = plan.group(comm.Get_rank())
    together(comm, timeout, "grid communicators")
    return comm.Split(g, j), comm.Split(j, g)


def _join(rec, inner):
    """Add the inner ring's record to this call's."""
    rec.events += inner.events
    rec.tasks += inner.tasks
    for name in SUMS:
        setattr(rec, name, getattr(rec, name) + getattr(inner, name))




def _lengths(plan, rank, kv=False):
    """Tokens of each member of ``rank``'s group: its queries (``kv``: its keys)."""
    shards = plan.kv_shards if kv else plan.shards
    return [len(shards[r]) for r in plan.members(plan.group(rank)[0])]


def _across(compute, arrays, rows, results, plan, rank, cross, timeout, backward):
    """``compute(arrays, ring plan, rings)`` over the ring across groups on this group's tokens: the rows
    sorted by position first (``rows``, one letter per array: "q" query rows, "k" key rows, "l" query rows
    on the last axis, as lse), its results (``results``: their letters) back in the group's order. The
    rings are duplicates of ``cross``, as a ``Ring`` handle makes them (``backward``: with the gradients'
    rings), freed after."""
    g, _ = plan.group(rank)
    ring = plan.ring_plan
    order = {"q": ring.orders[g], "k": ring.kv_orders[g], "l": ring.orders[g]}
    arrays = [take_rows(np.ascontiguousarray(a), order[kind], -1 if kind == "l" else -2)
              for a, kind in zip(arrays, rows)]
    rings = [RingComm(cross, timeout)]
    try:
        if backward:
            rings += gradient_rings(cross, ring, timeout)
        got = compute(arrays, ring, rings)
    finally:
        for r in rings:
            r.free()
    return [ring.in_caller_order(g, a, kv=kind == "k", axis=-1 if kind == "l" else -2)
            for a, kind in zip(got, results)]


def hybrid_forward(q, k, v, call, across):
    """This rank's (out, lse): the group's heads out, ``across`` (``strategies.run_forward``) over the ring
    across groups on the group's tokens, the results back; the call's precision codes K/V on both; its
    ``rotate``: what the ring across groups passes ("kv" or "q")."""
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank = comm.Get_rank()
    deal = deal_heads(q.shape[-3], k.shape[-3], plan.ulysses_size)  # as Ulysses deals them over u ranks
    lengths, kv_lengths = _lengths(plan, rank), _lengths(plan, rank, kv=True)
    group, cross = grid_comms(comm, plan, timeout)
    place = group.Get_rank()
    score = score.for_heads(deal.q[place])  # a score's bias and dropout see the global heads
    try:
        Q, K, V = heads_out(group, [q, k, v], [deal.q, deal.kv, deal.kv], [lengths, kv_lengths, kv_lengths],
                            [q.dtype, precision.wire, precision.wire], record, timeout, 0)
        # one dtype across (half: as given); a place holding part of a GQA group: its K/V heads repeated
        K, V = (deal.expand(place, a.astype(q.dtype, copy=False)) for a in (K, V))
        inner = Record(rank)
        inner_precision = Precision(q.dtype, precision.options["wire_dtype"], accumulate=precision.accumulate)

        def forward(arrays, ring, rings):
            return across(arrays, Call(ring, rings, score, inner, timeout, inner_precision, call.rotate))

        out, lse = _across(forward, [Q, K, V], "qkk", "ql", plan, rank, cross, timeout, backward=False)
        _join(record, inner)
        got = tokens_back(group, [out, lse[..., None]], [deal.counts()] * 2, [lengths] * 2,
                          result_dtypes(q.dtype), record, timeout, plan.n_steps - 1)
    finally:
        group.Free()
        cross.Free()
    return np.concatenate([g[0] for g in got], axis=-3), np.concatenate([g[1][..., 0] for g in got], axis=-2)


def hybrid_backward(dout, q, k, v, out, lse, delta, call, across):
    """This rank's (dq, dk, dv): the group's heads out (q, dout, out, lse; k, v on the wire of ``precision``),
    ``across`` (``strategies.run_backward``) over the ring across groups, the gradients back (in
    ``precision.grad``); dK, dV of a K/V head that several members held (fewer K/V heads than u) add up.
    ``delta`` is made again from the heads each member gets."""
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank = comm.Get_rank()
    deal = deal_heads(q.shape[-3], k.shape[-3], plan.ulysses_size)
    lengths, kv_lengths = _lengths(plan, rank), _lengths(plan, rank, kv=True)
    group, cross = grid_comms(comm, plan, timeout)
    place = group.Get_rank()
    score = score.for_heads(deal.q[place])  # a score's bias and dropout see the global heads
    try:
        Q, dO, Out, L, K, V = heads_out(group, [q, dout, out, lse[..., None], k, v], [deal.q] * 4 + [deal.kv] * 2,
                                        [lengths] * 4 + [kv_lengths] * 2, [q.dtype] * 4 + [precision.wire] * 2, record,
                                        timeout, 0)
        K, V = deal.expand(place, K), deal.expand(place, V)
        inner, inner_precision = Record(rank), Precision.of(K.dtype, precision.options)

        def backward(arrays, ring, rings):
            dO, Q, K, V, Out, L = arrays
            delta = np.einsum("...d,...d->...", dO, Out, dtype=np.float64)  # as a Ring's backward makes it
            grads = across((dO, Q, K, V, Out, L, delta.astype(Q.dtype)),
                           Call(ring, rings, score, inner, timeout, inner_precision))
            return [g.astype(inner_precision.input, copy=False) for g in grads]

        dq, dk, dv = _across(backward, [dO, Q, K, V, Out, L[..., 0]], "qqkkql", "qkk", plan, rank, cross, timeout,
                             backward=True)
        _join(record, inner)
        kv = deal.counts(kv=True)
        got = tokens_back(group, [dq, deal.fold(place, dk), deal.fold(place, dv)], [deal.counts(), kv, kv],
                          [lengths, kv_lengths, kv_lengths], precision.grad, record, timeout, plan.n_steps - 1,
                          "gradients back")
    finally:
        group.Free()
        cross.Free()
    return gradients_home(got, deal.kv, k.shape, v.shape, precision.sums)
