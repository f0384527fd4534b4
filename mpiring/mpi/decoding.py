"""The checks and the agreement of a decoding call (``decode_attention``, ``decode_many``, ``KVCache``, Helix).

Each rank checks its own arguments (``decode_problem``), computes its partial
(``work``: the user's mask and bias functions run here, on its own cache),
then one all-gather shares every rank's problem and the values that must be
the same everywhere: the new tokens q and their positions by content, the
options, the mask and score functions by what they read. Only then does any
partial move: a failure anywhere before it is every rank's ValueError.
"""

from dataclasses import dataclass

import numpy as np

from ..core.kernels import default_scale
from ..core.scores import FunctionFailed
from ..core.tiles import max_abs
from ..plans.checks import (
    AUTO_BASE,
    AUTO_RATE,
    Shown,
    describe,
    logit_problem,
    scale_problem,
    shape_text,
    timeout_problem,
)
from ..plans.content import content
from .agree import agreed

__all__ = ["EXCHANGES", "Decoding", "decode_problem", "decode_agreement", "decode_timeout", "parents_problem",
           "path_problem", "by_content"]

EXCHANGES = ("tree", "ring")  # how the partials travel: one all-reduce (a tree), or around the ring


@dataclass(frozen=True, eq=False)
class Decoding:
    """A decoding call's options, which every rank passes alike (but ``kv_positions``: this rank's k, v rows)."""

    scale: float | None = None  # None: 1/sqrt(head dim)
    timeout: float | str | None = "auto"
    exchange: str = "tree"
    causal: bool = False
    positions: object = None  # of q's tokens, the same on every rank
    kv_positions: object = None


def by_content(name, value, text=None):
    """``value`` for the agreement, compared by content: a difference names the first differing element."""
    if value is None:
        return Shown(None)
    a = np.asarray(value)
    return Shown(None, text or f"{a.dtype} {a.shape}", content(a, name))


def decode_problem(q, k, v, call):
    """What is wrong with this rank's decoding arguments (``call``: a ``Decoding``), or None."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array, got {type(a).__name__}"
        if a.dtype not in (np.float32, np.float64):
            return f"{name} must be float32 or float64, got {a.dtype}"
        if a.ndim < 3:
            return f"{name} must have shape (..., heads, tokens, dim), got {a.shape}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.ndim == k.ndim == v.ndim) or q.shape[:-3] != k.shape[:-3]:
        return f"q, k, v must have the same batch axes, got {q.shape}, {k.shape}, {v.shape}"
    if k.shape[:-1] != v.shape[:-1]:
        return f"k and v must agree on all but the last axis, got {k.shape} and {v.shape}"
    if q.shape[-1] != k.shape[-1]:
        return f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}"
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
        return f"q heads ({q.shape[-3]}) must be a multiple of k/v heads ({k.shape[-3]})"
    if q.shape[-2] < 1 or min(q.shape[-1], v.shape[-1]) < 1 or 0 in q.shape[:-2]:
        return f"q needs at least one token, head and batch entry and a positive head dim, got q {q.shape}, v {v.shape}"
    if not isinstance(call.exchange, str) or call.exchange not in EXCHANGES:
        return f"exchange must be one of {', '.join(EXCHANGES)}; got {call.exchange!r}"
    if not isinstance(call.causal, (bool, np.bool_)):
        return f"causal must be True or False, got {call.causal!r}"
    if call.causal:
        for name, n in (("positions", q.shape[-2]), ("kv_positions", k.shape[-2])):
            p = getattr(call, name)
            p = None if p is None else np.asarray(p)
            if p is None or p.ndim != 1 or len(p) != n or not (np.issubdtype(p.dtype, np.integer) or n == 0):
                return f"causal decoding needs {name}: a 1-D integer array of {n} global positions"
    return scale_problem(call.scale)


def decode_agreement(comm, q, k, v, call, *, k_peak=None, problem=None, values=None, work=None):
    """Check this rank's arguments and agree with every rank (one all-gather): ``(scale, kv lengths, done)``.

    ``call``: the ``Decoding`` options. The same ValueError on every rank if any rank has a problem, if q (its
    values), its positions or an option differ from rank 0's, or if the logits
    may overflow. ``q, k, v``: arrays, or lists of arrays, one per sequence
    (``decode_many``; ``k_peak`` then a list too). ``k_peak``: max |k| when k is
    only a stand-in for its shape (a cache's stored keys); ``problem``: one more
    of this rank's problems (or None); ``values``: more that every rank must
    pass alike (a dict, as ``agreed`` takes); ``work(scale)``: this rank's own
    computation, run once its arguments are valid and before the all-gather,
    so that its failure (a user's function, a MemoryError) is agreed too;
    ``done`` is what it returned. The lengths: each rank's cached tokens (all sequences').
    """
    many = isinstance(q, list)
    qs, ks, vs, k_peaks = (x if many else [x] for x in (q, k, v, k_peak))
    k_peaks = [None] * len(qs) if k_peaks is None else k_peaks
    mine = peaks = done = None
    try:
        problem = problem or timeout_problem(call.timeout)
        for i, (qi, ki, vi) in enumerate(zip(qs, ks, vs)):
            found = decode_problem(qi, ki, vi, call)
            problem = problem or (found and (f"sequence {i}: {found}" if many else found))
        if problem is None and len({(qi.dtype, vi.shape[-1]) for qi, vi in zip(qs, vs)}) > 1:
            problem = "every sequence must have one dtype and one v head dim"
        if problem is None:
            tags = [f" of sequence {i}" if many else "" for i in range(len(qs))]
            mine = {"sequences": Shown(len(qs))} if many else {}
            for tag, qi, ki, vi in zip(tags, qs, ks, vs):
                mine.update({f"q shape{tag}": Shown(qi.shape), f"k shape{tag}": Shown(*[shape_text(ki)] * 2),
                             f"v shape{tag}": Shown(*[shape_text(vi)] * 2)})
            mine.update({"dtype": Shown(" ".join(sorted({str(qi.dtype) for qi in qs}))), "scale": Shown(call.scale),
                         "exchange": Shown(call.exchange), "causal": Shown(bool(call.causal)),
                         "timeout": Shown(call.timeout)})
            mine.update({f"q{tag}": by_content(f"q{tag}", qi) for tag, qi in zip(tags, qs)})
            mine["positions"] = by_content("positions", None if call.positions is None else
                                           np.asarray(call.positions, np.int64))
            mine.update(values or {})
            k_peaks = [max_abs(ki) if p is None else p for ki, p in zip(ks, k_peaks)]
            peaks = (max(max_abs(qi) for qi in qs), max(k_peaks), sum(ki.shape[-2] for ki in ks))
            if work is not None:
                done = work(default_scale(qs[0].shape[-1]) if call.scale is None else float(call.scale))
    except FunctionFailed as exc:  # a user's function failed on this rank's cache
        problem, mine = str(exc), None
    except Exception as exc:  # reported collectively, never raised alone
        problem, mine = describe(exc), None
    metas = agreed(comm, problem, mine, call.timeout, peaks, entry=True)
    scale = default_scale(qs[0].shape[-1]) if call.scale is None else float(call.scale)
    message = logit_problem(scale, qs[0].shape[-1], max(m[0] for m in metas), max(m[1] for m in metas), qs[0].dtype)
    if message:
        raise ValueError(message)
    return scale, [m[2] for m in metas], done


def decode_timeout(timeout, q, v, lengths):
    """Seconds for every wait: ``timeout``, or for "auto" AUTO_BASE plus the longest shard's FLOPs at AUTO_RATE."""
    if not isinstance(timeout, str):
        return timeout
    return AUTO_BASE + 4.0 * q.size * max(lengths + [0]) * (1 + v.shape[-1] / q.shape[-1]) / 2 / AUTO_RATE


def parents_problem(parents, T):
    """Why ``parents`` is not a draft tree of T tokens, or None: 1-D integers, -1 (a root) or an earlier index."""
    p = np.asarray(parents)
    if p.ndim != 1 or len(p) != T or not (np.issubdtype(p.dtype, np.integer) or T == 0):
        return f"parents must be a 1-D integer array of {T} entries (one per draft token), got {parents!r}"
    bad = np.flatnonzero((p < -1) | (p >= np.arange(T)))
    if len(bad):
        return (f"parents[{bad[0]}] = {p[bad[0]]}: a draft token's parent must be -1 (the cache) or an earlier "
                f"draft token")
    return None


def path_problem(draft, accepted, length):
    """Why ``accepted`` is not a root-first path of the ``draft`` tree (k, v, parents, the cache's length when
    verified) of a cache of ``length`` tokens, or None."""
    if draft is None:
        return "commit needs a verify before it (and at most one commit per verify)"
    if draft[3] != length:
        return (f"commit follows a verify of drafts after {draft[3]} cached tokens, but the cache now holds {length} "
                f"(extend or prefill in between): the drafts would land after the new tokens; verify again")
    parents = draft[2]
    if np.any((accepted < 0) | (accepted >= len(parents))):
        return f"accepted draft indices must lie in 0..{len(parents) - 1}, got {accepted.tolist()}"
    above = parents[accepted]
    if len(accepted) and (above[0] != -1 or np.any(above[1:] != accepted[:-1])):
        return (f"accepted {accepted.tolist()} is not a path of the draft tree from a root (parents "
                f"{above.tolist()})")
    return None
