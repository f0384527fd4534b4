"""Ulysses over MPI, forward and backward: all-to-all to head shards, attend the whole sequence, all-to-all back.

    mpiexec -n 4 python -m mpiring run --mode ulysses --heads 8 --kv-heads 2 --causal --backward

``ring_attention`` and ``ring_attention_backward`` call these when the plan's
mode is "ulysses" (``mpiring.plans.heads`` has the plan, the head split and the
bytes). Between the all-to-alls the gathered rows are put in position order
(``UlyssesPlan.order``) and the block code is the ring's: one kernel call per
key block (the j-th run of sorted keys), through ``block.attend`` and
``block.grads_of``; the results go back to shard order for the second all-to-all.
"""

import time

import numpy as np

from ..core import block
from ..core.block import add_grads, count_pairs
from ..core.buffers import mpi_view
from ..core.precision import Plain, Wire, compute_dtype
from ..mpi.waits import wait_until
from ..plans.heads import deal_heads
from ..plans.layouts import put_rows, take_rows

__all__ = ["exchange", "heads_out", "tokens_back", "result_dtypes", "gradients_home", "ulysses_forward",
           "ulysses_backward"]


def exchange(comm, sends, shapes, dtype, rec, timeout, step, data):
    """One all-to-all of several arrays per peer: ``sends[d]`` go to rank d; returns ``got[s]``, from rank s.

    ``shapes[s]`` are the shapes of the arrays rank s sends here. ``dtype``:
    what every array travels as, or one per array (``sends[d][i]``): a dtype
    (converted to it) or a ``precision.Wire`` (coded, decoded on arrival into
    the compute dtype). Everything goes as one ``Ialltoallv`` (of bytes when
    the arrays' wire dtypes differ). A rank's share to itself never leaves
    it: converted as if it had travelled, never coded (``kept``). Bytes and
    messages to other ranks are counted in ``rec``, with a "send" and a "wait" event.
    """
    rank = comm.Get_rank()
    carriers = [_carrier(c) for c in (dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes[0]))]
    unit = carriers[0].dtype if len({c.dtype for c in carriers}) == 1 else np.dtype(np.uint8)
    wired = [[] if d == rank else [_units(c.encode(a), unit) for c, a in zip(carriers, arrays)]
             for d, arrays in enumerate(sends)]
    send_counts = [sum(a.size for a in arrays) for arrays in wired]
    flat = np.concatenate([a for arrays in wired for a in arrays] + [np.empty(0, unit)])
    wire_shapes = [[shape[:-1] + (c.row(shape[-1]),) for c, shape in zip(carriers, group)] for group in shapes]
    recv_counts = [0 if s == rank else sum(int(np.prod(w)) * c.dtype.itemsize // unit.itemsize
                                           for c, w in zip(carriers, group)) for s, group in enumerate(wire_shapes)]
    got = np.empty(sum(recv_counts), unit)
    posted = time.perf_counter()
    request = comm.Ialltoallv([mpi_view(flat), send_counts], [mpi_view(got), recv_counts])
    nbytes = sum(send_counts) * unit.itemsize
    rec.bytes_sent += nbytes
    rec.messages += sum(1 for c in send_counts if c)
    rec.event("send", posted, step=step, stream=0, data=data, dest="all", bytes=nbytes)
    start = time.perf_counter()
    wait_until([request], timeout, rank, f"all-to-all ({data})")
    end = rec.event("wait", start, step=step, data=data)
    rec.wait_time += end - start
    out, at = [], 0
    for s, group in enumerate(wire_shapes):
        if s == rank:
            out.append([c.kept(a) for c, a in zip(carriers, sends[rank])])
            continue
        arrays = []
        for c, shape in zip(carriers, group):
            size = int(np.prod(shape)) * c.dtype.itemsize // unit.itemsize
            arrays.append(c.decode(got[at:at + size].view(c.dtype).reshape(shape)))
            at += size
        out.append(arrays)
    return out


def _carrier(how):
    """A ``Wire`` as it is; a dtype as a ``Plain`` (converted to it)."""
    return how if isinstance(how, Wire) else Plain(how)


def _units(a, unit):
    """The wire array ``a`` as a flat run of ``unit`` (its own dtype, or bytes)."""
    return np.ascontiguousarray(a).reshape(-1).view(unit)


def _with_heads(*arrays):
    """(seq, dim) arrays as (1, seq, dim): one head (Ulysses splits heads; with one rank that is all of them)."""
    return [a[None] for a in arrays]


def _no_progress():
    pass


def heads_out(comm, arrays, heads, lengths, dtype, rec, timeout, step, data="heads out"):
    """Every member's tokens of member d's heads to member d: one all-to-all; returns each array's result.

    ``arrays[i]``: this rank's (..., H_i, n_i, D_i); ``heads[i][d]``: the slice of
    heads member d gets; ``lengths[i][s]``: member s's tokens of array i (queries
    and keys differ with ``kv_positions``); ``dtype``: as ``exchange`` takes it.
    Each result is (..., h_i, sum(lengths[i]), D_i): the members' tokens one
    after the other.
    """
    rank = comm.Get_rank()
    sends = [[a[..., h[d], :, :] for a, h in zip(arrays, heads)] for d in range(len(lengths[0]))]
    mine = [len(range(a.shape[-3])[h[rank]]) for a, h in zip(arrays, heads)]
    shapes = [[a.shape[:-3] + (m, n[s], a.shape[-1]) for a, m, n in zip(arrays, mine, lengths)]
              for s in range(len(lengths[0]))]
    got = exchange(comm, sends, shapes, dtype, rec, timeout, step, data)
    return [np.concatenate([g[i] for g in got], axis=-2) for i in range(len(arrays))]


def tokens_back(comm, arrays, counts, lengths, dtype, rec, timeout, step, data="results back"):
    """The inverse movement: member d gets its tokens of this rank's heads; returns ``got[s][i]`` from member s.

    ``arrays[i]``: (..., h_i, sum(lengths[i]), D_i) in member order; ``counts[i][s]``:
    the heads of array i that member s holds. ``got[s][i]`` is (..., counts[i][s], lengths[i][me], D_i).
    """
    rank = comm.Get_rank()
    starts = [np.cumsum([0] + list(n)) for n in lengths]
    sends = [[a[..., at[d]:at[d + 1], :] for a, at in zip(arrays, starts)] for d in range(len(lengths[0]))]
    shapes = [[a.shape[:-3] + (c[s], n[rank], a.shape[-1]) for a, c, n in zip(arrays, counts, lengths)]
              for s in range(len(lengths[0]))]
    return exchange(comm, sends, shapes, dtype, rec, timeout, step, data)


def ulysses_forward(q, k, v, call):
    """This rank's (out, lse): its tokens' heads out, every token of its heads attended, results back.

    ``precision``: the call's ``Precision``; K/V go out on its wire (coded, decoded on
    arrival; this rank's own tokens of its heads stay exact), the queries and
    the results in the input dtype.
    """
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    flat = q.ndim == 2
    if flat:
        q, k, v = _with_heads(q, k, v)
    rank, size = plan_rank(comm, plan)
    n, m = [len(s) for s in plan.shards], [len(s) for s in plan.kv_shards]
    deal = deal_heads(q.shape[-3], k.shape[-3], size)
    qs, ks = deal.q, deal.kv
    score = score.for_heads(qs[rank])  # a score's bias and dropout see the global heads
    queries, keys, values = heads_out(comm, [q, k, v], [qs, ks, ks], [n, m, m],
                                      [q.dtype, precision.wire, precision.wire], record, timeout, 0)
    [queries], [keys, values] = _in_order(plan, [queries]), _in_order(plan, [keys, values], kv=True)
    keys, values = deal.expand(rank, keys), deal.expand(rank, values)  # a group this rank holds part of
    acc = block.accumulators(queries, values, precision.out, precision.lse)  # accumulate= as in the ring modes
    for task in plan.tasks(0, rank):  # key block j: the j-th run of keys in position order
        j = plan.key_block(task.source)
        visit = block.Visit(0, task, plan.block_pieces(task.source))
        block.attend(queries, (keys[..., j, :], values[..., j, :]), visit, score, acc, record, _no_progress)
    record.step_done(0, plan.n_steps)
    order = plan.order()
    got = tokens_back(comm, [put_rows(acc[0], order), put_rows(acc[1], order, axis=-1)[..., None]],
                      [deal.counts()] * 2, [n, n], result_dtypes(q.dtype), record, timeout, 0)
    out = np.concatenate([g[0] for g in got], axis=-3)
    lse = np.concatenate([g[1][..., 0] for g in got], axis=-2)
    return (out[0], lse[0]) if flat else (out, lse)


def _in_order(plan, arrays, kv=False):
    """The gathered (shard-ordered) query (``kv``: key) rows of ``arrays`` in position order (``plan.order``)."""
    order = plan.order(kv)
    return [take_rows(a, order) for a in arrays]


def result_dtypes(dtype):
    """What out and lse travel home in: out in the input dtype, lse in the dtype tiles compute in (float32
    for half inputs), as every mode returns them."""
    return [np.dtype(dtype), compute_dtype(dtype)]


def plan_rank(comm, plan):
    """This rank and the plan's size, which must be the communicator's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != plan.size:
        raise ValueError(f"the plan is for {plan.size} ranks, the communicator has {size}")
    return rank, size


def ulysses_backward(dout, q, k, v, out, lse, delta, call):
    """This rank's (dq, dk, dv) in ``precision.sums``: its tokens' heads out, every token's gradients, gradients back.

    ``delta`` = rowsum(dout * out) travels instead of out (one value per row).
    K/V go out on the wire of ``precision`` (the call's ``Precision``), as in the
    forward pass; dq, dK, dV come back in its ``grad`` dtype (``grad_wire_dtype``).
    dK, dV of a K/V head held by several ranks (fewer K/V heads than ranks)
    come back from each, for a subset of the group's query heads, and are summed.
    """
    plan, comm, score = call.plan, call.comm, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    flat = q.ndim == 2
    if flat:
        dout, q, k, v = _with_heads(dout, q, k, v)
        lse, delta = lse[None], delta[None]
    rank, size = plan_rank(comm, plan)
    n, m = [len(s) for s in plan.shards], [len(s) for s in plan.kv_shards]
    deal = deal_heads(q.shape[-3], k.shape[-3], size)
    qs, ks = deal.q, deal.kv
    score = score.for_heads(qs[rank])
    Q, dO, L, De, K, V = heads_out(comm, [q, dout, lse[..., None], delta[..., None], k, v], [qs] * 4 + [ks] * 2,
                                   [n] * 4 + [m] * 2, [q.dtype] * 4 + [precision.wire] * 2, record, timeout, 0)
    (Q, dO, L, De), (K, V) = _in_order(plan, [Q, dO, L, De]), _in_order(plan, [K, V], kv=True)
    K, V = deal.expand(rank, K), deal.expand(rank, V)
    # out is read only to compute delta, which is given: a zero-size stand-in of its shape
    queries = (dO, Q, np.broadcast_to(np.zeros((), q.dtype), dO.shape), L[..., 0], De[..., 0])
    dq = np.zeros(Q.shape, precision.sums)
    dK, dV = np.zeros(K.shape, precision.sums), np.zeros(V.shape, precision.sums)
    for task in plan.tasks(0, rank):
        j = plan.key_block(task.source)
        pieces = plan.block_pieces(task.source)
        count_pairs(record, pieces)
        grads = block.grads_of(queries, (K[..., j, :], V[..., j, :]), block.Visit(0, task, pieces), score, dq, record,
                               _no_progress)
        add_grads((dK[..., j, :], dV[..., j, :]), grads)
        record.tasks.append((0, task))
    record.step_done(0, plan.n_steps)
    kv = deal.counts(kv=True)
    dK, dV = deal.fold(rank, dK), deal.fold(rank, dV)
    dq, dK, dV = put_rows(dq, plan.order()), put_rows(dK, plan.order(kv=True)), put_rows(dV, plan.order(kv=True))
    got = tokens_back(comm, [dq, dK, dV], [deal.counts(), kv, kv], [n, m, m], precision.grad, record, timeout, 0,
                      "gradients back")
    dq, dk, dv = gradients_home(got, ks, k.shape, v.shape, precision.sums)
    return (dq[0], dk[0], dv[0]) if flat else (dq, dk, dv)


def gradients_home(got, ks, k_shape, v_shape, dtype):
    """``(dq, dk, dv)`` of this rank's tokens from what ``tokens_back`` brought (``got[s]``: member s's dq,
    dK, dV): dq's heads side by side; dK, dV of a K/V head that several members held (``ks[s]``: member s's,
    fewer K/V heads than members) add up, in ``dtype``."""
    dk, dv = np.zeros(k_shape, dtype), np.zeros(v_shape, dtype)
    for s, (_, gk, gv) in enumerate(got):  # replicated K/V heads: every replica's share adds up
        dk[..., ks[s], :, :] += gk
        dv[..., ks[s], :, :] += gv
    return np.concatenate([g[0] for g in got], axis=-3), dk, dv
