"""Decoding over MPI (flash-decoding): the same new tokens on every rank against a KV cache sharded over the ranks.

    mpiexec -n 4 python -m mpiring generate --prompt-len 4096 --new-tokens 16 --heads 8 --kv-heads 2 --dim 64

Every rank attends the new queries to its own cache shard (``block.accumulators``
and ``attention_block``: the ring's kernel and merge), giving a partial
``(out, lse)``; the partials are then merged with the log-sum-exp rule, so
that every rank ends with the same bits:

- ``exchange="tree"``: one ``MPI_Allreduce`` whose operation is the merge
  (``lse_merge`` as a user-defined op): log2 P latency terms (Tree Attention, 2024);
- ``exchange="ring"``: the partials travel the ring (P - 1 steps, each rank passes
  on what it received), then every rank merges them in rank order.

The merge is ``core.kernels.merge_commutative``: the ring's rule in its max-then-sum form,
commutative to the bit, so however MPI pairs the partials up, both ranks of a pair compute the same bits.
Partials and the merge are float64 whatever the input dtype; the result is cast back at the end.

Masks: by default every new token sees the whole cache. With ``causal=True``
and the global ``positions`` of the new tokens (the same on every rank) and
``kv_positions`` of this rank's cache rows, key j is visible to query i iff
kv_positions[j] <= positions[i]: new tokens already appended to the cache see
each other causally, as in a prefill.
"""

import time
import warnings

import numpy as np
from mpi4py import MPI

from .core.kernels import attention_block, merge_commutative
from .core.record import Record
from .core.scores import Score, attend_general, with_sinks
from .mpi.agree import check_comm
from .mpi.comm import RingComm
from .mpi.decoding import EXCHANGES, Decoding, decode_agreement, decode_timeout, parents_problem
from .mpi.waits import exclusive, wait_until
from .plans.checks import Shown
from .plans.content import described
from .plans.plan import Piece, Where
from .plans.spec import Spec, spec_problem
from .plans.visibility import combined

__all__ = ["decode_attention", "decode_many", "EXCHANGES", "renamed", "lse_merge", "merge_partials",
           "local_partial", "decode_agreement", "decode_timeout", "draft_mask", "draft_partial", "parents_problem",
           "computing"]


def __getattr__(name):
    if name == "MERGES":  # EXCHANGES' former name
        warnings.warn("mpiring.decode.MERGES is now EXCHANGES", DeprecationWarning, stacklevel=2)
        return EXCHANGES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- the merge as an MPI reduction


def lse_merge(a, b):
    """Merge rows ``a`` into ``b`` in place: each row is ``[out (Dv values), lse]`` in float64
    (``kernels.merge_commutative``: commutative to the bit, NaN-free when either or both lse are -inf)."""
    merge_commutative(b[:, :-1], b[:, -1], a[:, :-1], a[:, -1], into=(b[:, :-1], b[:, -1]))


def _reduce(inbuf, inoutbuf, datatype):
    """The user-defined op: ``inoutbuf = lse_merge(inbuf, inoutbuf)``, rows of ``datatype.extent`` bytes."""
    width = datatype.Get_extent()[1] // 8
    lse_merge(np.frombuffer(inbuf, np.float64).reshape(-1, width),
              np.frombuffer(inoutbuf, np.float64).reshape(-1, width))


def packed(out, lse):
    """``(out, lse)`` as one float64 array of rows ``[out, lse]`` (..., Dv + 1) flattened to (rows, Dv + 1)."""
    rows = np.empty(lse.shape + (out.shape[-1] + 1,), np.float64)
    rows[..., :-1] = out
    rows[..., -1] = lse
    return rows.reshape(-1, rows.shape[-1])


def merge_partials(rows, comm, exchange, timeout=None, ring=None, rec=None):
    """Merge every rank's partial ``rows`` (``packed``) into one, the same bits on every rank.

    ``tree``: one non-blocking all-reduce on ``comm`` whose op is ``lse_merge``. ``ring``:
    P - 1 shifts on ``ring`` (a ``RingComm``; one is made and freed if None), then
    the partials merged in rank order. Returns the merged rows.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return rows
    start = time.perf_counter()
    if exchange == "tree":
        result = np.empty_like(rows)
        # the op, and a datatype of one row (a reduction never splits a row between two calls of the op);
        # freed when the call ends (MPI keeps them for a reduction still pending after a timeout)
        op, rtype = MPI.Op.Create(_reduce, commute=True), MPI.DOUBLE.Create_contiguous(rows.shape[1]).Commit()
        try:
            wait_until([comm.Iallreduce([rows, rows.shape[0], rtype], [result, rows.shape[0], rtype], op=op)],
                       timeout, rank, "decode merge (all-reduce)")
        finally:
            rtype.Free()
            op.Free()
        if rec is not None:
            rec.bytes_sent += rows.nbytes * int(np.ceil(np.log2(size)))  # recursive doubling, as modelled
            rec.messages += int(np.ceil(np.log2(size)))
    else:
        own = ring is None
        ring = RingComm(comm, timeout) if own else ring
        try:
            parts = [None] * size
            parts[rank] = rows
            held = rows
            for step in range(1, size):  # at step s the partial of rank - s arrives
                incoming = np.empty_like(rows)
                ring.shift({+1: (held,)}, {+1: (incoming,)})
                ring.wait(timeout)
                parts[(rank - step) % size] = held = incoming
            if rec is not None:
                rec.bytes_sent += rows.nbytes * (size - 1)
                rec.messages += size - 1
        finally:
            if own:
                ring.free()
        result = parts[0].copy()
        for part in parts[1:]:
            lse_merge(part, result)
    if rec is not None:
        rec.event("merge", start, exchange=exchange)
    return result


# ---------------------------------------------------------------- this rank's partial


def local_partial(q, blocks, scale, positions=None, causal=False, padded=False, scores=None):
    """This rank's float64 partial ``(out, lse)`` of ``q`` over ``blocks`` of its cache: ``(k, v, kv_positions)``.

    Each block goes through the ring's kernel (``attention_block``) and is
    merged into the running result tile by tile (``into=``). ``padded``: the
    blocks are the kernel's [k | 1]^T, [v | 1]^T (tokens on the last axis). With
    ``causal``, a block's ``kv_positions`` must be sorted: row i sees the keys at positions <= positions[i].
    ``scores``: a ``Scores`` (a mask and score modifiers): every block through the general kernel instead.
    """
    if scores is not None:
        return scores.partial(q, blocks, scale, positions, causal, padded)
    out = acc_lse = None
    for k, v, kv_pos in blocks:
        if out is None:
            dv = v.shape[-2] - 1 if padded else v.shape[-1]
            out = np.zeros(q.shape[:-1] + (dv,), np.float64)
            acc_lse = np.full(q.shape[:-1], -np.inf, np.float64)
        if k.shape[-1 if padded else -2] == 0:
            continue
        klo = khi = None
        if causal:
            khi = np.searchsorted(kv_pos, positions, side="right").astype(np.int64)
            klo = np.zeros_like(khi)
        attention_block(q, k, v, scale, klo, khi, padded=padded, into=(out, acc_lse))
    return out, acc_lse


# ---------------------------------------------------------------- speculative drafts: the tree mask


def draft_mask(parents):
    """Boolean (T, T): draft token i sees draft token j iff j is i or one of its ancestors (Medusa/EAGLE trees).

    ``parents[i]``: the index of token i's parent, -1 for a child of the last cached token; a chain is
    ``[-1, 0, 1, ...]``. Parents come before their children.
    """
    parents = np.asarray(parents, np.int64)
    mask = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def draft_partial(q, k, v, parents, scale):
    """Float64 ``(out, lse)`` of the draft queries ``q`` over the draft tokens ``k, v`` under ``draft_mask``.

    Each query row attends the rows its mask keeps, through the ring's kernel. The same bits on every
    rank that calls it with the same arguments.
    """
    out = np.zeros(q.shape[:-1] + (v.shape[-1],), np.float64)
    lse = np.full(q.shape[:-1], -np.inf, np.float64)
    for i, seen in enumerate(draft_mask(parents)):
        keep = np.flatnonzero(seen)
        row = (np.zeros_like(out[..., i:i + 1, :]), np.full_like(lse[..., i:i + 1], -np.inf))
        attention_block(q[..., i:i + 1, :], k[..., keep, :], v[..., keep, :], scale, into=row)
        out[..., i, :], lse[..., i] = row[0][..., 0, :], row[1][..., 0]
    return out, lse


# ---------------------------------------------------------------- agreement


DECODE_FIELDS = ("scale", "causal", "positions", "kv_positions")
SCORE_FIELDS = ("mask", "softcap", "bias", "score_mod", "sinks")  # decoding's masks and scores (no dropout, no max
# logit; no backward, so no score_mod_grad)


def spec_of(spec, *values, who="decode_attention", scores=None):
    """``((scale, causal, positions, kv_positions), problem, Scores or None)``: the values as given, or with a
    ``spec`` its (values given beside it must be its own; the rest of the spec must be at its defaults or a
    mask and score option, ``SCORE_FIELDS``). ``scores``: the mask and score keywords given."""
    scores = scores or {}
    if spec is None:  # the keywords alone: a field decoding does not take is refused as a spec's would be
        agreed, problem = spec_problem(scores)
        problem = problem or agreed.beyond(DECODE_FIELDS + SCORE_FIELDS, who)
        return values, problem, None if problem else Scores.of(agreed)
    agreed, problem = spec_problem({**dict(zip(DECODE_FIELDS, values)), **scores}, spec)
    problem = problem or agreed.beyond(DECODE_FIELDS + SCORE_FIELDS, who)
    if problem:
        return values, problem, None
    return tuple(getattr(agreed, name) for name in DECODE_FIELDS), None, Scores.of(agreed)


class Scores:
    """A decoding call's mask pieces (``spec.mask``) and score modifiers (softcap, bias, sinks): each block through
    the general kernel (``core.scores``) with global positions, the sinks once after the merge."""

    def __init__(self, spec):
        self.spec, self.mask = spec, tuple(spec.mask)

    @classmethod
    def of(cls, spec):
        plain = (not spec.mask and spec.softcap is None and spec.bias is None and spec.sinks is None
                 and spec.score_mod is None)
        return None if plain else cls(spec)

    def problem(self, q, positions, kv_positions):
        """Why this rank's call cannot run these scores, or None: they need every token's global position."""
        if positions is None or kv_positions is None:
            return "a mask or score modifier in decoding needs positions (of q) and kv_positions (of the cache)"
        reach = int(np.max(np.asarray(positions), initial=-1)) + 1  # a piece made for a sequence refuses others
        return next(filter(None, (piece.problem(reach) for piece in self.mask)), None) or self.spec.scores_problem(q)

    def values(self):
        """What every rank must give alike: the pieces and functions by what they are."""
        return {name: Shown(None, described(getattr(self.spec, name)), self.spec.field_content(name))
                for name in SCORE_FIELDS}

    def partial(self, q, blocks, scale, positions, causal, padded):
        out = np.zeros(q.shape[:-1] + (0,))
        lse = np.full(q.shape[:-1], -np.inf)
        rule = combined(causal=causal, mask=self.mask)
        score = Score.of(self.spec, scale)
        for k, v, kv_pos in blocks:
            if out.shape[-1] == 0:
                out = np.zeros(q.shape[:-1] + ((v.shape[-2] - 1) if padded else v.shape[-1],))
            n = k.shape[-1 if padded else -2]
            if n:
                where = Where(np.asarray(positions, np.int64), np.asarray(kv_pos, np.int64)[:n], rule)
                attend_general(q, k, v, Piece(0, q.shape[-2], 0, n, where=where), score, (out, lse), padded)
        return out, lse

    def finish(self, out, lse):
        """The sinks, once, in the merged result (the same on every rank)."""
        return (out, lse) if self.spec.sinks is None else with_sinks(out, lse, self.spec.sinks)


# ---------------------------------------------------------------- the entry point


def decode_attention(
    q: np.ndarray,  # (..., Hq, T, D): the same new tokens on every rank
    k: np.ndarray,  # (..., Hk, n, D): this rank's cache shard, any n >= 0
    v: np.ndarray,  # (..., Hk, n, Dv)
    comm=None, *, spec: Spec | None = None, causal: bool = False, positions=None, kv_positions=None,
    exchange: str = "tree", timeout: float | str | None = "auto", record: Record | None = None, **options,
) -> tuple[np.ndarray, np.ndarray]:  # out (..., Hq, T, Dv), lse (..., Hq, T): the same bits on every rank
    """Attention of the same new tokens ``q`` (on every rank) over the KV cache sharded across the ranks.

    Every rank computes its shard's partial (out, lse) and the partials are
    merged with the log-sum-exp rule (``core.kernels.merge``), exchanged as ``exchange`` says ("tree": an
    all-reduce whose op is the merge, log2 P steps; "ring": P - 1 steps around the ring).
    Every rank returns the same ``(out, lse)``, identical to the bit.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD).
        exchange: "tree" or "ring" (``merge=``, its former name, still works, with a DeprecationWarning).
        causal: with ``positions`` (of q's tokens, the same on every rank) and
            ``kv_positions`` (of this rank's k, v rows): key j visible to query i
            iff kv_positions[j] <= positions[i]. Off: every new token sees every key.
        timeout: as ``ring_attention``: seconds any wait may take, "auto" or None.
        record: a ``Record`` to fill ("compute" and "merge" events, bytes sent).
        options: ``scale`` (default 1/sqrt(dim)), and ``mask``, ``softcap``, ``bias``, ``score_mod``, ``sinks`` as
            ``ring_attention`` takes them (docs/masks.md), with ``positions`` and ``kv_positions`` (the pieces and
            the bias see global positions); no dropout, no max logit.
        spec: a ``Spec`` giving these options instead (``spec_of``).

    Bad arguments on any rank (mismatched heads, q different across ranks, a
    bad option) raise the same ``ValueError`` on every rank.
    """
    comm = check_comm(comm)
    exchange = renamed(options, exchange)
    with exclusive(comm):
        (scale, causal, positions, kv_positions), problem, scores = spec_of(
            spec, options.pop("scale", None), causal, positions, kv_positions, scores=options)
        problem = problem or (scores and scores.problem(q, positions, kv_positions))
        rec = Record(comm.Get_rank()) if record is None else record

        @computing(rec)
        def work(scale):  # this rank's partial, before the agreement: a failing mask or bias is agreed
            blocks, pos = [(k, v, kv_positions)], positions
            if causal and scores is None:
                order = np.argsort(np.asarray(kv_positions, np.int64), kind="stable")
                blocks = [(k[..., order, :], v[..., order, :], np.asarray(kv_positions, np.int64)[order])]
                pos = np.asarray(positions, np.int64)
            contiguous = [tuple(np.ascontiguousarray(a) for a in b[:2]) + b[2:] for b in blocks]
            return local_partial(np.ascontiguousarray(q), contiguous, scale, pos, causal, scores=scores)

        call = Decoding(scale, timeout, exchange, causal, positions, kv_positions)
        scale, lengths, (out, lse) = decode_agreement(comm, q, k, v, call, problem=problem,
                                                      values=scores and scores.values(), work=work)
        timeout = decode_timeout(timeout, q, v, lengths)
        start = time.perf_counter() - work.seconds  # the call's wall time: its compute and its merge
        rows = merge_partials(packed(out, lse), comm, exchange, timeout, rec=rec)
        rec.wall_time = time.perf_counter() - start
        out, lse = unpacked(rows, out.shape, q.dtype)
        return (out, lse) if scores is None else scores.finish(out, lse)


def decode_many(
    qs: list,  # per sequence (..., Hq, T_s, D): the same on every rank
    ks: list,  # per sequence (..., Hk, n_s, D): this rank's shard of that sequence's cache, any n_s >= 0
    vs: list,  # per sequence (..., Hk, n_s, Dv)
    comm=None, *, scale: float | None = None, exchange: str = "tree", timeout: float | str | None = "auto",
    record: Record | None = None, merge: str | None = None,
) -> list:  # per sequence (out, lse), the same bits on every rank
    """Many sequences' new tokens at once (continuous batching): each over its own sharded cache, one merge.

    As ``decode_attention`` for each sequence, with one agreement and one
    reduction for the whole batch: the partials of every sequence travel as
    one array of rows. Sequences may differ in cache length (by orders of
    magnitude), in new tokens and in batch axes; they share dtype and head dims.
    """
    comm = check_comm(comm)
    exchange = renamed({} if merge is None else {"merge": merge}, exchange)
    with exclusive(comm):
        problem = None
        if not all(isinstance(x, (list, tuple)) for x in (qs, ks, vs)) or not (len(qs) == len(ks) == len(vs) > 0):
            problem, qs, ks, vs = "qs, ks, vs must be lists of one entry per sequence, at least one", [], [], []
        rec = Record(comm.Get_rank()) if record is None else record

        @computing(rec)
        def work(scale):
            return [local_partial(np.ascontiguousarray(q), [(np.ascontiguousarray(k), np.ascontiguousarray(v), None)],
                                  scale) for q, k, v in zip(qs, ks, vs)]

        scale, lengths, parts = decode_agreement(comm, list(qs), list(ks), list(vs), Decoding(scale, timeout, exchange),
                                                 problem=problem, work=work)
        timeout = decode_timeout(timeout, max(qs, key=np.size), vs[0], lengths)
        start = time.perf_counter() - work.seconds
        result = merge_many(parts, comm, exchange, timeout, rec=rec, dtype=qs[0].dtype)
        rec.wall_time = time.perf_counter() - start
        return result


def renamed(options, exchange):
    """``exchange``, or a ``merge=`` among ``options`` (its former name: taken out, with a DeprecationWarning;
    ``decode_many`` and ``KVCache`` take it as ``merge=None``)."""
    if "merge" not in options:
        return exchange
    warnings.warn("decoding's merge= option is now exchange= (how the partials travel; the merge is always the "
                  "log-sum-exp rule)", DeprecationWarning, stacklevel=3)
    return options.pop("merge")


def computing(rec):
    """``work`` recorded in ``rec`` as the call's "compute" event (its seconds in ``work.seconds``): a decoding
    call computes its partial before the agreement (``decode_agreement(work=...)``)."""
    def wrap(work):
        def timed(scale):
            start = time.perf_counter()
            done = work(scale)
            timed.seconds = rec.event("compute", start, kind="decode") - start
            rec.compute_time += timed.seconds
            return done
        timed.seconds = 0.0
        return timed
    return wrap


def merge_many(parts, comm, exchange, timeout, ring=None, rec=None, dtype=np.float64):
    """Every rank's partials ``[(out, lse), ...]`` (one per sequence) merged in one ``merge_partials``."""
    rows = [packed(out, lse) for out, lse in parts]
    merged = merge_partials(np.concatenate(rows), comm, exchange, timeout, ring=ring, rec=rec)
    ends = np.cumsum([len(r) for r in rows])
    return [unpacked(merged[end - len(r):end], out.shape, dtype) for r, end, (out, _) in zip(rows, ends, parts)]


def unpacked(rows, out_shape, dtype):
    """Merged rows back to ``(out, lse)`` in ``dtype``."""
    rows = rows.reshape(out_shape[:-1] + (out_shape[-1] + 1,))
    return rows[..., :-1].astype(dtype), rows[..., -1].astype(dtype)
