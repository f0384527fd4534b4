"""Ring attention over MPI, forward: every rank keeps its queries, K/V blocks travel the ring.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal

The loop below is the whole algorithm: start passing the held blocks on,
compute on them (``block.attend``: the kernel and the log-sum-exp merge; tests
wrap it to inject faults), wait for the next ones, swap. Which block is where
at each step is the plan's (``mpiring.plan``); how it moves is ``mpiring.comm``'s.
"""

import time

import numpy as np
from mpi4py import MPI

from . import block
from .agree import check_comm, resolve_timeout, setup
from .comm import CommTimeout, KVBuffers, RingComm, allgathered, exclusive, next_buffers, shift, wait_until
from .passq import chosen_rotation, passq_loop, rotate_problem
from .record import Record

__all__ = ["ring_attention", "agree_outcome"]


def _ring_loop(q, k, v, plan, ring, scale, rec, timeout):
    """The ring: start passing the held blocks on, compute on them, wait, swap."""
    rank = ring.rank
    acc = block.accumulators(q, v)
    longest = max(len(s) for s in plan.kv_shards)
    # K/V blocks are kept as the kernel takes them, [k | 1]^T and [v | 1]^T, in two slots per stream;
    # the first slot of the first stream starts with this rank's own block.
    buffers = {stream: KVBuffers((k, v), longest) for stream in plan.rounds or [+1]}  # +1: plan.NEXT
    own = next(iter(buffers.values())).hold((k, v))
    held = {stream: own for stream in buffers}  # the block each stream holds now
    for step in range(plan.n_steps):
        incoming = next_buffers(plan, rank, step, buffers)
        shift(ring, {s: held[s] for s in incoming}, incoming, rec, step, pad=1)  # Isend/Irecv, non-blocking
        start = time.perf_counter()
        for task in plan.tasks(step, rank):  # one block (two when bidirectional)
            block.attend(q, held[task.stream], task, plan.pieces(rank, task.source), scale, acc, rec, ring.progress,
                         step, padded=True)
        computed, start = time.perf_counter() - start, time.perf_counter()
        ring.wait(timeout, _slow_step_note(step, computed, timeout))
        rec.event("wait", start, step=step)
        held.update(incoming)  # the blocks that arrived are the ones to use next step
        rec.step_done(step, plan.n_steps)
    return acc[0].astype(q.dtype, copy=False), acc[1].astype(q.dtype, copy=False)


def _allgather_loop(q, k, v, plan, comm, scale, rec, timeout):
    """All-gather K/V once (overlapped with the local block), then compute locally."""
    rank = comm.Get_rank()
    acc = block.accumulators(q, v)
    for step, task, kv, progress in allgathered(k, v, plan, comm, rec, timeout):
        block.attend(q, kv, task, plan.pieces(rank, task.source), scale, acc, rec, progress, step)
        rec.step_done(step, plan.n_steps)
    return acc[0].astype(q.dtype, copy=False), acc[1].astype(q.dtype, copy=False)


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
    wait_until([comm.Iallreduce(times, spread, op=MPI.MAX)], round(timeout * 1.5 + 0.5, 2), rank, "end-of-ring check")
    latest, earliest = spread[0], -spread[1]
    if latest - earliest > timeout:
        raise CommTimeout(f"rank {rank}: the ranks finished the ring {latest - earliest:.3g} s apart, more than "
                          f"the timeout ({timeout:g} s): one was stalled and the others gave up on it")


def ring_attention(
    q: np.ndarray,  # (..., Hq, n, D): this rank's queries (n = its tokens under ``layout``)
    k: np.ndarray,  # (..., Hk, n, D), Hq a multiple of Hk
    v: np.ndarray,  # (..., Hk, n, Dv)
    comm=None, *, causal: bool = False, scale: float | None = None, layout: str = "contiguous",
    mode: str = "ring", window: tuple[int, int] | None = None, cu_seqlens=None,
    timeout: float | str | None = "auto", record: Record | None = None, check_finite: bool = False,
    expected_size: int | None = None, positions=None, kv_positions=None, causal_block: int | None = None,
    rotate: str = "kv",
) -> tuple[np.ndarray, np.ndarray]:  # out (..., Hq, n, Dv), lse (..., Hq, n)
    """Attention of this rank's queries against the whole distributed sequence.

    Every rank passes its local shard ``(..., seq_local, dim)`` of q, k, v (the
    ``layout`` says which tokens it holds) and gets its ``(out, lse)`` back:
    out ``(..., Hq, seq_local, dim_v)`` and the log-sum-exp ``(..., Hq, seq_local)``.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD); one rank = one device.
        causal: token t attends only to tokens <= t.
        scale: softmax scale, default 1/sqrt(dim).
        layout: "contiguous", "zigzag" or "striped" (see ``mpiring.layouts``).
        mode: "ring", "bidirectional" or "allgather" (see ``mpiring.schedule``).
        window: sliding window ``(left, right)`` as in flash-attn; -1 is unbounded.
        cu_seqlens: packed documents ``[0, end_0, end_1, ..., seq_len]`` (global positions).
        positions: global positions of this rank's q (and k, v) rows, any
            order and any number (at least one); the ranks' together hold every
            position of the sequence once. Replaces ``layout`` (see ``mpiring.balance``).
        kv_positions: positions of this rank's k, v rows when they are not q's
            (queries against a longer K/V: every rank's together hold every key
            position once; q positions are then distinct positions among them).
        causal_block: with ``causal``, key j is visible to query i iff
            j // causal_block <= i // causal_block (frame-causal video masks).
        timeout: seconds a rank may wait for the others (each transfer, a final
            check) before raising ``CommTimeout``; an error or stall on one rank
            then raises on every rank still alive: the failed rank its own error
            at once, the others CommTimeout within 2.5 x timeout. "auto" (the
            default): 60 s for ranks to arrive, then 60 s plus the busiest rank's
            FLOPs at 1e8 FLOP/s for every wait (``agree.resolve_timeout``). None
            waits forever. Must be the same on every rank and exceed the
            longest compute step.
        record: a ``Record`` to fill with tasks, events and traffic counters.
        check_finite: also reject NaN/Inf in q, k, v (one extra pass over them).
        expected_size: raise unless the communicator has this many ranks.
        rotate: what travels the ring: "kv" (K/V blocks), "q" (query blocks; K/V
            stay and the partial results go home, ``mpiring.passq``; mode "ring"
            only), or "auto": whichever sends fewer bytes under the plan
            (``passq.plan_bytes``); the choice is in ``record.rotate``.

    Bad arguments on any rank raise the same ``ValueError`` on every rank,
    before any transfer (see docs/reliability.md).
    """
    comm = check_comm(comm)
    with exclusive(comm):  # one call per communicator at a time (threads: one Dup each)
        options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens,
                       positions=positions, kv_positions=kv_positions, causal_block=causal_block)
        plan, scale, (q, k, v) = setup(q, k, v, comm, scale, options, check_finite, expected_size, timeout,
                                       prepare=lambda: [np.ascontiguousarray(a) for a in (q, k, v)], rows="qkk",
                                       problem=rotate_problem(rotate, mode), compare={"rotate": rotate})
        rotate = chosen_rotation(rotate, plan, q, k, v)
        timeout = resolve_timeout(timeout, plan, q.size // (q.shape[-2] * q.shape[-1]), q.shape[-1])
        rec = Record(comm.Get_rank()) if record is None else record
        with RingComm(comm, timeout) as ring:  # a private duplicate: the caller's messages never mix with the ring's
            # a common start: event times minus rec.t0 compare across ranks
            wait_until([ring.comm.Ibarrier()], timeout, ring.rank, "start barrier")
            rec.t0 = start = time.perf_counter()
            rec.rotate = rotate
            if plan.mode == "allgather":
                out, lse = _allgather_loop(q, k, v, plan, ring.comm, scale, rec, timeout)
            elif rotate == "q":
                out, lse = passq_loop(q, k, v, plan, ring, scale, rec, timeout)
                rec.bytes_sent += ring.bytes_sent
                rec.messages, rec.wait_time = rec.messages + ring.messages, ring.wait_time
            else:
                out, lse = _ring_loop(q, k, v, plan, ring, scale, rec, timeout)
                rec.bytes_sent, rec.messages, rec.wait_time = ring.bytes_sent, ring.messages, ring.wait_time
            if timeout is not None:
                agree_outcome(ring.comm, timeout, rec.t0)
        rec.wall_time = time.perf_counter() - start
        rec.plan = plan
        rank = comm.Get_rank()
        return plan.in_caller_order(rank, out), plan.in_caller_order(rank, lse, axis=-1)
