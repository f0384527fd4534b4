"""Root holds the full arrays: it scatters shards, the ring runs, root gathers results and schedules.

    mpiexec -n 4 python -m mpiring run --causal --layout zigzag

One agreement (``agree.agree_root``) checks root's arrays and every rank's
spec; the forward and the backward call then run that spec.
"""

import numpy as np

from .core.buffers import mpi_view
from .core.record import Record
from .handle import ring_attention, ring_attention_backward
from .mpi.agree import agree, agree_root, check_comm
from .mpi.collectives import gather
from .mpi.waits import CommTimeout, wait_until
from .plans.call_options import split
from .plans.checks import describe, local_problem, resolve_timeout, root_grad_problem, root_problem
from .plans.layouts import shard, unshard
from .plans.plan import Schedule
from .plans.spec import Spec, spec_problem

__all__ = ["distributed_attention", "distributed_attention_backward"]


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
        send = [mpi_view(flat), counts]
    wait_until([comm.Iscatterv(send, mpi_view(piece), root=root)], timeout, rank, "scatter")
    return piece


def _gather(piece, plan, comm, root, timeout=None):
    """Inverse of _scatter: root gets the full array back in sequence order."""
    per_token = int(np.prod(piece.shape)) // piece.shape[-2] if piece.ndim >= 2 else 1
    counts = [len(s) * per_token for s in plan.shards]
    flat = np.empty(sum(counts), piece.dtype) if comm.Get_rank() == root else None
    piece = np.ascontiguousarray(piece)
    wait_until([comm.Igatherv(mpi_view(piece), [mpi_view(flat), counts] if flat is not None else None, root=root)],
               timeout,
                comm.Get_rank(), "gather")
    if flat is None:
        return None
    offsets = np.cumsum([0] + counts)
    pieces = [flat[offsets[r]:offsets[r + 1]].reshape(piece.shape[:-2] + (len(plan.shards[r]), piece.shape[-1]))
              for r in range(plan.size)]
    return unshard(pieces, plan.layout)


def _spec(options, spec, causal, layout, who):
    """``(spec, problem, run options)`` of a root call: its options through ``Spec.of``; root deals the tokens
    out by layout, so positions are refused by name."""
    keywords, run = split(options)
    spec, problem = spec_problem(dict(keywords, causal=causal, layout=layout), spec)
    if problem is None and (spec.positions is not None or spec.kv_positions is not None):
        problem = f"{who} deals the tokens out by layout: positions are ring_attention's (each rank's own rows)"
    if problem is None and spec.kv_seq_len is not None:
        problem = (f"{who} deals one sequence out by layout: cross-attention (kv_seq_len) is ring_attention's "
                   f"(each rank's own rows of each sequence)")
    if problem is None and "seq_axis" in run:
        problem = f"{who} takes root's arrays as (..., S, D): it has no seq_axis"
    return spec, problem, run


def _recorded_schedule(columns, plan):
    """The schedule the ranks recorded, with their counters (``records``) and the ``plan``."""
    table = [[columns[r][0][step] for r in range(plan.size)] for step in range(plan.n_steps)]
    return Schedule(table, records=[c[1] for c in columns], plan=plan)


def distributed_attention(
    Q: np.ndarray | None, K: np.ndarray | None, V: np.ndarray | None,  # on root: (..., Hq, S, D), (..., Hk, S, D/Dv)
    comm=None, *, spec: Spec | None = None, root: int = 0, causal: bool = False, layout: str = "contiguous",
    timeout: float | str | None = "auto", return_lse: bool = False, on_step=None, **options,
) -> tuple:  # on root (out (..., Hq, S, Dv)[, lse], schedule); Nones elsewhere
    """Root scatters full Q, K, V, the ring runs, root gathers the output and the schedule.

    Returns ``(out, schedule)`` on root and ``(None, None)`` elsewhere;
    ``schedule.table[step][rank]`` holds the Tasks each rank recorded, and
    ``schedule.records[rank]`` its traffic and timing counters. With
    ``return_lse=True`` root gets ``(out, lse, schedule)``. ``on_step(done, n_steps)``
    is called on this rank after each of its ring steps (e.g. for a progress line).
    ``options``: those of ``ring_attention`` (``check_finite`` checks root's full arrays); each rank
    gets the tokens ``shard_indices`` gives it under ``layout``, in every mode;
    options must be the same on every rank.
    """
    comm = check_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()

    def check_root():
        problem = root_problem(Q, K, V) or local_problem(Q, K, V, None, check_finite)
        if problem is None and Q.shape[-2] < size:
            problem = f"sequence length {Q.shape[-2]} is shorter than the number of ranks {size}"
        meta = None if problem else [(a.shape[:-2], a.shape[-1], a.dtype) for a in (Q, K, V)] + [Q.shape[-2]]
        return problem, meta

    spec, problem, run = _spec(options, spec, causal, layout, "distributed_attention")
    check_finite, expected_size = run.get("check_finite", False), run.get("expected_size")
    if problem is None and spec.return_max_logit:
        problem = "distributed_attention returns no max logit: call ring_attention(..., return_max_logit=True)"
    meta = agree_root(comm, root, check_root, spec, timeout, expected_size, problem)
    plan = spec.plan(size, meta[3])  # the same everywhere, or raises everywhere
    wait = resolve_timeout(timeout, plan, int(np.prod(meta[0][0])), meta[0][1])  # for scatter and gather
    q, k, v = (_scatter(x, m, plan, comm, root, wait) for x, m in zip((Q, K, V), meta[:3]))
    rec = Record(rank, on_step=on_step)
    out, lse = ring_attention(q, k, v, comm, spec=spec, timeout=timeout, record=rec, expected_size=expected_size,
                              threads=run.get("threads", "auto"))
    pieces = [out, lse[..., None]]
    full_out, full_lse, schedule = _collect(comm, root, plan, pieces, rec, {}, wait)
    if rank != root:
        return (None, None, None) if return_lse else (None, None)
    return (full_out, full_lse[..., 0], schedule) if return_lse else (full_out, schedule)


def _collect(comm, root, plan, pieces, rec, extra, timeout):
    """Root gathers ``pieces`` (full arrays back in sequence order) and every rank's record.

    Ends with one agreement, so a failure while root assembles the results
    (a MemoryError, say) raises on every rank, not on root alone. Returns the
    full arrays and the recorded schedule on root, Nones elsewhere.
    """
    full, problem = [None] * len(pieces), None
    try:
        full = [_gather(a, plan, comm, root, timeout) for a in pieces]
        columns = gather(comm, (rec.table(plan.n_steps), dict(rec.summary(), **extra)), root, timeout)
        schedule = _recorded_schedule(columns, plan) if comm.Get_rank() == root else None
    except CommTimeout:
        raise
    except Exception as exc:  # reported to every rank by the agreement below
        problem = describe(exc)
    agree(comm, problem, timeout)
    return (*full, schedule)


def distributed_attention_backward(
    Q: np.ndarray | None, K: np.ndarray | None, V: np.ndarray | None,  # on root, as distributed_attention
    dOut: np.ndarray | None,  # on root: (..., Hq, S, Dv)
    comm=None, *, spec: Spec | None = None, root: int = 0, causal: bool = False, layout: str = "contiguous",
    timeout: float | str | None = "auto", return_out: bool = False, **options,
) -> tuple:  # on root ([out,] dQ, dK, dV, schedule); Nones elsewhere
    """Root scatters Q, K, V and dOut; the ring runs forward then backward; root gathers the gradients.

    Returns ``(dQ, dK, dV, schedule)`` on root and Nones elsewhere (a spec with sinks:
    ``(dQ, dK, dV, dsinks, schedule)``).
    ``schedule.table[step][rank]`` holds the Tasks each rank recorded in the
    backward pass, ``schedule.records[rank]`` its counters (bytes, messages,
    times), with the forward pass's under ``"forward"``. With
    ``return_out=True`` root gets ``(out, dQ, dK, dV, schedule)``. ``options``: those of
    ``ring_attention_backward`` (``check_finite`` checks root's full Q, K, V).
    """
    comm = check_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()

    def check_root():
        problem = root_grad_problem(Q, K, V, dOut, None, size, run.get("check_finite", False))
        meta = None if problem else [(a.shape[:-2], a.shape[-1], a.dtype) for a in (Q, K, V, dOut)] + [Q.shape[-2]]
        return problem, meta

    spec, problem, run = _spec(options, spec, causal, layout, "distributed_attention_backward")
    meta = agree_root(comm, root, check_root, spec, timeout, run.get("expected_size"), problem)
    plan = spec.plan(size, meta[4])  # the same everywhere, or raises everywhere
    wait = resolve_timeout(timeout, plan, int(np.prod(meta[0][0])), meta[0][1], factor=3.5)
    q, k, v, dout = (_scatter(x, m, plan, comm, root, wait) for x, m in zip((Q, K, V, dOut), meta[:4]))
    forward, backward = Record(rank), Record(rank)
    threads = run.get("threads", "auto")
    out, lse = ring_attention(q, k, v, comm, spec=spec, timeout=timeout, record=forward, threads=threads)
    dq, dk, dv, *dsinks = ring_attention_backward(dout, q, k, v, out, lse, comm, spec=spec, timeout=timeout,
                                                  record=backward, threads=threads)
    pieces = ([out] if return_out else []) + [dq, dk, dv]
    *full, schedule = _collect(comm, root, plan, pieces, backward, {"forward": forward.summary()}, wait)
    if rank != root:
        return (None,) * (len(full) + len(dsinks) + 1)
    return (*full, *dsinks, schedule)  # with sinks: their gradient (the same on every rank) before the schedule
