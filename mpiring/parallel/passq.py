"""Pass-Q ring attention: the query blocks travel the ring, K/V stay; the partials go home at the end.

    mpiexec -n 4 python -m mpiring generate --prompt-len 4096 --new-tokens 4 --rotate q

At step s rank r holds the queries of rank j = r - s and attends them to its
own K/V (``block.attend``: the same kernel and merge as the K/V ring, with the
plan's pieces of j's queries against r's keys), keeping one partial
``(out, lse)`` per visiting block (float64, or as ``accumulate=`` says). After
the ring, one all-to-all sends every partial home (none where the mask hides
all of r's keys from j's queries), and every rank merges its partials in rank
order with the log-sum-exp rule, into accumulators of the same dtype.

With a ``wire_dtype`` the query blocks travel coded as K/V blocks do in the
K/V ring (``precision.Wire``: coded once by their owner, decoded by every rank
they reach); every rank attends its own queries exactly. The partials go
home as float64 values, as without one.

Pass-Q pays off when the queries are fewer than the keys: a prefill of T new
tokens against a cache of C (Meta, "Context Parallelism for Scalable
Million-Token Inference", 2024); ``ring_attention(..., rotate="auto")``
chooses by the bytes each way (``mpiring.cost.infercost.plan_bytes``).
"""

import time

import numpy as np

from ..core import block
from ..core.buffers import Buffers, kernel_form
from ..core.kernels import merge
from ..core.precision import compute_dtype, row_bytes
from ..mpi.comm import shift
from ..mpi.waits import wait_until
from ..plans.plan import NEXT, Task, reach

__all__ = ["passq_loop", "plan_bytes", "rank_bytes", "chosen_rotation", "q_rounds"]

def passq_loop(q, k, v, call):
    """The pass-Q ring: pass the held query block on, attend it to this rank's K/V, wait, swap; then send partials home.

    ``precision``: the call's ``Precision``: its wire codes the travelling query blocks, the partials and their merge
    accumulate in its ``out`` and ``lse`` dtypes (``accumulate=``; default float64).
    Returns this rank's merged ``(out, lse)`` in q's dtype, rows in position order.
    """
    plan, ring, score = call.plan, call.ring, call.score
    record, timeout, precision = call.record, call.timeout, call.precision
    rank, size = ring.rank, ring.size
    wire = precision.wire
    form = kernel_form((k, v), k.shape[-2])
    own_kv = form.hold((k, v))  # the kernel backend's form ([k | 1]^T, [v | 1]^T for the NumPy kernel), made once
    buffers = Buffers((wire.template(q),), max(len(s) for s in plan.shards))
    mine = wire.own((q,))  # this rank's queries, attended exactly
    held = (wire.encode(q),)  # as the wire carries them: coded once, here
    partials = {}
    rounds = q_rounds(plan)
    for step in range(rounds + 1):
        source = (rank - step) % size  # whose queries this rank holds
        incoming = None
        if step < rounds:
            incoming = buffers.take(len(plan.shards[(rank - step - 1) % size]))
            shift(ring, {NEXT: held}, {NEXT: incoming}, record, step, data="Q")
        task = Task(source, plan.kinds[source][rank])
        queries = None
        if task.kind != "skip":
            queries = (mine if source == rank else wire.arrived(held))[0]
            partials[source] = block.accumulators(queries, v, precision.out, precision.lse)
        block.attend(queries, own_kv, block.Visit(step, task, plan.pieces(source, rank)), score, partials.get(source),
                     record, ring.progress, padded=form.padded)
        start = time.perf_counter()
        if incoming is not None:
            ring.wait(timeout)
            record.event("wait", start, step=step)
            held = incoming
        record.step_done(step, rounds + 1)
    out, lse = _home(partials, q, v, plan, ring.comm, record, timeout, precision)
    return out.astype(q.dtype, copy=False), lse.astype(compute_dtype(q.dtype), copy=False)


def q_rounds(plan):
    """Transfers of the query blocks: up to the last step at which some rank's keys are visible to the block it holds.

    As the K/V ring stops early (``plan.rounds``), so does this one: with a
    sliding window the blocks stop once no rank further round needs them.
    """
    first = reach(plan).first(1, plan.size - 1)  # rank r holds the queries of r - s: offset P - s
    return 0 if first is None else plan.size - first


def _home(partials, q, v, plan, comm, rec, timeout, pr):
    """The all-to-all of the partials to their queries' ranks, and their merge there, in rank order."""
    rank, size = comm.Get_rank(), comm.Get_size()
    width = q.size // q.shape[-2] // q.shape[-1] * (v.shape[-1] + 1)  # float64 values per query row
    send_counts = [len(plan.shards[j]) * width if j in partials and j != rank else 0 for j in range(size)]
    recv_counts = [len(plan.shards[rank]) * width if plan.kinds[rank][j] != "skip" and j != rank else 0
                   for j in range(size)]
    send = np.empty(sum(send_counts), np.float64)
    offset = 0
    for j, n in enumerate(send_counts):
        if n:
            _pack(partials[j], send[offset:offset + n])
            offset += n
    recv = np.empty(sum(recv_counts), np.float64)
    start = time.perf_counter()
    wait_until([comm.Ialltoallv([send, send_counts], [recv, recv_counts])], timeout, rank, "partials home")
    rec.bytes_sent += send.nbytes
    rec.messages += sum(1 for n in send_counts if n)
    rec.event("send", start, step=size, data="partials home", bytes=send.nbytes, dest="all")
    out, lse = block.accumulators(q, v, pr.out, pr.lse)
    offset = 0
    for j in range(size):
        if j == rank and j in partials:
            merge(out, lse, *partials[j], inplace=True)
        elif recv_counts[j]:
            other = _unpack(recv[offset:offset + recv_counts[j]], out.shape)
            merge(out, lse, *other, inplace=True)
            offset += recv_counts[j]
    return out, lse


def _pack(partial, flat):
    """A partial ``[out, lse]`` into ``flat`` as rows ``[out, lse]``."""
    out, lse = partial
    rows = flat.reshape(lse.shape + (out.shape[-1] + 1,))
    rows[..., :-1] = out
    rows[..., -1] = lse


def _unpack(flat, out_shape):
    rows = flat.reshape(out_shape[:-1] + (out_shape[-1] + 1,))
    return rows[..., :-1], rows[..., -1]


def rank_bytes(plan, batch_heads, kv_heads_ratio, dim, value_dim, itemsize, wire_dtype=None):
    """Bytes each rank sends in the forward pass under ``plan``: ``{"kv": [...], "q": [...]}`` (pass-Q with its
    partials home), K/V or the query blocks on the wire of ``wire_dtype`` (``precision.row_bytes``).

    ``batch_heads`` = batch x query heads; K/V have ``batch_heads / kv_heads_ratio`` heads.
    """
    size = plan.size
    kv_width = batch_heads // kv_heads_ratio * (row_bytes(wire_dtype, dim, itemsize)
                                                 + row_bytes(wire_dtype, value_dim, itemsize))
    q_width = batch_heads * row_bytes(wire_dtype, dim, itemsize)
    partial_width = batch_heads * (value_dim + 1) * 8
    kv, qb = [], []
    for r in range(size):
        kv.append(sum(len(plan.kv_shards[plan.held_source(r, s, step)]) for s, rounds in plan.rounds.items()
                      for step in range(rounds)) * kv_width)
        sent_q = sum(len(plan.shards[(r - step) % size]) for step in range(q_rounds(plan))) * q_width
        home = sum(len(plan.shards[j]) for j in range(size) if j != r and plan.kinds[j][r] != "skip") * partial_width
        qb.append(sent_q + home)
    return {"kv": kv, "q": qb}


def plan_bytes(plan, batch_heads, kv_heads_ratio, dim, value_dim, itemsize, wire_dtype=None):
    """Bytes the busiest rank sends under ``plan``: ``{"kv": ..., "q": ...}`` (``rank_bytes``' largest)."""
    return {name: max(sent) for name, sent in rank_bytes(plan, batch_heads, kv_heads_ratio, dim, value_dim, itemsize,
                                                         wire_dtype).items()}



def chosen_rotation(rotate, plan, q, k, v, wire_dtype=None):
    """``rotate``, "auto" decided by ``plan_bytes`` on the call's wire ("kv" on ties), for a plan whose ring can
    pass queries (``strategies.rotation`` asks only for those); the same on every rank."""
    if rotate != "auto":
        return rotate
    batch_heads = q.size // (q.shape[-2] * q.shape[-1])
    ratio = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    b = plan_bytes(plan, batch_heads, ratio, q.shape[-1], v.shape[-1], q.dtype.itemsize, wire_dtype)
    return "q" if b["q"] < b["kv"] else "kv"
