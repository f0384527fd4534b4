"""Validation and collective agreement: every rank ends a call's checks with the same verdict.

Each rank checks what it can alone, then one all-gather shares every rank's
problem and options; either every rank goes on with the same plan, or every
rank raises the same ValueError naming each offending rank. Nothing here
raises before that all-gather, so one rank's bad input cannot leave the
others waiting.
"""

import hashlib

import numpy as np
from mpi4py import MPI

from ..core.kernels import LSE_LIMIT, default_scale
from ..core.precision import canonical_precision, compute_dtype, dtype_problem, without_precision
from ..plans.layouts import check_layout, sort_order, take_rows
from ..plans.make import make_plan
from ..plans.masks import check_causal_block, check_window
from ..plans.plan import ALL_MODES
from .collectives import allgather
from .waits import wait_until

__all__ = ["agree", "setup", "agree_root", "check_comm", "comm_problem", "resolve_timeout", "agreement_timeout",
           "local_problem", "grad_problem", "root_problem", "root_grad_problem", "timeout_problem", "scale_problem",
           "logit_problem", "describe", "setup_ring", "call_values", "check_call", "peaks", "rows_problem",
           "with_every_rank_positions", "ROW_OPTIONS"]


def local_problem(q, k, v, scale, check_finite=False, same_rows=True):
    """What is wrong with this rank's own arguments, or None (``same_rows``: k holds q's tokens)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array, got {type(a).__name__}"
        if dtype_problem(name, a):
            return dtype_problem(name, a)
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
    if same_rows and q.shape[-2] != k.shape[-2]:
        return f"q and k must hold the same local tokens, got {q.shape[-2]} and {k.shape[-2]}"
    if q.ndim >= 3:
        if q.shape[:-3] != k.shape[:-3]:
            return f"q and k must have the same batch axes, got {q.shape} and {k.shape}"
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            return f"q heads ({q.shape[-3]}) must be a multiple of k/v heads ({k.shape[-3]})"
    if min(q.shape[-1], v.shape[-1]) < 1 or q.shape[-2] < 1 or k.shape[-2] < 1:
        return f"every rank needs at least one token and a positive head dim, got q {q.shape}, v {v.shape}"
    if 0 in q.shape[:-2] or 0 in k.shape[:-2]:
        return f"batch and head axes must not be empty, got q {q.shape}, k {k.shape}"
    if scale_problem(scale):
        return scale_problem(scale)
    if check_finite:  # one pass over the inputs: off by default
        for name, a in (("q", q), ("k", k), ("v", v)):
            bad = ~np.isfinite(a)
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                return f"{name} has {int(bad.sum())} NaN/Inf values, the first at index {first}"
    return None


def _is_real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


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


def timeout_problem(timeout):
    if isinstance(timeout, str) and timeout == "auto":
        return None
    if timeout is not None and not (_is_real(timeout) and np.isfinite(timeout) and timeout > 0):
        return f"timeout must be 'auto', a positive number of seconds, or None (wait forever); got {timeout!r}"
    return None


# timeout="auto": how long a rank waits for the others. Generous: a hang ends, a slow run never does.
AUTO_AGREE = 60.0  # seconds for ranks to arrive at a call (they may have other work before it)
AUTO_BASE = 60.0  # seconds for any transfer, plus ...
AUTO_RATE = 1e8  # ... the whole call's FLOPs at this rate (FLOP/s): 100x below a CPU core's GEMM speed


def agreement_timeout(timeout):
    """The timeout of the agreement itself, before the plan is known.

    A bad timeout waits forever here: the agreement is what reports it, to every rank.
    """
    if timeout_problem(timeout):
        return None
    return AUTO_AGREE if isinstance(timeout, str) else timeout


def resolve_timeout(timeout, plan, batch_heads, dim, factor=1.0):
    """Seconds for every wait of a call under ``plan`` (the same on every rank): ``timeout`` unless "auto".

    "auto": AUTO_BASE plus the busiest rank's attention FLOPs (4 x batch x
    heads x dim per visible pair, times ``factor``: 2.5 more for a backward)
    at AUTO_RATE, so no compute step of a working run can outlast it.
    """
    if not isinstance(timeout, str):
        return timeout
    flops = 4.0 * batch_heads * dim * max(plan.visible_pairs()) * factor
    return AUTO_BASE + flops / AUTO_RATE


def size_problem(size, expected_size):
    if expected_size is not None and size != expected_size:
        return f"the communicator has {size} ranks but expected_size={expected_size!r}"
    return None


def canonical(options):
    """This rank's options in a form ranks can compare; raises ValueError on a bad one.

    Only checks that need no other rank are made here; make_plan checks the rest
    (cu_seqlens against the total length) once every rank holds the same options.
    The precision options (``wire_dtype``, ...) are checked and kept when given.
    """
    check_layout(options["layout"])
    if options["mode"] not in ALL_MODES:
        raise ValueError(f"mode must be one of {', '.join(ALL_MODES)}; got {options['mode']!r}")
    cu = options["cu_seqlens"]
    if cu is not None:
        cu = np.asarray(cu)
        if cu.ndim != 1 or not np.issubdtype(cu.dtype, np.integer):
            raise ValueError(f"cu_seqlens must be a 1-D integer array [0, ..., seq_len], got {cu!r}")
        cu = cu.astype(np.int64)
    if not isinstance(options["causal"], (bool, np.bool_)):
        raise ValueError(f"causal must be True or False, got {options['causal']!r}")
    rows = {name: _positions(name, options.get(name)) for name in ROW_OPTIONS}
    if rows["kv_positions"] is not None and rows["positions"] is None:
        raise ValueError("kv_positions needs positions: the query rows' own positions")
    precision = canonical_precision(options) if len(without_precision(options)) < len(options) else {}
    node_size = options.get("node_size")
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, (int, np.integer))
                                  or node_size < 1):
        raise ValueError(f"node_size must be a positive integer (ranks per node) or None, got {node_size!r}")
    ulysses_size = options.get("ulysses_size")
    if ulysses_size is not None and (isinstance(ulysses_size, bool) or not isinstance(ulysses_size, (int, np.integer))
                                     or ulysses_size < 1):
        raise ValueError(f"ulysses_size must be a positive integer or None, got {ulysses_size!r}")
    return dict(layout=options["layout"], mode=options["mode"], causal=bool(options["causal"]),
                window=check_window(options["window"]), cu_seqlens=cu,
                causal_block=check_causal_block(options.get("causal_block"), options["causal"]), **rows, **precision,
                node_size=None if node_size is None else int(node_size),
                ulysses_size=None if ulysses_size is None else int(ulysses_size))


ROW_OPTIONS = ("positions", "kv_positions")  # this rank's own: gathered from every rank, not compared


def _positions(name, positions):
    """This rank's positions as int64 (or None); ValueError unless a 1-D integer array."""
    if positions is None:
        return None
    p = np.asarray(positions)
    if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array of global positions, got {p.dtype} of shape {p.shape}")
    return p.astype(np.int64)


def _row_order(options, kind):
    """The sort of this rank's rows of one kind ("q", "l": queries; "k": keys) by position (None: sorted)."""
    name = "kv_positions" if kind == "k" and options["kv_positions"] is not None else "positions"
    return sort_order(options[name])


def with_every_rank_positions(options, held):
    """Put every rank's positions (``held[rank]``, as the agreement gathered them) into ``options``.

    Returns the keys' sequence length the positions imply (the total of the
    k/v positions), or None when no positions were given (the layout's).
    """
    seq_len = None
    for i, name in enumerate(ROW_OPTIONS):
        if options[name] is not None:  # given on every rank: the agreement compared that
            options[name] = [h[i] for h in held]
            seq_len = sum(len(p) for p in options[name])
    return seq_len


def rows_problem(q, k, options):
    """Why this rank's positions do not fit its q and k rows, or None."""
    for name, a in (("positions", q), ("kv_positions", k)):
        p = options[name]
        if p is not None and len(p) != a.shape[-2]:
            what = "q" if name == "positions" else "k and v"
            return f"{name} has {len(p)} entries for the {a.shape[-2]} rows of {what}"
    return None


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


def verdict(problems, prefix="rank"):
    """One message naming every rank with a problem; ranks with the same problem share a line."""
    by_text = {}
    for r, p in enumerate(problems):
        if p:
            by_text.setdefault(p, []).append(r)
    parts = [f"{prefix} {ranks[0]}: {p}" if len(ranks) == 1 else f"{prefix}s {', '.join(map(str, ranks))}: {p}"
             for p, ranks in by_text.items()]
    return "; ".join(parts) or None


def differences(values, ref):
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


def describe(exc):
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def agree(comm, problem, timeout=None):
    """Collective: raise the same ValueError on every rank if any rank has a problem."""
    message = verdict(allgather(comm, problem, agreement_timeout(timeout)))
    if message:
        raise ValueError(message)


def compared(options, timeout):
    """The values every rank must pass identically, by argument name."""
    values = dict(options, timeout=timeout)
    return {name: _Shown(val is not None, "given" if val is not None else "None") if name in ROW_OPTIONS
            else _Shown(val) for name, val in values.items()}


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
        problem = (comm_problem(comm) or timeout_problem(timeout)
                   or local_problem(q, k, v, scale, check_finite, options.get("kv_positions") is None)
                   or problem or size_problem(size, expected_size))
        if problem is None:
            options = canonical(options)
            problem = rows_problem(q, k, options)
        if problem is None and prepare is not None:
            prepared = prepare()
            if rows is not None:  # copies too: made here, where a MemoryError is reported by every rank
                prepared = [take_rows(a, _row_order(options, kind), -1 if kind == "l" else -2)
                            for a, kind in zip(prepared, rows)]
        if problem is None:
            held = [options[name] for name in ROW_OPTIONS]
            values = {f"{n} shape": _Shown(*[_shape_text(a)] * 2) for n, a in (("q", q), ("k", k), ("v", v))}
            values.update({"dtype": _Shown(str(q.dtype)),
                           "scale": _Shown(scale), **compared(options, timeout)})
            values.update({name: _Shown(val) for name, val in (compare or {}).items()})
            n_local = q.shape[-2]
            peak = peaks(q, k)
    except Exception as exc:  # whatever goes wrong here is reported collectively, never raised alone
        problem, values = describe(exc), None
    metas = allgather(comm, (problem, values, n_local, peak, held, MPI.Get_processor_name()),
                      agreement_timeout(timeout))
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


def _peak(a):
    """Largest |entry| of a, as a float (two passes, no temporary)."""
    return float(max(a.max(), -a.min())) if a.size else 0.0


def logit_problem(scale, dim, q_peak, k_peak, dtype):
    """Why scale * q.k may overflow ``dtype`` (|q.k| <= dim * max|q| * max|k|), or None.

    Any logits below that bound give a finite lse; beyond it no float arithmetic can
    (half inputs: logits are computed in float32).
    """
    dtype = compute_dtype(dtype)
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


def grad_problem(dout, q, k, v, out, lse):
    """What is wrong with this rank's dout, out or lse, or None (q, k, v are checked by ``setup``)."""
    try:
        if local_problem(q, k, v, None, same_rows=False):
            return None
        rows = q.shape[:-1]
        for name, a, shape in (("dout", dout, rows + v.shape[-1:]), ("out", out, rows + v.shape[-1:]),
                               ("lse", lse, rows)):
            if not isinstance(a, np.ndarray):
                return f"{name} must be a NumPy array, got {type(a).__name__}"
            if a.shape != shape:
                return f"{name} must have shape {shape} (from q and v), got {a.shape}"
            want = compute_dtype(q.dtype) if name == "lse" else q.dtype  # half inputs: lse in float32
            if a.dtype != want:
                of = f"of q ({q.dtype})" if want == q.dtype else f"{want} (that of q, {q.dtype}, computes in)"
                return f"{name} must have the dtype {of}, got {a.dtype}"
        peak = float(np.max(np.abs(lse), initial=0, where=np.isfinite(lse)))
        work = compute_dtype(q.dtype)
        if peak > LSE_LIMIT[work]:
            return (f"lse reaches {peak:.3g}: the probabilities exp(scale q.k - lse) are recomputed from lse, "
                    f"and in {work} beyond |lse| = {LSE_LIMIT[work]:g} they lose more than 0.1 % "
                    f"(the gradient would be wrong); rescale q, k or the softmax scale")
    except Exception as exc:  # reported collectively, never raised alone
        return describe(exc)
    return None


def root_problem(Q, K, V):
    for name, a in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array on the root rank, got {type(a).__name__}"
    return None


def root_grad_problem(Q, K, V, dOut, scale, size):
    """What is wrong with root's full arrays, or None."""
    problem = root_problem(Q, K, V) or local_problem(Q, K, V, scale)
    if problem:
        return problem
    want = Q.shape[:-1] + V.shape[-1:]
    if not isinstance(dOut, np.ndarray) or dOut.shape != want or dOut.dtype != Q.dtype:
        got = f"{dOut.shape} {dOut.dtype}" if isinstance(dOut, np.ndarray) else type(dOut).__name__
        return f"dOut must be a {Q.dtype} array of shape {want}, got {got}"
    if Q.shape[-2] < size:
        return f"sequence length {Q.shape[-2]} is shorter than the number of ranks {size}"
    return None


def scale_problem(scale):
    """Why ``scale`` is not a valid softmax scale, or None (None means the default)."""
    if scale is not None and not (_is_real(scale) and np.isfinite(scale) and scale > 0):
        return f"scale must be a finite positive number, got {scale!r}"
    return None


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
        if problem is None and not (_is_real(root) and isinstance(root, (int, np.integer)) and 0 <= root < size):
            problem = f"root must be a rank of the communicator, 0 .. {size - 1}; got {root!r}"
        if problem is None:
            options = canonical(options)
            values = dict(compared(options, timeout), root=_Shown(root), scale=_Shown(scale))
            if rank == root:
                root_found, meta = check_root()
    except Exception as exc:  # reported collectively, never raised alone
        problem, values = describe(exc), None
    gathered = allgather(comm, (problem, values, root_found, meta), agreement_timeout(timeout))
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
            shown = dict(compared(options, timeout), seq_len=_Shown(None if seq_len is None else int(seq_len)),
                         scale=_Shown(scale), **{name: _Shown(value) for name, value in (values or {}).items()})
    except Exception as exc:  # reported collectively, never raised alone
        problem, shown = describe(exc), None
    gathered = allgather(comm, (problem, shown, MPI.Get_processor_name(), held), agreement_timeout(timeout))
    message = verdict([g[0] for g in gathered]) or verdict(differences([g[1] for g in gathered], 0))
    if message:
        raise ValueError(message)
    implied = with_every_rank_positions(options, [g[3] for g in gathered])
    if seq_len is not None and implied is not None and implied != seq_len:  # the same data everywhere
        raise ValueError(f"seq_len={seq_len} but the ranks' positions hold {implied} tokens")
    plan = make_plan(implied or int(seq_len), comm.Get_size(), **without_precision(options))  # raises everywhere
    return plan, [g[2] for g in gathered], options


def call_values(arrays):
    """What every rank's call must share, by name: the arrays' shapes (but the sequence axis) and dtype."""
    values = {f"{name} shape": _Shown(*[_shape_text(a)] * 2) for name, a in arrays.items()}
    values["dtype"] = _Shown(str(next(iter(arrays.values())).dtype))
    return values


def _digest(values):
    """``values`` as a number an all-reduce can compare: 48 bits of a hash, exact in a float64."""
    text = repr(sorted((name, repr(v.key)) for name, v in values.items())) if values else ""
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big"))


def check_call(comm, problem, values, peaks, timeout):
    """The per-call agreement of a ``Ring`` handle: one small all-reduce, the same verdict on every rank.

    Every rank contributes whether it found a ``problem``, a digest of
    ``values`` (``call_values``: every rank's must match) and ``peaks`` (its
    largest |q| and |k|). Only when something is wrong does a second round, an
    all-gather, collect the messages, so the ValueError names each rank as
    ``setup``'s does. Returns the largest peaks over all ranks. Every rank has
    arrived when it returns, as after a barrier.
    """
    digest = _digest(values)
    mine = np.array([1.0 if problem else 0.0, digest, -digest, *peaks])
    every = np.empty_like(mine)
    wait_until([comm.Iallreduce(mine, every, op=MPI.MAX)], agreement_timeout(timeout), comm.Get_rank(), "agreement",
               sync=True)
    if every[0] or every[1] != -every[2]:
        gathered = allgather(comm, (problem, values), agreement_timeout(timeout))
        raise ValueError(verdict([g[0] for g in gathered]) or verdict(differences([g[1] for g in gathered], 0))
                         or "the ranks passed arrays of different shapes or dtypes")
    return every[3:]


def peaks(*arrays):
    """Largest |entry| of each array (the logit bound of ``logit_problem``)."""
    return [_peak(a) for a in arrays]
