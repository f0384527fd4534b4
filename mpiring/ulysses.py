"""Ulysses over MPI, forward and backward: all-to-all to head shards, attend the whole sequence, all-to-all back.

    mpiexec -n 4 python -m mpiring run --mode ulysses --heads 8 --kv-heads 2 --causal --backward

``ring_attention`` and ``ring_attention_backward`` call these when the plan's
mode is "ulysses" (``mpiring.heads`` has the plan, the head split and the
bytes). The blocks are the ring's: one key block per source rank, through
``block.attend`` and ``block.grads_of``; only the movement differs.
"""

import time

import numpy as np

from . import block
from .block import GRAD_DTYPE, add_grads, count_pairs
from .comm import wait_until
from .heads import kv_heads, query_heads

__all__ = ["exchange", "ulysses_forward", "ulysses_backward"]


def exchange(comm, sends, shapes, dtype, rec, timeout, step, data):
    """One all-to-all of several arrays per peer: ``sends[d]`` go to rank d; returns ``got[s]``, from rank s.

    ``shapes[s]`` are the shapes of the arrays rank s sends here. Everything
    travels in ``dtype`` as one ``Ialltoallv``; bytes and messages to other
    ranks are counted in ``rec`` (a rank's share to itself never leaves it),
    with a "send" and a "wait" event.
    """
    rank = comm.Get_rank()
    send_counts = [sum(a.size for a in arrays) for arrays in sends]
    flat = np.concatenate([np.asarray(a, dtype).ravel() for arrays in sends for a in arrays] + [np.empty(0, dtype)])
    recv_counts = [sum(int(np.prod(s)) for s in group) for group in shapes]
    got = np.empty(sum(recv_counts), dtype)
    posted = time.perf_counter()
    request = comm.Ialltoallv([flat, send_counts], [got, recv_counts])
    nbytes = (sum(send_counts) - send_counts[rank]) * np.dtype(dtype).itemsize
    rec.bytes_sent += nbytes
    rec.messages += sum(1 for d, c in enumerate(send_counts) if d != rank and c)
    rec.event("send", posted, step=step, stream=0, data=data, dest="all", bytes=nbytes)
    start = time.perf_counter()
    wait_until([request], timeout, rank, f"all-to-all ({data})")
    end = rec.event("wait", start, step=step, data=data)
    rec.wait_time += end - start
    out, at = [], 0
    for group in shapes:
        arrays = []
        for shape in group:
            size = int(np.prod(shape))
            arrays.append(got[at:at + size].reshape(shape))
            at += size
        out.append(arrays)
    return out


def _with_heads(*arrays):
    """(seq, dim) arrays as (1, seq, dim): one head (Ulysses splits heads; with one rank that is all of them)."""
    return [a[None] for a in arrays]


def _no_progress():
    pass


def ulysses_forward(q, k, v, plan, comm, scale, rec, timeout):
    """This rank's (out, lse): its tokens' heads out, every token of its heads attended, results back."""
    flat = q.ndim == 2
    if flat:
        q, k, v = _with_heads(q, k, v)
    rank, size = plan_rank(comm, plan)
    lead, hq, hk, D, Dv = q.shape[:-3], q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1]
    n = [len(s) for s in plan.shards]
    hq_l, hk_l = hq // size, len(range(hk)[kv_heads(rank, size, hk)])
    sends = [[q[..., query_heads(d, size, hq), :, :], k[..., kv_heads(d, size, hk), :, :],
              v[..., kv_heads(d, size, hk), :, :]] for d in range(size)]
    shapes = [[lead + (hq_l, n[s], D), lead + (hk_l, n[s], D), lead + (hk_l, n[s], Dv)] for s in range(size)]
    got = exchange(comm, sends, shapes, q.dtype, rec, timeout, 0, "heads out")
    queries = np.concatenate([g[0] for g in got], axis=-2)  # (..., Hq/P, S, D): every token, shard order
    acc = block.accumulators(queries, got[0][2])
    for task in plan.tasks(0, rank):  # key block j: the tokens rank j held
        _, ks, vs = got[task.source]
        block.attend(queries, (ks, vs), task, plan.block_pieces(task.source), scale, acc, rec, _no_progress, 0)
    rec.step_done(0, plan.n_steps)
    starts = plan.offsets()
    sends = [[acc[0][..., starts[d]:starts[d] + n[d], :], acc[1][..., starts[d]:starts[d] + n[d]]]
             for d in range(size)]
    shapes = [[lead + (hq_l, n[rank], Dv), lead + (hq_l, n[rank])] for _ in range(size)]
    got = exchange(comm, sends, shapes, q.dtype, rec, timeout, 0, "results back")
    out = np.concatenate([g[0] for g in got], axis=-3)
    lse = np.concatenate([g[1] for g in got], axis=-2)
    return (out[0], lse[0]) if flat else (out, lse)


def plan_rank(comm, plan):
    """This rank and the plan's size, which must be the communicator's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != plan.size:
        raise ValueError(f"the plan is for {plan.size} ranks, the communicator has {size}")
    return rank, size


def ulysses_backward(dout, q, k, v, lse, delta, plan, comm, scale, rec, timeout):
    """This rank's (dq, dk, dv) in float64: its tokens' heads out, every token's gradients, gradients back.

    ``delta`` = rowsum(dout * out) travels instead of out (one value per row).
    dK, dV of a K/V head held by several ranks (fewer K/V heads than ranks)
    come back from each, for a subset of the group's query heads, and are summed.
    """
    flat = q.ndim == 2
    if flat:
        dout, q, k, v = _with_heads(dout, q, k, v)
        lse, delta = lse[None], delta[None]
    rank, size = plan_rank(comm, plan)
    lead, hq, hk, D, Dv = q.shape[:-3], q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1]
    n = [len(s) for s in plan.shards]
    hq_l = hq // size
    kv = [kv_heads(d, size, hk) for d in range(size)]
    sends = []
    for d in range(size):
        h = query_heads(d, size, hq)
        sends.append([q[..., h, :, :], dout[..., h, :, :], lse[..., h, :], delta[..., h, :],
                      k[..., kv[d], :, :], v[..., kv[d], :, :]])
    hk_l = kv[rank].stop - kv[rank].start
    shapes = [[lead + (hq_l, n[s], D), lead + (hq_l, n[s], Dv), lead + (hq_l, n[s]), lead + (hq_l, n[s]),
               lead + (hk_l, n[s], D), lead + (hk_l, n[s], Dv)] for s in range(size)]
    got = exchange(comm, sends, shapes, q.dtype, rec, timeout, 0, "heads out")
    Q, dO, L, De = (np.concatenate([g[i] for g in got], axis=-2 if i < 2 else -1) for i in range(4))
    # out is read only to compute delta, which is given: a zero-size stand-in of its shape
    queries = (dO, Q, np.broadcast_to(np.zeros((), q.dtype), dO.shape), L, De)
    dq = np.zeros(Q.shape, GRAD_DTYPE)
    partials = [[np.zeros(g[4].shape, GRAD_DTYPE), np.zeros(g[5].shape, GRAD_DTYPE)] for g in got]
    for task in plan.tasks(0, rank):
        pieces = plan.block_pieces(task.source)
        count_pairs(rec, pieces)
        grads = block.grads_of(queries, got[task.source][4:], task, pieces, scale, dq, rec, _no_progress, 0)
        add_grads(partials[task.source], grads)
        rec.tasks.append((0, task))
    rec.step_done(0, plan.n_steps)
    starts = plan.offsets()
    sends = [[dq[..., starts[d]:starts[d] + n[d], :]] + partials[d] for d in range(size)]
    shapes = [[lead + (hq_l, n[rank], D), lead + (kv[s].stop - kv[s].start, n[rank], D),
               lead + (kv[s].stop - kv[s].start, n[rank], Dv)] for s in range(size)]
    got = exchange(comm, sends, shapes, GRAD_DTYPE, rec, timeout, 0, "gradients back")
    dq = np.concatenate([g[0] for g in got], axis=-3)
    dk = np.zeros(k.shape, GRAD_DTYPE)
    dv = np.zeros(v.shape, GRAD_DTYPE)
    for s, (_, gk, gv) in enumerate(got):  # replicated K/V heads: every replica's share adds up
        dk[..., kv[s], :, :] += gk
        dv[..., kv[s], :, :] += gv
    return (dq[0], dk[0], dv[0]) if flat else (dq, dk, dv)
