"""Ring x Ulysses over MPI (``ulysses_size=u``): Ulysses inside groups of u ranks, a ring across the groups.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_grid_mpi.py

Ranks form a u x (P/u) grid with two communicators (``Split``): the group,
u consecutive ranks, and the cross ring, the ranks at the same place of
every group. Every rank holds the tokens its layout gives it, as in every
mode (``shard_indices``). The group's all-to-all gives each rank the
group's tokens for Hq/u heads (``ulysses.heads_out``), member after member;
the ring across groups is ``ring_attention`` (``ring_attention_backward``)
itself on the cross communicator, with those tokens as its ``positions``
(``heads.HybridPlan``); a second all-to-all brings every rank its tokens back.
The inner call's events, tasks and counters join this call's record.

A coded ``wire_dtype`` codes K/V on both: the group's all-to-all (each
rank's own share stays exact) and the ring across groups (the inner call,
given the same wire). A token from another member so crosses two coded
hops, but coding is idempotent (a half rounding exactly; int8 to within
float32 rounding of its scale), so it carries one coding's error.
Gradients come back in ``grad_wire_dtype``, which the inner ring's partials use too.
"""

import numpy as np

from ..core.precision import Precision
from ..mpi.record import Record
from ..plans.heads import kv_heads, query_heads
from .ulysses import heads_out, result_dtypes, tokens_back

__all__ = ["grid_comms", "hybrid_forward", "hybrid_backward"]

SUMS = ("bytes_sent", "messages", "wait_time", "compute_time", "computed_pairs", "visible_pairs")


def grid_comms(comm, plan):
    """``(group, cross)``: this rank's group of u and its ring across groups (collective; free both after)."""
    g, j = plan.group(comm.Get_rank())
    return comm.Split(g, j), comm.Split(j, g)


def _join(rec, inner):
    """Add the inner ring's record to this call's."""
    rec.events += inner.events
    rec.tasks += inner.tasks
    for name in SUMS:
        setattr(rec, name, getattr(rec, name) + getattr(inner, name))


def _heads(plan, hq, hk):
    """Per group member: its query heads and K/V heads (slices), as Ulysses splits them over u ranks."""
    u = plan.ulysses_size
    return [query_heads(j, u, hq) for j in range(u)], [kv_heads(j, u, hk) for j in range(u)]


def _lengths(plan, rank, kv=False):
    """Tokens of each member of ``rank``'s group: its queries (``kv``: its keys)."""
    shards = plan.kv_shards if kv else plan.shards
    return [len(shards[r]) for r in plan.members(plan.group(rank)[0])]


def _inner(plan, rank, options):
    """The options of the ring across groups: the group's tokens as positions, the plan's mask."""
    g, _ = plan.group(rank)
    ring = plan.ring_plan
    separate_kv = plan.kv_shards is not plan.shards
    inner = {name: value for name, value in options.items() if name not in ("layout", "mode", "causal", "window",
                                                                              "cu_seqlens")}
    return dict(inner, mode=ring.mode, causal=ring.causal, window=ring.window, cu_seqlens=ring.cu_seqlens,
                causal_block=ring.causal_block, positions=plan.group_positions(g),
                kv_positions=plan.group_positions(g, kv=True) if separate_kv else None)


def hybrid_forward(q, k, v, plan, comm, options, scale, rec, timeout, pr=None):
    """This rank's (out, lse); ``options``: the ring's (layout, mode, causal, window, cu_seqlens); ``pr``: the
    call's ``Precision`` (its wire)."""
    from ..handle import ring_attention  # the one upward import (mpiring/parallel/__init__.py)

    pr = pr or Precision(k.dtype)
    rank = comm.Get_rank()
    qs, ks = _heads(plan, q.shape[-3], k.shape[-3])
    lengths, kv_lengths = _lengths(plan, rank), _lengths(plan, rank, kv=True)
    group, cross = grid_comms(comm, plan)
    try:
        Q, K, V = heads_out(group, [q, k, v], [qs, ks, ks], [lengths, kv_lengths, kv_lengths],
                            [q.dtype, pr.wire, pr.wire], rec, timeout, 0)
        K, V = (a.astype(q.dtype, copy=False) for a in (K, V))  # the inner call takes one dtype (half: as given)
        inner = Record(rank)
        out, lse = ring_attention(Q, K, V, cross, scale=scale, timeout=timeout, record=inner,
                                  wire_dtype=pr.options["wire_dtype"], **_inner(plan, rank, options))
        _join(rec, inner)
        h = Q.shape[-3]
        got = tokens_back(group, [out, lse[..., None]], [[h] * len(lengths)] * 2, [lengths] * 2,
                          result_dtypes(q.dtype), rec, timeout, plan.n_steps - 1)
    finally:
        group.Free()
        cross.Free()
    return np.concatenate([g[0] for g in got], axis=-3), np.concatenate([g[1][..., 0] for g in got], axis=-2)


def hybrid_backward(dout, q, k, v, out, lse, plan, comm, options, scale, rec, timeout, pr=None):
    """This rank's (dq, dk, dv): the group's heads out (q, dout, out, lse; k, v on the wire of ``pr``), the cross
    ring's backward, the gradients back (in ``pr.grad``); dK, dV of a K/V head that several members held
    (fewer K/V heads than u) add up."""
    from ..handle import ring_attention_backward  # the one upward import (mpiring/parallel/__init__.py)

    pr = pr or Precision(k.dtype)
    rank = comm.Get_rank()
    qs, ks = _heads(plan, q.shape[-3], k.shape[-3])
    lengths, kv_lengths = _lengths(plan, rank), _lengths(plan, rank, kv=True)
    group, cross = grid_comms(comm, plan)
    try:
        Q, dO, Out, L, K, V = heads_out(group, [q, dout, out, lse[..., None], k, v], [qs] * 4 + [ks] * 2,
                                      [lengths] * 4 + [kv_lengths] * 2, [q.dtype] * 4 + [pr.wire] * 2, rec, timeout, 0)
        inner = Record(rank)
        dq, dk, dv = ring_attention_backward(dO, Q, K, V, Out, L[..., 0], cross, scale=scale, timeout=timeout,
                                             record=inner, **pr.options, **_inner(plan, rank, options))
        _join(rec, inner)
        kv = [len(range(k.shape[-3])[s]) for s in ks]
        got = tokens_back(group, [dq, dk, dv], [[Q.shape[-3]] * len(lengths), kv, kv],
                          [lengths, kv_lengths, kv_lengths], pr.grad, rec, timeout, plan.n_steps - 1)
    finally:
        group.Free()
        cross.Free()
    dk_all, dv_all = np.zeros(k.shape, np.float64), np.zeros(v.shape, np.float64)
    for s, (_, gk, gv) in enumerate(got):
        dk_all[..., ks[s], :, :] += gk
        dv_all[..., ks[s], :, :] += gv
    return np.concatenate([g[0] for g in got], axis=-3), dk_all, dv_all
