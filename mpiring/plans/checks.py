"""Validation: what each rank finds wrong with its own arguments, and the messages that name every rank. No MPI.

The ``*_problem`` checks return a message or None and never raise (``Spec.of``
raises ValueError, and its callers catch it), so a rank's problem reaches the
others through the agreement (``mpiring.mpi.agree``) before anyone raises: the
same ValueError on every rank.
"""

import numpy as np

from ..core import backends
from ..core.kernels import LSE_LIMIT
from ..core.precision import compute_dtype, dtype_problem
from ..core.ranks import ranks_text
from ..core.scores import FunctionFailed, bias_probe, mod_probe
from ..core.tiles import max_abs
from ..core.tuning import gemm
from .content import described, difference, first_difference, leaf_value
from .spec import FIELDS, digest, is_real, scale_problem

__all__ = ["local_problem", "backend_problem", "is_real", "timeout_problem", "AUTO_AGREE", "AUTO_BASE", "AUTO_RATE",
           "AUTO_ENTRY", "agreement_timeout", "entry_timeout", "resolve_timeout", "size_problem", "Shown", "shape_text",
           "verdict", "differences", "differing_parts", "part_values", "describe", "compared", "logit_problem",
           "grad_problem", "root_problem", "root_grad_problem", "scale_problem", "call_values", "values_digest",
           "peaks", "pairs_problem", "length_problem", "dlse_problem"]


def backend_problem(q=None):
    """Why the chosen kernel or GEMM backend cannot run here, or None.

    Resolving the choice loads its library (torch's import: seconds, more with many ranks on few cores), for a
    call on queries like ``q`` the backend its blocks take (``backends.prepare``): done here, before the
    agreement, a rank spends that before the ring starts rather than inside its first block while the others
    wait on it, and a bad ``MPIRING_KERNEL`` or ``MPIRING_GEMM`` is every rank's error. Cached after the first call.
    """
    try:
        backends.backend()
        gemm.backend()
    except ValueError as exc:
        return str(exc)
    if q is not None:
        backends.prepare(q.dtype, q.shape[-2])
    return None


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
    if backend_problem(q):
        return backend_problem()
    if check_finite:  # one pass over the inputs: off by default
        for name, a in (("q", q), ("k", k), ("v", v)):
            bad = ~np.isfinite(a)
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                return f"{name} has {int(bad.sum())} NaN/Inf values, the first at index {first}"
    return None


def timeout_problem(timeout):
    if isinstance(timeout, str) and timeout == "auto":
        return None
    if timeout is not None and not (is_real(timeout) and np.isfinite(timeout) and timeout > 0):
        return f"timeout must be 'auto', a positive number of seconds, or None (wait forever); got {timeout!r}"
    return None


# timeout="auto": how long a rank waits for the others. A slow rank is not a failed one: every rank may do
# other work before a call (an evaluation, a checkpoint), so the entry, until every rank has reached the
# call, waits without limit (AUTO_ENTRY None; waits.wait_entry logs who is missing every minute, doubling);
# once every rank is in the call, each wait is bounded, generously: a hang ends, a slow run never does.
AUTO_ENTRY = None  # seconds for every rank to reach a call: None, no limit
AUTO_AGREE = 60.0  # seconds for each wait of the agreement once every rank has entered (the Idup, a second round)
AUTO_BASE = 60.0  # seconds for any transfer, plus ...
AUTO_RATE = 1e8  # ... the whole call's FLOPs at this rate (FLOP/s): 100x below a CPU core's GEMM speed


def agreement_timeout(timeout):
    """The timeout of each wait of the agreement once every rank has entered the call, before the plan is known.

    A bad timeout waits forever here: the agreement is what reports it, to every rank.
    """
    if timeout_problem(timeout):
        return None
    return AUTO_AGREE if isinstance(timeout, str) else timeout


def entry_timeout(timeout):
    """How long a rank waits for every rank to enter a call: ``timeout`` itself, or AUTO_ENTRY (no limit) for "auto"."""
    if timeout_problem(timeout):
        return None
    return AUTO_ENTRY if isinstance(timeout, str) else timeout


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


class Shown:
    """A value compared by content (cu_seqlens by digest) and shown briefly in messages.

    ``found``: the value's ``plans.content.Content`` (a function, mask pieces, an array): compared by its
    digest, and a difference named leaf by leaf (``differences``).
    """

    def __init__(self, value, text=None, found=None):
        self.content = found
        if found is not None:
            self.text, self.key = text, found.digest
        elif text is not None:
            self.text, self.key = text, value
        elif isinstance(value, np.ndarray):
            items = value.tolist()
            self.text = str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:4]))}, ..., {items[-1]}]" \
                f" ({len(items)} entries)"
            self.key = (len(items), digest(value))
        else:
            self.text, self.key = repr(value), value

    def __eq__(self, other):
        return self.key == other.key

    def __repr__(self):
        return self.text


def shape_text(a, axis=-2):
    """A shape with the sequence axis (``axis``), which may differ between ranks, shown as *."""
    axis = axis % a.ndim
    return "(" + ", ".join("*" if i == axis else str(n) for i, n in enumerate(a.shape)) + ")"


def verdict(problems, prefix="rank"):
    """One message naming every rank with a problem; ranks with the same problem share a line."""
    by_text = {}
    for r, p in enumerate(problems):
        if p:
            by_text.setdefault(p, []).append(r)
    parts = [f"{ranks_text(ranks, prefix)}: {p}" for p, ranks in by_text.items()]
    return "; ".join(parts) or None


def _differing(values, ref):
    """``(rank, name, its value, rank ref's)`` of each rank's first value that differs from rank ``ref``'s."""
    for r, mine in enumerate(values):
        if mine is None or values[ref] is None or r == ref:
            continue
        found = next(((name, val) for name, val in mine.items() if not val == values[ref][name]), None)
        if found is not None:
            yield r, found[0], found[1], values[ref][found[0]]


def differences(values, ref, parts=None):
    """Per rank: which named value differs from rank ``ref``'s (values[r] is a dict, or None).

    A value with content (``Shown.found``) whose text is rank ``ref``'s too is named down to the part that
    differs: ``parts[(rank, name)]`` holds both ranks' ``leaf_value`` of it (``differing_parts``).
    """
    out = [None] * len(values)
    for r, name, val, theirs in _differing(values, ref):
        out[r] = f"{name} {val!r} differs from rank {ref}'s {theirs!r}"
        if (r, name) in (parts or {}):
            index = first_difference(val.content, theirs.content)
            leaves = [c.leaves[index] if index < len(c.leaves) else None for c in (val.content, theirs.content)]
            out[r] = f"{name} differs from rank {ref}'s: {difference(index, leaves, parts[(r, name)], (r, ref))}"
    return out


def differing_parts(values, ref):
    """``[(rank, name, leaf index)]``: the values with content that differ from rank ``ref``'s under the same
    text, and the first leaf that differs (the same list on every rank, from the gathered values)."""
    return [(r, name, first_difference(val.content, theirs.content)) for r, name, val, theirs in _differing(values, ref)
            if isinstance(val, Shown) and isinstance(theirs, Shown)  # plain values are named by their text alone
            and val.content is not None and theirs.content is not None and val.text == theirs.text]


def part_values(mine, wanted, rank, ref):
    """What this rank sends of its ``mine`` values for ``differing_parts``: ``{(r, name): leaf_value}``."""
    return {(r, name): leaf_value(mine[name].content, index) for r, name, index in wanted if rank in (r, ref)}


def describe(exc):
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def compared(spec, timeout):
    """The values every rank must pass identically, by argument name: the spec's fields and the timeout.

    Positions are each rank's own: only whether they were given is compared.
    """
    values = dict({name: getattr(spec, name) for name in FIELDS}, timeout=timeout)
    rows = ("positions", "kv_positions")
    by_content = ("mask", "bias", "score_mod", "score_mod_grad", "sinks")  # by what they are and read, not pickled
    return {name: Shown(val is not None, "given" if val is not None else "None") if name in rows
            else Shown(None, " & ".join(map(repr, val)) or "()" if name == "mask" else described(val),
                       spec.field_content(name)) if name in by_content
            else Shown(val) for name, val in values.items()}


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


def root_grad_problem(Q, K, V, dOut, scale, size, check_finite=False):
    """What is wrong with root's full arrays, or None (``check_finite``: NaN/Inf in Q, K, V too)."""
    problem = root_problem(Q, K, V) or local_problem(Q, K, V, scale, check_finite)
    if problem:
        return problem
    want = Q.shape[:-1] + V.shape[-1:]
    if not isinstance(dOut, np.ndarray) or dOut.shape != want or dOut.dtype != Q.dtype:
        got = f"{dOut.shape} {dOut.dtype}" if isinstance(dOut, np.ndarray) else type(dOut).__name__
        return f"dOut must be a {Q.dtype} array of shape {want}, got {got}"
    if Q.shape[-2] < size:
        return f"sequence length {Q.shape[-2]} is shorter than the number of ranks {size}"
    return None


def call_values(arrays):
    """What every rank's call must share, by name: the arrays' shapes (but the sequence axis) and dtype."""
    values = {f"{name} shape": Shown(*[shape_text(a)] * 2) for name, a in arrays.items()}
    values["dtype"] = Shown(str(next(iter(arrays.values())).dtype))
    return values


def values_digest(values):
    """``values`` as a number an all-reduce can compare: 48 bits of a hash, exact in a float64."""
    text = repr(sorted((name, repr(v.key)) for name, v in values.items())) if values else ""
    return float(int(digest(text.encode())[:12], 16))


def peaks(*arrays):
    """Largest |entry| of each array (the logit bound of ``logit_problem``)."""
    return [max_abs(a) for a in arrays]


def pairs_problem(plan, spec, rank, heads, finite=False):
    """This rank's problem with its own (query, key) pairs under ``plan``, or None: a mask with holes is evaluated
    on them (``plan.kinds``, kept for the ring), the bias probed (``scores.bias_probe``), so a user's function that
    fails there is found before any data moves and agreed, not met inside the ring (``finite``: or, with
    ``check_finite=True``, returns NaN or +Inf there)."""
    try:
        if not plan.exact:
            row = plan.kinds[rank]
            for source in range(len(row)):
                row[source]
        if spec.bias is not None:
            bias_probe(spec.bias, heads, plan.shards[rank], plan.seq_len, finite)
        for name in ("score_mod", "score_mod_grad"):
            if getattr(spec, name) is not None:
                mod_probe(getattr(spec, name), name, heads, plan.shards[rank], plan.seq_len, finite)
    except FunctionFailed as exc:
        return str(exc)
    return None


def length_problem(plan, rank, q, k):
    """Why this rank's q and k do not hold the tokens ``plan`` gives it, or None."""
    for name, a, shards in (("q", q, plan.shards), ("k", k, plan.kv_shards)):
        want = len(shards[rank])
        if a.shape[-2] != want and plan.layout == "positions":
            given, rows = ("positions", "q") if name == "q" else ("kv_positions", "k and v")
            return f"{given} has {want} entries for the {a.shape[-2]} rows of {rows}"
        if a.shape[-2] != want:
            return (f"{name} holds {a.shape[-2]} tokens, but the {plan.layout} layout of {plan.seq_len} tokens over "
                    f"{plan.size} ranks gives this rank {want}")
    return None


def dlse_problem(dlse, lse):
    if dlse is not None and not (isinstance(dlse, np.ndarray) and dlse.shape == lse.shape):
        return f"dlse must be an array shaped as lse {lse.shape}, got {getattr(dlse, 'shape', type(dlse))}"
    return None
