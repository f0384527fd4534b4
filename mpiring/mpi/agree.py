"""Collective agreement: every rank ends a call's checks with the same verdict.

Each rank checks what it can alone (``mpiring.mpi.checks``), then one
all-gather shares every rank's problem and options; either every rank goes
on with the same plan, or every rank raises the same ValueError naming each
offending rank. Nothing here raises before that all-gather, so one rank's bad
input cannot leave the others waiting.
"""

import numpy as np
from mpi4py import MPI

from ..core.kernels import default_scale
from ..core.precision import without_precision
from ..plans.layouts import take_rows
from ..plans.make import make_plan
from .checks import (
    ROW_OPTIONS,
    Shown,
    agreement_timeout,
    canonical,
    compared,
    describe,
    differences,
    entry_timeout,
    is_real,
    local_problem,
    logit_problem,
    peaks,
    row_order,
    rows_problem,
    scale_problem,
    shape_text,
    size_problem,
    timeout_problem,
    values_digest,
    verdict,
    with_every_rank_positions,
)
from .collectives import allgather
from .waits import abandon, completed, wait_entry, wait_until

__all__ = ["agree", "gather_entry", "setup", "agree_root", "setup_ring", "check_call", "check_comm", "comm_problem"]


def comm_problem(comm):
    """Why ``comm`` cannot carry a ring, or None: checked on this rank alone, before any collective."""
    if not isinstance(comm, MPI.Comm):
        return f"comm must be an mpi4py communicator, got {type(comm).__name__}"
    if comm == MPI.COMM_NULL:
        return "comm is MPI.COMM_NULL"
    if comm.Is_inter():
        return "comm is an intercommunicator: the ring needs an intracommunicator (e.g. MPI.COMM_WORLD)"
    return None


def check_comm(comm):
    """``comm``, or COMM_WORLD for None; raises ValueError at once if it cannot carry a ring.

    Local: the other ranks cannot know, and give up when their timeout expires.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    problem = comm_problem(comm)
    if problem:
        raise ValueError(problem)
    return comm


def gather_entry(comm, obj, timeout):
    """The all-gather that opens a call: every rank's ``obj``, waiting for every rank to enter as ``timeout`` says.

    ``timeout`` is the caller's: "auto" waits without limit for the others to
    reach the call (``checks.entry_timeout``; ``waits.wait_entry`` logs the
    wait), a number that long; the rest of the all-gather, once every rank is
    in, is bounded (``checks.agreement_timeout``).
    """
    rank = comm.Get_rank()
    return allgather(comm, obj, agreement_timeout(timeout),
                     enter=lambda first: wait_entry(first, entry_timeout(timeout), rank, "agreement"))


def agree(comm, problem, timeout=None, entry=False):
    """Collective: raise the same ValueError on every rank if any rank has a problem (``entry``: it opens a call)."""
    message = verdict(gather_entry(comm, problem, timeout) if entry
                      else allgather(comm, problem, agreement_timeout(timeout)))
    if message:
        raise ValueError(message)


def setup(q, k, v, comm, scale, options, check_finite=False, expected_size=None, timeout=None, prepare=None,
          problem=None, rows=None, hosts=None, compare=None):
    """Validate on every rank, agree collectively (one all-gather), and build the shared plan.

    Every rank ends with the same verdict: either ``(plan, scale, prepared)``
    or the same ValueError, naming each offending rank and argument. Nothing
    here raises before the all-gather, so one rank's bad input cannot leave the
    others waiting. ``prepare()``, run once this rank's arguments are valid,
    does the work that may fail on one rank alone (contiguous copies,
    temporaries: a MemoryError) before the agreement, so such a failure is
    reported by every rank too; its result is returned as ``prepared``.
    ``problem``: one more of this rank's problems, found by the caller (or None).
    ``hosts``: a list to fill with every rank's processor name (who shares a node).
    ``rows``: one letter per prepared array, "q" (query rows), "k" (key/value
    rows) or "l" (query rows on the last axis: lse); they come back sorted by
    position, the order the ring works in (``Plan.in_caller_order`` undoes it;
    the plan's ``orders`` are these sorts, found from the same positions).

    ``compare``: more arguments by name that every rank must pass alike (e.g. ``rotate``).

    Positions given per rank (``positions``, ``kv_positions``) are all-gathered
    with the rest, so every rank checks that they partition the sequence.
    """
    values = n_local = peak = prepared = held = None
    try:
        size = comm.Get_size()
        problem = (comm_problem(comm) or timeout_problem(timeout) or problem
                   or local_problem(q, k, v, scale, check_finite, options.get("kv_positions") is None)
                   or size_problem(size, expected_size))
        if problem is None:
            options = canonical(options)
            problem = rows_problem(q, k, options)
        if problem is None and prepare is not None:
            prepared = prepare()
            if rows is not None:  # copies too: made here, where a MemoryError is reported by every rank
                prepared = [take_rows(a, row_order(options, kind), -1 if kind == "l" else -2)
                            for a, kind in zip(prepared, rows)]
        if problem is None:
            held = [options[name] for name in ROW_OPTIONS]
            values = {f"{n} shape": Shown(*[shape_text(a)] * 2) for n, a in (("q", q), ("k", k), ("v", v))}
            values.update({"dtype": Shown(str(q.dtype)),
                           "scale": Shown(scale), **compared(options, timeout)})
            values.update({name: Shown(val) for name, val in (compare or {}).items()})
            n_local = q.shape[-2]
            peak = peaks(q, k)
    except Exception as exc:  # whatever goes wrong here is reported collectively, never raised alone
        problem, values = describe(exc), None
    metas = gather_entry(comm, (problem, values, n_local, peak, held, MPI.Get_processor_name()), timeout)
    message = verdict([m[0] for m in metas]) or verdict(differences([m[1] for m in metas], 0))
    if message:
        raise ValueError(message)
    if hosts is not None:
        hosts[:] = [m[5] for m in metas]
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    message = logit_problem(scale, q.shape[-1], max(m[3][0] for m in metas), max(m[3][1] for m in metas), q.dtype)
    if message:
        raise ValueError(message)
    lengths = [m[2] for m in metas]
    seq_len = with_every_rank_positions(options, [m[4] for m in metas]) or sum(lengths)
    # deterministic, the same options: the same plan everywhere, or the same error everywhere
    plan = make_plan(seq_len, comm.Get_size(), **without_precision(options))
    expected = [len(s) for s in plan.shards]
    if lengths != expected:
        raise ValueError(f"local sequence lengths {lengths} do not match the {plan.layout} layout of "
                         f"{plan.seq_len} tokens over {plan.size} ranks, which needs {expected}")
    return plan, scale, prepared


def agree_root(comm, root, check_root, options, timeout=None, expected_size=None, scale=None):
    """Agreement for a call where ``root`` holds the full arrays: the same verdict on every rank.

    Every rank checks its options, root, scale and timeout and compares them
    with rank 0's; root also runs ``check_root() -> (problem, meta)`` on its
    arrays. Returns ``(canonical options, root's meta)`` or raises the same
    ValueError everywhere: option problems and disagreements first (the same
    text on every rank even if ranks disagree on root), then root's arrays.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = values = root_found = meta = None
    try:
        problem = timeout_problem(timeout) or size_problem(size, expected_size) or scale_problem(scale)
        if problem is None and not (is_real(root) and isinstance(root, (int, np.integer)) and 0 <= root < size):
            problem = f"root must be a rank of the communicator, 0 .. {size - 1}; got {root!r}"
        if problem is None:
            options = canonical(options)
            values = dict(compared(options, timeout), root=Shown(root), scale=Shown(scale))
            if rank == root:
                root_found, meta = check_root()
    except Exception as exc:  # reported collectively, never raised alone
        problem, values = describe(exc), None
    gathered = gather_entry(comm, (problem, values, root_found, meta), timeout)
    message = verdict([g[0] for g in gathered]) or verdict(differences([g[1] for g in gathered], 0))
    if not message and gathered[root][2]:
        message = f"root rank {root}: {gathered[root][2]}"
    if message:
        raise ValueError(message)
    return options, gathered[root][3]


def setup_ring(comm, seq_len, options, scale, timeout, expected_size=None, problem=None, values=None):
    """The agreement of a ``Ring`` handle: options, sequence length, scale and timeout, once for all its calls.

    As ``setup``, without arrays: every rank checks what it passed, one
    all-gather compares it with rank 0's (``values``: more named values that
    must match) and gathers every rank's positions, if given, and every rank
    builds the same plan or raises the same ValueError. ``seq_len`` may be
    None when positions imply it. Returns ``(plan, hosts, options)``: hosts
    are every rank's processor name, options the canonical ones.
    """
    shown = held = None
    try:
        problem = (comm_problem(comm) or timeout_problem(timeout) or scale_problem(scale)
                   or size_problem(comm.Get_size(), expected_size) or problem)
        if problem is None:
            options = canonical(options)
            if seq_len is None and options["positions"] is None:
                problem = "seq_len must be given (the number of tokens of the whole sequence), unless positions are"
            elif seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer))):
                problem = f"seq_len must be the number of tokens of the whole sequence (an int), got {seq_len!r}"
            held = [options[name] for name in ROW_OPTIONS]
            shown = dict(compared(options, timeout), seq_len=Shown(None if seq_len is None else int(seq_len)),
                         scale=Shown(scale), **{name: Shown(value) for name, value in (values or {}).items()})
    except Exception as exc:  # reported collectively, never raised alone
        problem, shown = describe(exc), None
    gathered = gather_entry(comm, (problem, shown, MPI.Get_processor_name(), held), timeout)
    message = verdict([g[0] for g in gathered]) or verdict(differences([g[1] for g in gathered], 0))
    if message:
        raise ValueError(message)
    implied = with_every_rank_positions(options, [g[3] for g in gathered])
    if seq_len is not None and implied is not None and implied != seq_len:  # the same data everywhere
        raise ValueError(f"seq_len={seq_len} but the ranks' positions hold {implied} tokens")
    plan = make_plan(implied or int(seq_len), comm.Get_size(), **without_precision(options))  # raises everywhere
    return plan, [g[2] for g in gathered], options


ENTRY_TAG = 7  # a Ring call's entry notices; the ring's own messages use tags 0-3 and, homeward, 4 per chunk and up


def check_call(comm, problem, values, peaks, timeout):
    """The per-call agreement of a ``Ring`` handle: one small all-reduce, the same verdict on every rank.

    Every rank contributes whether it found a ``problem``, a digest of
    ``values`` (``call_values``: every rank's must match) and ``peaks`` (its
    largest |q| and |k|). Only when something is wrong does a second round, an
    all-gather, collect the messages, so the ValueError names each rank as
    ``setup``'s does. Returns the largest peaks over all ranks. Every rank has
    arrived when it returns, as after a barrier.

    ``comm`` is the handle's private communicator, so each rank also sends an
    empty notice to every other one: while they have not all arrived, the wait
    (``waits.wait_entry``: without limit for "auto", logged) can say which
    ranks have not entered the call. Once all have, the all-reduce's wait is
    bounded (``checks.agreement_timeout``). If this rank gives up, its pending
    requests are abandoned (``waits.abandon``), never freed.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    digest = values_digest(values)
    mine = np.array([1.0 if problem else 0.0, digest, -digest, *peaks])
    every = np.empty_like(mine)
    peers = [r for r in range(size) if r != rank]
    notices = np.empty((size, 0), np.uint8)
    heard = [comm.Irecv(notices[r], source=r, tag=ENTRY_TAG) for r in peers]
    told = [comm.Isend(notices[rank], dest=r, tag=ENTRY_TAG) for r in peers]
    reduce = comm.Iallreduce(mine, every, op=MPI.MAX)
    try:
        wait_entry(heard, entry_timeout(timeout), rank, "agreement",
                   absent=lambda: [r for r, request in zip(peers, heard) if not completed([request])])
        wait_until([reduce, *told], agreement_timeout(timeout), rank, "agreement", sync=True)
    except BaseException:
        abandon((comm, [*heard, *told, reduce], notices, mine, every))  # MPI may still use them: kept for good
        raise
    if every[0] or every[1] != -every[2]:
        gathered = allgather(comm, (problem, values), agreement_timeout(timeout))
        raise ValueError(verdict([g[0] for g in gathered]) or verdict(differences([g[1] for g in gathered], 0))
                         or "the ranks passed arrays of different shapes or dtypes")
    return every[3:]
