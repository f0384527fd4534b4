"""Collective agreement: every rank ends a call's checks with the same verdict.

Each rank checks what it can alone (``mpiring.plans.checks``), then one
all-gather (``agreed``, the one agreement every entry point uses) shares
every rank's problem and the values it must pass alike; either every rank
goes on with the same spec and plan, or every rank raises the same
ValueError naming each offending rank. Nothing here raises before that
all-gather, so one rank's bad input cannot leave the others waiting.
"""

import secrets

import numpy as np
from mpi4py import MPI

from ..core.kernels import default_scale
from ..core.precision import compute_dtype
from ..plans.checks import (
    Shown,
    agreement_timeout,
    compared,
    describe,
    differences,
    differing_parts,
    entry_timeout,
    is_real,
    local_problem,
    logit_problem,
    part_values,
    peaks,
    shape_text,
    size_problem,
    timeout_problem,
    values_digest,
    verdict,
)
from ..plans.layouts import take_rows
from .collectives import allgather
from .rollcall import RollCall
from .waits import abandon, wait_entry

__all__ = ["agreed", "agree", "gather_entry", "setup", "agree_root", "setup_ring", "check_call", "check_comm",
           "comm_problem", "contiguous", "Hosts"]


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


def agreed(comm, problem, values=None, timeout=None, extra=None, entry=False):
    """The agreement: raise the same ValueError on every rank, or return every rank's ``extra``. Collective.

    ``problem``: what this rank found wrong, or None; ``values``: a dict of
    what every rank must pass alike (``Shown`` or plain values), compared with
    rank 0's; ``extra``: anything else to gather (lengths, positions, host
    names); ``entry``: this all-gather opens a call (``gather_entry``: under
    "auto" it waits for every rank without limit). The message names each rank
    with a problem (ranks with the same one share a line), else each rank
    whose values differ from rank 0's.
    """
    gathered = (gather_entry(comm, (problem, values, extra), timeout) if entry
                else allgather(comm, (problem, values, extra), agreement_timeout(timeout)))
    message = verdict([g[0] for g in gathered]) or _differences(comm, values, [g[1] for g in gathered], timeout)
    if message:
        raise ValueError(message)
    return [g[2] for g in gathered]


def _differences(comm, mine, every, timeout):
    """The message naming each rank whose values differ from rank 0's, or None.

    Values with content (functions, arrays) that differ under the same text are named down to the part
    that differs: a second all-gather (only then, on every rank alike) brings that part from both ranks.
    """
    wanted = differing_parts(every, 0)
    parts = {}
    if wanted:
        sent = allgather(comm, part_values(mine, wanted, comm.Get_rank(), 0), agreement_timeout(timeout))
        parts = {(r, name): (sent[r][(r, name)], sent[0][(r, name)]) for r, name, _ in wanted}
    return verdict(differences(every, 0, parts))


def agree(comm, problem, timeout=None, entry=False):
    """Collective: raise the same ValueError on every rank if any rank has a problem (``entry``: it opens a call)."""
    agreed(comm, problem, None, timeout, entry=entry)


def setup(q, k, v, comm, spec, timeout=None, prepare=None, rows=None):
    """Validate on every rank, agree collectively (one all-gather), and build the shared plan: MLA's agreement
    (``parallel.latent``), whose k, v are expanded from the latent.

    Every rank ends with the same verdict: either ``(plan, spec, scale,
    prepared, hosts)`` (the spec agreed: every rank's positions in it; ``hosts``:
    every rank's processor name, who shares a node) or the same
    ValueError, naming each offending rank and argument. Nothing here raises
    before the all-gather, so one rank's bad input cannot leave the others
    waiting. ``spec``: this rank's ``Spec``. ``prepare()``, run once this rank's arguments are
    valid, does the work that may fail on one rank alone (contiguous copies,
    temporaries: a MemoryError) before the agreement, so such a failure is
    reported by every rank too; its result is returned as ``prepared``.
    ``rows``: one letter per prepared array, "q" (query rows), "k" (key/value
    rows) or "l" (query rows on the last axis: lse); they come back sorted by
    position, the order the ring works in (``Plan.in_caller_order`` undoes it).
    Positions given per rank (``positions``, ``kv_positions``) are all-gathered
    with the rest, so every rank checks that they partition the sequence.
    """
    values = n_local = peak = prepared = held = None
    try:
        problem = (comm_problem(comm) or timeout_problem(timeout)
                   or local_problem(q, k, v, None, False, spec.same_rows) or spec.rows_problem(q, k))
        if problem is None and prepare is not None:
            prepared = prepare()
            if rows is not None:  # copies too: made here, where a MemoryError is reported by every rank
                prepared = [take_rows(a, spec.row_order(kind), -1 if kind == "l" else -2)
                            for a, kind in zip(prepared, rows)]
        if problem is None:
            held = spec.held()
            values = {f"{n} shape": Shown(*[shape_text(a)] * 2) for n, a in (("q", q), ("k", k), ("v", v))}
            values.update({"dtype": Shown(str(q.dtype)), **compared(spec, timeout)})
            n_local = q.shape[-2]
            peak = peaks(q, k)
    except Exception as exc:  # whatever goes wrong here is reported collectively, never raised alone
        problem, values = describe(exc), None
    metas = agreed(comm, problem, values, timeout, (n_local, peak, held, Host.mine()), entry=True)
    hosts = Hosts(m[3] for m in metas)
    scale = default_scale(q.shape[-1]) if spec.scale is None else spec.scale
    message = logit_problem(scale, q.shape[-1], max(m[1][0] for m in metas), max(m[1][1] for m in metas), q.dtype)
    if message:
        raise ValueError(message)
    lengths = [m[0] for m in metas]
    spec, implied = spec.with_ranks([m[2] for m in metas])
    # deterministic, the same spec: the same plan everywhere, or the same error everywhere
    plan = spec.plan(comm.Get_size(), implied or sum(lengths))
    expected = [len(s) for s in plan.shards]
    if lengths != expected:
        raise ValueError(f"local sequence lengths {lengths} do not match the {plan.layout} layout of "
                         f"{plan.seq_len} tokens over {plan.size} ranks, which needs {expected}")
    return plan, spec, scale, prepared, hosts


def agree_root(comm, root, check_root, spec, timeout=None, expected_size=None, problem=None):
    """Agreement for a call where ``root`` holds the full arrays: the same verdict on every rank.

    Every rank checks its spec (None with ``problem`` saying why), root and
    timeout and compares them with rank 0's; root also runs ``check_root() ->
    (problem, meta)`` on its arrays. Returns root's meta or raises the same
    ValueError everywhere: option problems and disagreements first (the same
    text on every rank even if ranks disagree on root), then root's arrays.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    values = root_found = meta = None
    try:
        problem = problem or timeout_problem(timeout) or size_problem(size, expected_size)
        if problem is None and not (is_real(root) and isinstance(root, (int, np.integer)) and 0 <= root < size):
            problem = f"root must be a rank of the communicator, 0 .. {size - 1}; got {root!r}"
        if problem is None:
            values = dict(compared(spec, timeout), root=Shown(root))
            if rank == root:
                root_found, meta = check_root()
    except Exception as exc:  # reported collectively, never raised alone
        problem, values = describe(exc), None
    gathered = agreed(comm, problem, values, timeout, (root_found, meta), entry=True)
    if gathered[root][0]:
        raise ValueError(f"root rank {root}: {gathered[root][0]}")
    return gathered[root][1]


def setup_ring(comm, spec, timeout, expected_size=None, problem=None, values=None, length=None):
    """The agreement of a ``Ring`` handle: its spec and timeout, once for all its calls.

    Every rank checks what it passed (``spec`` is None when ``problem`` says
    why), one all-gather compares it with rank 0's (``values``: more named
    values that must match) and gathers every rank's positions, if given, and
    every rank builds the same plan or raises the same ValueError. The spec's
    ``seq_len`` may be None when positions imply it, or when every rank gives
    the ``length`` of its shard (a Ring agreeing at its first call): their sum.
    Returns ``(plan, spec, hosts)``: the agreed spec (every rank's positions in
    it) and every rank's processor name.
    """
    shown = held = None
    try:
        problem = (comm_problem(comm) or timeout_problem(timeout) or problem
                   or size_problem(comm.Get_size(), expected_size))
        if problem is None and spec.seq_len is None and spec.positions is None and length is None:
            problem = "seq_len must be given (the number of tokens of the whole sequence), unless positions are"
        if problem is None:
            held = spec.held()
            shown = dict(compared(spec, timeout), **{name: Shown(value) for name, value in (values or {}).items()})
    except Exception as exc:  # reported collectively, never raised alone
        problem, shown = describe(exc), None
    gathered = agreed(comm, problem, shown, timeout, (Host.mine(), held, length), entry=True)
    spec, implied = spec.with_ranks([g[1] for g in gathered])
    if implied is None and length is not None:
        implied = sum(g[2] for g in gathered)
    if spec.seq_len is not None and implied is not None and implied != spec.seq_len:  # the same data everywhere
        raise ValueError(f"seq_len={spec.seq_len} but the ranks' positions hold {implied} tokens")
    plan = spec.plan(comm.Get_size(), implied or spec.seq_len)  # raises everywhere
    return plan, spec, Hosts(g[0] for g in gathered)


class Host(str):
    """A rank's processor name, with a random ``nonce`` of its own (what the agreement gathers of every rank)."""

    @classmethod
    def mine(cls):
        host = cls(MPI.Get_processor_name())
        host.nonce = secrets.randbits(63)
        return host

    def __reduce__(self):
        return _host, (str(self), self.nonce)


def _host(name, nonce):
    host = Host(name)
    host.nonce = nonce
    return host


class Hosts(list):
    """Every rank's ``Host``; ``token``: a number drawn from all their nonces, the same on every rank and new for
    every agreement (a handle's failure notices carry it: ``waits.Watch``)."""

    @property
    def token(self):
        return sum(getattr(h, "nonce", 0) for h in self) % (1 << 63)


def check_call(comm, problem, values, peaks, timeout):
    """The per-call agreement of a ``Ring`` handle: one small all-reduce, the same verdict on every rank.

    Every rank contributes whether it found a ``problem``, a digest of
    ``values`` (``call_values``: every rank's must match) and ``peaks`` (its
    largest |q| and |k|). Only when something is wrong does a second round,
    ``agreed``, collect the messages, so the ValueError names each rank as
    ``setup``'s does. Returns the largest peaks over all ranks. Every rank has
    arrived when it returns, as after a barrier.

    ``comm`` is the handle's private communicator. The all-reduce is all a call
    sends (O(log P) messages per rank) unless its wait lasts: then a roll call
    (``rollcall.RollCall``) finds which ranks have not entered, for the wait's
    log and its CommTimeout (``waits.wait_entry``: without limit for "auto").
    If this rank gives up, its pending all-reduce is abandoned
    (``waits.abandon``), never freed.
    """
    digest = values_digest(values)
    mine = np.array([1.0 if problem else 0.0, digest, -digest, *peaks])
    every = np.empty_like(mine)
    roll = RollCall(comm)
    reduce = comm.Iallreduce(mine, every, op=MPI.MAX)
    try:
        wait_entry([reduce], entry_timeout(timeout), comm.Get_rank(), "agreement", roll=roll)
    except BaseException:
        abandon((comm, [reduce], mine, every))  # MPI may still use them: kept for good
        raise
    if every[0] or every[1] != -every[2]:
        agreed(comm, problem, values, timeout)
        raise ValueError("the ranks passed arrays of different shapes or dtypes")
    return every[3:]


def contiguous(tensors, lses):
    """The call's arrays made contiguous: the backward's dout, q, out and lse in the dtype tiles compute in
    (float32 for half inputs; k and v travel in theirs), the forward's q, k, v as they are."""
    work = compute_dtype(tensors["q"].dtype) if "dout" in tensors else None
    arrays = [np.ascontiguousarray(a, None if name in ("k", "v") else work) for name, a in tensors.items()]
    return arrays, [np.ascontiguousarray(a, work) for a in lses]
