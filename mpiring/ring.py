"""Ring attention over MPI: every rank keeps its queries, K/V blocks travel the ring.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal
"""

import hashlib
import pickle
import time

import numpy as np
from mpi4py import MPI

from .comm import KVBuffers, RingComm, payload_bytes, wait_until
from .kernels import attention_block, default_scale
from .layouts import check_layout, shard, unshard
from .masks import check_window
from .schedule import MODES, make_plan

__all__ = ["ring_attention", "distributed_attention", "Record"]


class Record:
    """What one rank did: the tasks it ran, timed events, and traffic counters."""

    def __init__(self, rank=0):
        self.rank = rank
        self.tasks = []  # (step, Task) in the order they were processed
        # (name, start, end, info) with time.perf_counter() stamps; name is "compute"
        # (info: step, source, kind, stream), "send" (posted: step, stream, bytes, dest) or
        # "wait" (step). Subtract t0, this rank's clock right after a start barrier, to put
        # every rank on one time base (good to the barrier's exit skew, microseconds).
        self.events = []
        self.t0 = 0.0
        self.on_step = None  # optional callback(steps_done, n_steps), called after each step
        self.bytes_sent = 0
        self.messages = 0
        self.wait_time = 0.0
        self.compute_time = 0.0
        self.computed_pairs = 0  # score entries given to the kernel
        self.visible_pairs = 0  # of those, the ones the mask lets through
        self.wall_time = 0.0

    def event(self, name, start, **info):
        """Record an event that started at ``start`` and ends now; returns now."""
        end = time.perf_counter()
        self.events.append((name, start, end, info))
        return end

    def table(self, n_steps):
        """This rank's column of the schedule: the tasks of each step."""
        column = [[] for _ in range(n_steps)]
        for step, task in self.tasks:
            column[step].append(task)
        return [tuple(c) for c in column]


# ---------------------------------------------------------------- validation


def _local_problem(q, k, v, scale, check_finite=False):
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
    if scale is not None and not (_is_real(scale) and np.isfinite(scale) and scale > 0):
        return f"scale must be a finite positive number, got {scale!r}"
    if check_finite:  # one pass over the inputs: off by default
        for name, a in (("q", q), ("k", k), ("v", v)):
            bad = ~np.isfinite(a)
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                return f"{name} has {int(bad.sum())} NaN/Inf values, the first at index {first}"
    return None


def _is_real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _timeout_problem(timeout):
    if timeout is not None and not (_is_real(timeout) and np.isfinite(timeout) and timeout > 0):
        return f"timeout must be None or a positive number of seconds, got {timeout!r}"
    return None


def _size_problem(size, expected_size):
    if expected_size is not None and size != expected_size:
        return f"the communicator has {size} ranks but expected_size={expected_size!r}"
    return None


def _canonical(options):
    """This rank's options in a form ranks can compare; raises ValueError on a bad one.

    Only checks that need no other rank are made here; make_plan checks the rest
    (cu_seqlens against the total length) once every rank holds the same options.
    """
    check_layout(options["layout"])
    if options["mode"] not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {options['mode']!r}")
    cu = options["cu_seqlens"]
    if cu is not None:
        cu = np.asarray(cu)
        if cu.ndim != 1 or not np.issubdtype(cu.dtype, np.integer):
            raise ValueError(f"cu_seqlens must be a 1-D integer array [0, ..., seq_len], got {cu!r}")
        cu = cu.astype(np.int64)
    return dict(layout=options["layout"], mode=options["mode"], causal=bool(options["causal"]),
                window=check_window(options["window"]), cu_seqlens=cu)


class _Shown:
    """A value compared by content (cu_seqlens by digest) and shown briefly in messages."""

    def __init__(self, value, text=None):
        if text is not None:
            self.text, self.key = text, value
        elif isinstance(value, np.ndarray):
            items = value.tolist()
            self.text = str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:4]))}, ..., {items[-1]}]" \
                f" ({len(items)} entries)"
            self.key = (len(items), hashlib.sha1(value.tobytes()).hexdigest())
        else:
            self.text, self.key = repr(value), value

    def __eq__(self, other):
        return self.key == other.key

    def __repr__(self):
        return self.text


def _shape_text(a):
    """A shape with the sequence axis, which may differ between ranks, shown as *."""
    return "(" + ", ".join("*" if i == a.ndim - 2 else str(n) for i, n in enumerate(a.shape)) + ")"


def _verdict(problems, prefix="rank"):
    """One message naming every rank with a problem; ranks with the same problem share a line."""
    by_text = {}
    for r, p in enumerate(problems):
        if p:
            by_text.setdefault(p, []).append(r)
    parts = [f"{prefix} {ranks[0]}: {p}" if len(ranks) == 1 else f"{prefix}s {', '.join(map(str, ranks))}: {p}"
             for p, ranks in by_text.items()]
    return "; ".join(parts) or None


def _differences(values, ref):
    """Per rank: which named value differs from rank ``ref``'s (values[r] is a dict, or None)."""
    out = [None] * len(values)
    for r, mine in enumerate(values):
        if mine is None or values[ref] is None or r == ref:
            continue
        for name, val in mine.items():
            if not val == values[ref][name]:
                out[r] = f"{name} {val!r} differs from rank {ref}'s {values[ref][name]!r}"
                break
    return out


def _describe(exc):
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def agree(comm, problem, timeout=None):
    """Collective: raise the same ValueError on every rank if any rank has a problem."""
    message = _verdict(_allgather(comm, problem, timeout))
    if message:
        raise ValueError(message)


def _allgather(comm, obj, timeout=None):
    """``comm.allgather(obj)`` that raises CommTimeout if some rank does not join in time.

    Always non-blocking collectives (they never match blocking ones), so ranks
    with and without a timeout still pair up.
    """
    timeout = None if _timeout_problem(timeout) else timeout
    start, rank = time.perf_counter(), comm.Get_rank()
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.empty(comm.Get_size(), np.int64)
    mine = np.array([data.size], np.int64)
    wait_until([comm.Iallgather(mine, sizes)], timeout, rank, "agreement", start)
    flat = np.empty(int(sizes.sum()), np.uint8)
    wait_until([comm.Iallgatherv(data, [flat, sizes])], timeout, rank, "agreement", start)
    offsets = np.cumsum(np.concatenate([[0], sizes]))
    return [pickle.loads(flat[offsets[r]:offsets[r + 1]].tobytes()) for r in range(len(sizes))]


def _compared(options, timeout):
    """The values every rank must pass identically, by argument name."""
    values = dict(options, timeout=timeout)
    return {name: _Shown(val) for name, val in values.items()}


def _setup(q, k, v, comm, scale, options, check_finite=False, expected_size=None, timeout=None):
    """Validate on every rank, agree collectively (one all-gather), and build the shared plan.

    Every rank ends with the same verdict: either the plan or the same ValueError,
    naming each offending rank and argument. Nothing here raises before the
    all-gather, so one rank's bad input cannot leave the others waiting.
    """
    problem = values = n_local = peaks = None
    try:
        size = comm.Get_size()
        problem = (_timeout_problem(timeout) or _local_problem(q, k, v, scale, check_finite)
                   or _size_problem(size, expected_size))
        if problem is None:
            options = _canonical(options)
            values = {f"{n} shape": _Shown(*[_shape_text(a)] * 2) for n, a in (("q", q), ("k", k), ("v", v))}
            values.update({"dtype": _Shown(str(q.dtype)),
                           "scale": _Shown(scale), **_compared(options, timeout)})
            n_local = q.shape[-2]
            peaks = (_peak(q), _peak(k))
    except Exception as exc:  # whatever goes wrong here is reported collectively, never raised alone
        problem, values = _describe(exc), None
    metas = _allgather(comm, (problem, values, n_local, peaks), timeout)
    message = _verdict([m[0] for m in metas]) or _verdict(_differences([m[1] for m in metas], 0))
    if message:
        raise ValueError(message)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    message = logit_problem(scale, q.shape[-1], max(m[3][0] for m in metas), max(m[3][1] for m in metas), q.dtype)
    if message:
        raise ValueError(message)
    lengths = [m[2] for m in metas]
    plan = make_plan(sum(lengths), comm.Get_size(), **options)  # deterministic, same options: raises everywhere
    expected = [len(s) for s in plan.shards]
    if lengths != expected:
        raise ValueError(f"local sequence lengths {lengths} do not match the {plan.layout} layout of "
                         f"{plan.seq_len} tokens over {plan.size} ranks, which needs {expected}")
    return plan, scale


def _peak(a):
    """Largest |entry| of a, as a float (two passes, no temporary)."""
    return float(max(a.max(), -a.min())) if a.size else 0.0


def logit_problem(scale, dim, q_peak, k_peak, dtype):
    """Why scale * q.k may overflow ``dtype`` (|q.k| <= dim * max|q| * max|k|), or None.

    Any logits below that bound give a finite lse; beyond it no float arithmetic can.
    """
    limit = float(np.finfo(dtype).max) / 16
    if not (np.isfinite(q_peak) and np.isfinite(k_peak)):
        return None  # NaN or Inf inputs are not a scale problem: they propagate as in IEEE arithmetic
    with np.errstate(over="ignore"):
        bound = float(scale) * dim * q_peak * k_peak
    if not bound <= limit:
        return (f"the logits may overflow {np.dtype(dtype)}: scale * dim * max|q| * max|k| = {bound:.3g} "
                f"(scale {scale:.3g}, dim {dim}, max|q| {q_peak:.3g}, max|k| {k_peak:.3g}) exceeds {limit:.3g}; "
                f"rescale q, k or the softmax scale")
    return None


# ---------------------------------------------------------------- the ring


def _compute(q, kv, task, plan, rank, scale, acc, rec, progress, step=None, padded=False):
    """Attend this rank's queries to one K/V block and merge into ``acc``.

    The kernel merges every finished query tile into the running (out, lse)
    with ``merge_`` (the log-sum-exp rule), so no block-sized output is made.
    ``padded``: k and v are the ring's [k | 1]^T, [v | 1]^T blocks (``KVBuffers``).
    """
    if task.kind != "skip":
        start = time.perf_counter()
        k, v = kv
        for a, b, c, d, klo, khi in plan.pieces(rank, task.source):
            rec.computed_pairs += (b - a) * (d - c)
            rec.visible_pairs += (b - a) * (d - c) if klo is None else int(np.sum(khi - klo))
            keys = np.s_[..., c:d] if padded else np.s_[..., c:d, :]  # padded: tokens on the last axis
            attention_block(q[..., a:b, :], k[keys], v[keys], scale, klo, khi, padded=padded,
                            into=(acc[0][..., a:b, :], acc[1][..., a:b]), progress=progress)
        end = rec.event("compute", start, step=step, source=task.source, kind=task.kind, stream=task.stream)
        rec.compute_time += end - start
    rec.tasks.append((step, task))


def _accumulators(q, v):
    """Running (out, lse) in float64 whatever the input dtype, as flash-attn keeps fp32 for fp16:
    with fp32 ones the merge's rounding made the error grow with P (docs/reliability.md)."""
    return [np.zeros(q.shape[:-1] + v.shape[-1:], np.float64), np.full(q.shape[:-1], -np.inf, np.float64)]


def _receive_buffers(plan, rank, step, buffers):
    """Per stream, a buffer for the block it brings next step, where some rank still needs it."""
    incoming = {}
    for stream, rounds in plan.rounds.items():
        if step < rounds:
            source = plan.held_source(rank, stream, step + 1)
            incoming[stream] = buffers[stream].take(len(plan.shards[source]))
    return incoming


def _shift(ring, sends, recvs, rec, step, data="K/V", pad=0):
    """Start the next transfers and note one "send" event per stream."""
    posted = time.perf_counter()
    ring.shift(sends, recvs, pad)
    for stream, arrays in sends.items():
        rec.event("send", posted, step=step, stream=stream, data=data, dest=ring.send_rank[stream],
                  bytes=sum(payload_bytes(a, pad) for a in arrays))


def _ring_loop(q, k, v, plan, ring, scale, rec, timeout):
    """The ring: start passing the held blocks on, compute on them, wait, swap."""
    rank = ring.rank
    acc = _accumulators(q, v)
    longest = max(len(s) for s in plan.shards)
    # K/V blocks are kept as the kernel takes them, [k | 1]^T and [v | 1]^T, in two slots per stream;
    # the first slot of the first stream starts with this rank's own block.
    buffers = {stream: KVBuffers((k, v), longest) for stream in plan.rounds or [+1]}
    own = next(iter(buffers.values())).hold((k, v))
    held = {stream: own for stream in buffers}  # the block each stream holds now
    for step in range(plan.n_steps):
        incoming = _receive_buffers(plan, rank, step, buffers)
        _shift(ring, {s: held[s] for s in incoming}, incoming, rec, step, pad=1)  # Isend/Irecv, non-blocking
        for task in plan.tasks(step, rank):  # one block (two when bidirectional)
            _compute(q, held[task.stream], task, plan, rank, scale, acc, rec, ring.progress, step, padded=True)
        start = time.perf_counter()
        ring.wait(timeout)
        rec.event("wait", start, step=step)
        held.update(incoming)  # the blocks that arrived are the ones to use next step
        if rec.on_step is not None:
            rec.on_step(step + 1, plan.n_steps)
    return acc[0].astype(q.dtype, copy=False), acc[1].astype(q.dtype, copy=False)


def _flat_blocks(template, lengths, dtype, empty=False):
    """One flat buffer holding a block per rank (``lengths[j]`` tokens shaped like ``template``), and its views.

    Returns ``(flat, counts, views)``: counts are elements per rank, as MPI's
    v-collectives take them. Zeros unless ``empty``.
    """
    per_token = int(np.prod(template.shape[:-2])) * template.shape[-1]
    counts = [n * per_token for n in lengths]
    flat = (np.empty if empty else np.zeros)(sum(counts), dtype)
    offsets = np.cumsum([0] + counts)
    views = [flat[offsets[j]:offsets[j + 1]].reshape(template.shape[:-2] + (n, template.shape[-1]))
             for j, n in enumerate(lengths)]
    return flat, counts, views


def _start_allgather(k, v, plan, comm, rec):
    """Post the all-gather of every rank's K and V; returns (per-rank K views, per-rank V views) and the requests.

    Bytes and messages are counted as a ring all-gather moves them.
    """
    size = comm.Get_size()
    lengths = [len(s) for s in plan.shards]
    gathered, requests = [], []
    for a in (k, v):
        flat, counts, views = _flat_blocks(a, lengths, a.dtype, empty=True)
        requests.append(comm.Iallgatherv(a, [flat, counts]))
        gathered.append(views)
        rec.bytes_sent += a.nbytes * (size - 1)
        rec.messages += size - 1
    return gathered, requests


def _wait_allgather(requests, timeout, rank, rec):
    """Complete the all-gather (with the timeout) and note the time blocked as step 0's wait."""
    start = time.perf_counter()
    wait_until(requests, timeout, rank, "all-gather")
    end = time.perf_counter()
    rec.wait_time += end - start
    rec.events.append(("wait", start, end, {"step": 0}))


def _allgather_loop(q, k, v, plan, comm, scale, rec, timeout):
    """All-gather K/V once (overlapped with the local block), then compute locally."""
    rank, size = comm.Get_rank(), comm.Get_size()
    posted = time.perf_counter()
    gathered, requests = _start_allgather(k, v, plan, comm, rec)
    rec.event("send", posted, step=0, stream=0, dest="all", bytes=(k.nbytes + v.nbytes) * (size - 1))
    acc = _accumulators(q, v)
    progress = lambda: MPI.Request.Testall(requests)  # noqa: E731
    for step in range(plan.n_steps):
        task = plan.tasks(step, rank)[0]
        if step == 1:
            _wait_allgather(requests, timeout, rank, rec)
        kv = (k, v) if step == 0 else (gathered[0][task.source], gathered[1][task.source])
        _compute(q, kv, task, plan, rank, scale, acc, rec, progress, step)
        if rec.on_step is not None:
            rec.on_step(step + 1, plan.n_steps)
    if plan.n_steps == 1:
        wait_until(requests, timeout, rank, "all-gather")
    return acc[0].astype(q.dtype, copy=False), acc[1].astype(q.dtype, copy=False)


def _agree_outcome(ring, timeout):
    """With a timeout, after the ring: did every rank finish it?

    A rank that failed re-raises its own error at once and never joins this
    barrier, so the ranks that finished time out here (CommTimeout) instead of
    returning as if all went well.
    """
    wait_until([ring.comm.Ibarrier()], timeout, ring.rank, "end-of-ring check")


def ring_attention(q, k, v, comm=None, *, causal=False, scale=None, layout="contiguous", mode="ring",
                   window=None, cu_seqlens=None, timeout=None, record=None, check_finite=False,
                   expected_size=None):
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
        timeout: seconds a rank may wait for the others (validation, each transfer,
            a final check) before raising ``CommTimeout``. With a timeout, an error
            or stall on one rank raises on every rank still alive: the failed rank
            its own error at once, the others CommTimeout within 2 x timeout.
            Must be the same on every rank and exceed the longest compute step.
        record: a ``Record`` to fill with tasks, events and traffic counters.
        check_finite: also reject NaN/Inf in q, k, v (one extra pass over them).
        expected_size: raise unless the communicator has this many ranks.

    Bad arguments on any rank raise the same ``ValueError`` on every rank,
    before any transfer (see docs/reliability.md).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens)
    plan, scale = _setup(q, k, v, comm, scale, options, check_finite, expected_size, timeout)
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    rec = Record(comm.Get_rank()) if record is None else record
    ring = RingComm(comm)  # a private duplicate: the caller's messages never mix with the ring's
    try:
        # a common start: event times minus rec.t0 compare across ranks
        wait_until([ring.comm.Ibarrier()], timeout, ring.rank, "start barrier")
        rec.t0 = start = time.perf_counter()
        if plan.mode == "allgather":
            out, lse = _allgather_loop(q, k, v, plan, ring.comm, scale, rec, timeout)
        else:
            out, lse = _ring_loop(q, k, v, plan, ring, scale, rec, timeout)
            rec.bytes_sent, rec.messages, rec.wait_time = ring.bytes_sent, ring.messages, ring.wait_time
        if timeout is not None:
            _agree_outcome(ring, timeout)
    finally:
        ring.free()
    rec.wall_time = time.perf_counter() - start
    rec.plan = plan
    return out, lse


# ---------------------------------------------------------------- scatter / gather on root


def _root_problem(Q, K, V):
    for name, a in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array on the root rank, got {type(a).__name__}"
    return None


def _scatter(x, meta, plan, comm, root, timeout=None):
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
    wait_until([comm.Iscatterv(send, piece, root=root)], timeout, rank, "scatter")
    return piece


def _gather(piece, plan, comm, root, timeout=None):
    """Inverse of _scatter: root gets the full array back in sequence order."""
    per_token = int(np.prod(piece.shape)) // piece.shape[-2] if piece.ndim >= 2 else 1
    counts = [len(s) * per_token for s in plan.shards]
    flat = np.empty(sum(counts), piece.dtype) if comm.Get_rank() == root else None
    piece = np.ascontiguousarray(piece)
    wait_until([comm.Igatherv(piece, [flat, counts] if flat is not None else None, root=root)], timeout,
                comm.Get_rank(), "gather")
    if flat is None:
        return None
    offsets = np.cumsum([0] + counts)
    pieces = [flat[offsets[r]:offsets[r + 1]].reshape(piece.shape[:-2] + (len(plan.shards[r]), piece.shape[-1]))
              for r in range(plan.size)]
    return unshard(pieces, plan.layout)


def distributed_attention(Q, K, V, comm=None, *, causal=False, root=0, scale=None, layout="contiguous",
                          mode="ring", window=None, cu_seqlens=None, timeout=None, return_lse=False,
                          on_step=None, check_finite=False, expected_size=None):
    """Root scatters full Q, K, V, the ring runs, root gathers the output and the schedule.

    Returns ``(out, schedule)`` on root and ``(None, None)`` elsewhere;
    ``schedule.table[step][rank]`` holds the Tasks each rank recorded, and
    ``schedule.records[rank]`` its traffic and timing counters. With
    ``return_lse=True`` root gets ``(out, lse, schedule)``. ``on_step(done, n_steps)``
    is called on this rank after each of its ring steps (e.g. for a progress line).
    ``timeout``, ``check_finite`` (on root's full arrays) and ``expected_size``
    are as in ``ring_attention``; options must be the same on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu_seqlens)
    arrays = problem = meta = values = None
    try:  # root checks the arrays, every rank its options; one all-gather gives all the same verdict
        if rank == root:
            arrays = _root_problem(Q, K, V) or _local_problem(Q, K, V, scale, check_finite)
            if arrays is None and Q.shape[-2] < size:
                arrays = f"sequence length {Q.shape[-2]} is shorter than the number of ranks {size}"
            if arrays is None:
                meta = [(a.shape[:-2], a.shape[-1], a.dtype) for a in (Q, K, V)] + [Q.shape[-2]]
        problem = _timeout_problem(timeout) or _size_problem(size, expected_size)
        if problem is None and not (_is_real(root) and isinstance(root, (int, np.integer)) and 0 <= root < size):
            problem = f"root must be a rank of the communicator, 0 .. {size - 1}; got {root!r}"
        if problem is None:
            options = _canonical(options)
            values = dict(_compared(options, timeout), root=_Shown(root))
    except Exception as exc:
        problem, values = _describe(exc), None
    gathered = _allgather(comm, (arrays, problem, meta, values), timeout)
    # options first, compared with rank 0: the same text everywhere even if ranks disagree on root
    message = _verdict([p for _, p, _, _ in gathered]) or _verdict(_differences([v for _, _, _, v in gathered], 0))
    if not message and gathered[root][0]:
        message = f"root rank {root}: {gathered[root][0]}"
    if message:
        raise ValueError(message)
    meta = gathered[root][2]
    plan = make_plan(meta[3], size, **options)  # deterministic, same options everywhere: raises everywhere
    q, k, v = (_scatter(x, m, plan, comm, root, timeout) for x, m in zip((Q, K, V), meta[:3]))
    rec = Record(rank)
    rec.on_step = on_step
    out, lse = ring_attention(q, k, v, comm, scale=scale, timeout=timeout, record=rec,
                              expected_size=expected_size, **options)
    full_out, full_lse = (_gather(a, plan, comm, root, timeout) for a in (out, lse[..., None]))
    columns = comm.gather((rec.table(plan.n_steps), _summary(rec)), root=root)
    if rank != root:
        return (None, None, None) if return_lse else (None, None)
    schedule = _recorded_schedule(columns, plan)
    return (full_out, full_lse[..., 0], schedule) if return_lse else (full_out, schedule)


def _summary(rec):
    keep = ("rank", "bytes_sent", "messages", "wait_time", "compute_time", "wall_time", "events", "t0",
            "computed_pairs", "visible_pairs")
    return {key: getattr(rec, key) for key in keep}


def _recorded_schedule(columns, plan):
    from .schedule import Schedule

    table = [[columns[r][0][step] for r in range(plan.size)] for step in range(plan.n_steps)]
    schedule = Schedule(table)
    schedule.records = [c[1] for c in columns]
    schedule.plan = plan
    return schedule
