"""Ring attention over MPI: every rank keeps its queries, K/V blocks travel the ring.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal
"""

import hashlib
import time

import numpy as np
from mpi4py import MPI

from .comm import Buffers, RingComm
from .kernels import attention_block, default_scale, merge
from .layouts import shard, unshard
from .schedule import make_plan

__all__ = ["ring_attention", "distributed_attention", "Record"]


class Record:
    """What one rank did: the tasks it ran, timed events, and traffic counters."""

    def __init__(self, rank=0):
        self.rank = rank
        self.tasks = []  # (step, Task) in the order they were processed
        self.events = []  # (name, start, end, info) with time.perf_counter() stamps
        self.bytes_sent = 0
        self.messages = 0
        self.wait_time = 0.0
        self.compute_time = 0.0
        self.computed_pairs = 0  # score entries given to the kernel
        self.visible_pairs = 0  # of those, the ones the mask lets through
        self.wall_time = 0.0

    def table(self, n_steps):
        """This rank's column of the schedule: the tasks of each step."""
        column = [[] for _ in range(n_steps)]
        for step, task in self.tasks:
            column[step].append(task)
        return [tuple(c) for c in column]


# ---------------------------------------------------------------- validation


def _local_problem(q, k, v, scale):
    """What is wrong with this rank's own arguments, or None."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array, got {type(a).__name__}"
        if a.dtype not in (np.float32, np.float64):
            return f"{name} must be float32 or float64, got {a.dtype}"
        if a.ndim < 2:
            return f"{name} must have shape (..., seq, dim), got {a.shape}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.ndim == k.ndim == v.ndim):
        return f"q, k, v must have the same number of axes, got {q.shape}, {k.shape}, {v.shape}"
    if k.shape[:-1] != v.shape[:-1]:
        return f"k and v must agree on all but the last axis, got {k.shape} and {v.shape}"
    if q.shape[-1] != k.shape[-1]:
        return f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}"
    if q.shape[-2] != k.shape[-2]:
        return f"q and k must hold the same local tokens, got {q.shape[-2]} and {k.shape[-2]}"
    if q.ndim >= 3:
        if q.shape[:-3] != k.shape[:-3]:
            return f"q and k must have the same batch axes, got {q.shape} and {k.shape}"
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            return f"q heads ({q.shape[-3]}) must be a multiple of k/v heads ({k.shape[-3]})"
    if min(q.shape[-1], v.shape[-1]) < 1 or q.shape[-2] < 1:
        return f"every rank needs at least one token and a positive head dim, got q {q.shape}, v {v.shape}"
    if scale is not None and not (np.isscalar(scale) and np.isfinite(scale) and scale > 0):
        return f"scale must be a finite positive number, got {scale!r}"
    return None


def agree(comm, problem):
    """Collective: raise the same ValueError on every rank if any rank has a problem."""
    problems = comm.allgather(problem)
    bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if bad:
        raise ValueError("; ".join(bad))


def _fingerprint(options):
    """A short text that is equal on two ranks exactly when their options are."""
    parts = []
    for key, val in sorted(options.items()):
        if isinstance(val, np.ndarray) or (key == "cu_seqlens" and val is not None):
            val = hashlib.sha1(np.asarray(val).tobytes()).hexdigest()[:12]
        parts.append(f"{key}={val!r}")
    return ", ".join(parts)


def _setup(q, k, v, comm, scale, options):
    """Validate on every rank, agree collectively, and build the shared plan."""
    problem = _local_problem(q, k, v, scale)
    meta = None
    if problem is None:
        meta = (q.shape[:-2], k.shape[:-2], q.shape[-1], v.shape[-1], str(q.dtype), scale, _fingerprint(options))
    metas = comm.allgather((problem, meta, None if problem else q.shape[-2]))
    bad = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(metas) if p]
    if not bad:
        for r, (_, m, _) in enumerate(metas):
            if m != metas[0][1]:
                bad.append(f"rank {r}: shapes, dtype, scale or options differ from rank 0 "
                           f"({m[:6]} vs {metas[0][1][:6]}; options {m[6]} vs {metas[0][1][6]})")
    if bad:
        raise ValueError("; ".join(bad))
    lengths = [n for _, _, n in metas]
    plan = make_plan(sum(lengths), comm.Get_size(), **options)  # same on every rank: raises everywhere
    expected = [len(s) for s in plan.shards]
    if lengths != expected:
        raise ValueError(f"local sequence lengths {lengths} do not match the {plan.layout} layout of "
                         f"{plan.seq_len} tokens over {plan.size} ranks, which needs {expected}")
    return plan, default_scale(q.shape[-1]) if scale is None else float(scale)


# ---------------------------------------------------------------- the ring


def _compute(q, kv, task, plan, rank, scale, acc, rec, progress):
    """Attend this rank's queries to one K/V block and merge into ``acc``."""
    if task.kind != "skip":
        start = time.perf_counter()
        k, v = kv
        for a, b, c, d, klo, khi in plan.pieces(rank, task.source):
            rec.computed_pairs += (b - a) * (d - c)
            rec.visible_pairs += (b - a) * (d - c) if klo is None else int(np.sum(khi - klo))
            block = attention_block(q[..., a:b, :], k[..., c:d, :], v[..., c:d, :], scale, klo, khi,
                                    progress=progress)
            acc[0][..., a:b, :], acc[1][..., a:b] = merge(acc[0][..., a:b, :], acc[1][..., a:b], *block)
        end = time.perf_counter()
        rec.compute_time += end - start
        rec.events.append(("compute", start, end, {"source": task.source, "kind": task.kind}))


def _ring_loop(q, k, v, plan, ring, scale, rec, timeout):
    """The ring: start passing the held blocks on, compute on them, wait, swap."""
    rank = ring.rank
    acc = [np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype), np.full(q.shape[:-1], -np.inf, q.dtype)]
    held = {stream: (k, v) for stream in plan.rounds or [+1]}  # the block each stream holds now
    longest = max(len(s) for s in plan.shards)
    buffers = {stream: Buffers((k, v), longest) for stream in plan.rounds}
    for step in range(plan.n_steps):
        incoming = {}
        for stream in plan.rounds:
            if step < plan.rounds[stream]:  # someone still needs the next block of this stream
                source = plan.held_source(rank, stream, step + 1)
                incoming[stream] = buffers[stream].take(len(plan.shards[source]))
        ring.shift({s: held[s] for s in incoming}, incoming)
        for task in plan.tasks(step, rank):
            _compute(q, held[task.stream], task, plan, rank, scale, acc, rec, ring.progress)
            rec.tasks.append((step, task))
        start = time.perf_counter()
        ring.wait(timeout)
        rec.events.append(("wait", start, time.perf_counter(), {"step": step}))
        held.update(incoming)
    return acc[0], acc[1]


def _allgather_loop(q, k, v, plan, comm, scale, rec, timeout):
    """All-gather K/V once (overlapped with the local block), then compute locally."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = [len(s) for s in plan.shards]
    gathered, requests = [], []
    for a in (k, v):
        per_token = int(np.prod(a.shape[:-2])) * a.shape[-1]
        counts = [n * per_token for n in lengths]
        flat = np.empty(sum(counts), a.dtype)
        requests.append(comm.Iallgatherv(np.ascontiguousarray(a), [flat, counts]))
        offsets = np.cumsum([0] + counts)
        gathered.append([flat[offsets[j]:offsets[j + 1]].reshape(a.shape[:-2] + (lengths[j], a.shape[-1]))
                         for j in range(size)])
        rec.bytes_sent += a.nbytes * (size - 1)  # as a ring all-gather moves it
        rec.messages += size - 1
    acc = [np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype), np.full(q.shape[:-1], -np.inf, q.dtype)]
    progress = lambda: MPI.Request.Testall(requests)  # noqa: E731
    for step in range(plan.n_steps):
        task = plan.tasks(step, rank)[0]
        if step == 1:
            start = time.perf_counter()
            MPI.Request.Waitall(requests) if timeout is None else _wait_until(requests, timeout, rank)
            rec.wait_time += time.perf_counter() - start
            rec.events.append(("wait", start, time.perf_counter(), {"step": 0}))
        kv = (k, v) if step == 0 else (gathered[0][task.source], gathered[1][task.source])
        _compute(q, kv, task, plan, rank, scale, acc, rec, progress)
        rec.tasks.append((step, task))
    if plan.n_steps == 1:
        MPI.Request.Waitall(requests)
    return acc[0], acc[1]


def _wait_until(requests, timeout, rank):
    from .comm import CommTimeout

    start = time.perf_counter()
    while not MPI.Request.Testall(requests):
        if time.perf_counter() - start > timeout:
            raise CommTimeout(f"rank {rank}: all-gather not complete after {timeout:g} s")
        time.sleep(1e-4)


def ring_attention(q, k, v, comm=None, *, causal=False, scale=None, layout="contiguous", mode="ring",
                   window=None, cu_seqlens=None, timeout=None, record=None):
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
        timeout: seconds a rank may wait for a transfer before raising ``CommTimeout``.
        record: a ``Record`` to fill with tasks, events and traffic counters.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens)
    plan, scale = _setup(q, k, v, comm, scale, options)
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    rec = Record(comm.Get_rank()) if record is None else record
    start = time.perf_counter()
    if plan.mode == "allgather":
        out, lse = _allgather_loop(q, k, v, plan, comm, scale, rec, timeout)
    else:
        ring = RingComm(comm)
        try:
            out, lse = _ring_loop(q, k, v, plan, ring, scale, rec, timeout)
        finally:
            ring.free()
        rec.bytes_sent, rec.messages, rec.wait_time = ring.bytes_sent, ring.messages, ring.wait_time
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return out, lse


# ---------------------------------------------------------------- scatter / gather on root


def _root_problem(Q, K, V):
    for name, a in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array on the root rank, got {type(a).__name__}"
    return None


def _scatter(x, meta, plan, comm, root):
    """Root deals out shards of a full array; every rank returns its own piece."""
    lead, dim, dtype = meta
    rank = comm.Get_rank()
    counts = [len(s) * int(np.prod(lead)) * dim for s in plan.shards]
    piece = np.empty(lead + (len(plan.shards[rank]), dim), dtype)
    send = None
    if rank == root:
        flat = np.concatenate([np.ascontiguousarray(shard(x, plan.size, r, plan.layout)).ravel()
                               for r in range(plan.size)])
        send = [flat, counts]
    comm.Scatterv(send, piece, root=root)
    return piece


def _gather(piece, plan, comm, root):
    """Inverse of _scatter: root gets the full array back in sequence order."""
    per_token = int(np.prod(piece.shape)) // piece.shape[-2] if piece.ndim >= 2 else 1
    counts = [len(s) * per_token for s in plan.shards]
    flat = np.empty(sum(counts), piece.dtype) if comm.Get_rank() == root else None
    comm.Gatherv(np.ascontiguousarray(piece), [flat, counts] if flat is not None else None, root=root)
    if flat is None:
        return None
    offsets = np.cumsum([0] + counts)
    pieces = [flat[offsets[r]:offsets[r + 1]].reshape(piece.shape[:-2] + (len(plan.shards[r]), piece.shape[-1]))
              for r in range(plan.size)]
    return unshard(pieces, plan.layout)


def distributed_attention(Q, K, V, comm=None, *, causal=False, root=0, scale=None, layout="contiguous",
                          mode="ring", window=None, cu_seqlens=None, timeout=None, return_lse=False):
    """Root scatters full Q, K, V, the ring runs, root gathers the output and the schedule.

    Returns ``(out, schedule)`` on root and ``(None, None)`` elsewhere;
    ``schedule.table[step][rank]`` holds the Tasks each rank recorded, and
    ``schedule.records[rank]`` its traffic and timing counters. With
    ``return_lse=True`` root gets ``(out, lse, schedule)``.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    problem = meta = None
    if rank == root:
        problem = _root_problem(Q, K, V) or _local_problem(Q, K, V, scale)
        if problem is None and Q.shape[-2] < comm.Get_size():
            problem = f"sequence length {Q.shape[-2]} is shorter than the number of ranks {comm.Get_size()}"
        if problem is None:
            meta = [(a.shape[:-2], a.shape[-1], a.dtype) for a in (Q, K, V)] + [Q.shape[-2]]
    problem, meta = comm.bcast((problem, meta), root=root)
    if problem:
        raise ValueError(f"root rank {root}: {problem}")
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens)
    plan = make_plan(meta[3], comm.Get_size(), **options)
    q, k, v = (_scatter(x, m, plan, comm, root) for x, m in zip((Q, K, V), meta[:3]))
    rec = Record(rank)
    out, lse = ring_attention(q, k, v, comm, scale=scale, timeout=timeout, record=rec, **options)
    full_out, full_lse = _gather(out, plan, comm, root), _gather(lse[..., None], plan, comm, root)
    columns = comm.gather((rec.table(plan.n_steps), _summary(rec)), root=root)
    if rank != root:
        return (None, None, None) if return_lse else (None, None)
    schedule = _recorded_schedule(columns, plan)
    return (full_out, full_lse[..., 0], schedule) if return_lse else (full_out, schedule)


def _summary(rec):
    keep = ("rank", "bytes_sent", "messages", "wait_time", "compute_time", "wall_time", "events",
            "computed_pairs", "visible_pairs")
    return {key: getattr(rec, key) for key in keep}


def _recorded_schedule(columns, plan):
    from .schedule import Schedule

    table = [[columns[r][0][step] for r in range(plan.size)] for step in range(plan.n_steps)]
    schedule = Schedule(table)
    schedule.records = [c[1] for c in columns]
    schedule.plan = plan
    return schedule
