"""A KV cache sharded over the ranks: prefill through the ring, extend token by token, decode over MPI.

    mpiexec -n 4 python -m mpiring generate --prompt-len 4096 --new-tokens 16 --heads 8 --kv-heads 2 --dim 64

Every rank keeps its share of the cached tokens. ``placement`` says whose
share a token joins: "interleave" with ``interleave=n`` (vLLM's decode context
parallelism: runs of n positions dealt out in turn, position t on rank
(t // n) mod P), "round_robin" (the same with n = 1, SGLang's placement) or
"contiguous" (the prompt in contiguous blocks, each new token to the rank
with the fewest, the lowest such rank); shards stay within n tokens of each
other (one for "contiguous"). ``attend`` is
``decode_attention`` over the shards: every rank gets the same bits. ``verify`` and
``commit`` serve speculative decoding, ``adopt`` a prompt prefilled under another
layout, ``attend_many`` many sequences in one reduction.

``quantize`` stores the cache compressed ("float16", "int8"); each rank's
tokens live in a ``kvstore.KVStore``, dequantized a tile at a time during ``attend``.
"""

import time

import numpy as np
from mpi4py import MPI

from .core.kvstore import ERROR_BOUND, QUANTIZE, TILE, KVStore, quantize
from .core.record import Record
from .core.tiles import max_abs
from .decode import (
    computing,
    decode_agreement,
    decode_timeout,
    draft_partial,
    local_partial,
    lse_merge,
    merge_many,
    merge_partials,
    packed,
    parents_problem,
    renamed,
    spec_of,
    unpacked,
)
from .handle import ring_attention
from .mpi.agree import agree, agreed, check_comm, gather_entry
from .mpi.comm import RingComm
from .mpi.decoding import Decoding, by_content, path_problem
from .mpi.waits import exclusive, wait_until
from .plans.checks import Shown, describe, timeout_problem
from .plans.layouts import layout_positions

__all__ = ["KVCache", "attend_many", "PLACEMENTS", "QUANTIZE", "TILE", "ERROR_BOUND", "quantize"]

PLACEMENTS = ("round_robin", "interleave", "contiguous")


def interleave_problem(placement, interleave):
    """Why ``interleave`` does not fit ``placement``, or None: a positive integer, and 1 unless "interleave"."""
    if isinstance(interleave, bool) or not isinstance(interleave, (int, np.integer)) or interleave < 1:
        return f"interleave must be a positive integer, got {interleave!r}"
    if placement != "interleave" and interleave != 1:
        return f"interleave={interleave} needs placement='interleave' (placement {placement!r} has its own rule)"
    return None


class KVCache:
    """This rank's share of a KV cache over ``comm``; construction, prefill, extend and attend are collective.

    Args:
        comm: an mpi4py communicator; every rank constructs the cache alike.
        kv_heads, head_dim: K/V heads and their dim (V's dim: ``value_dim``, default head_dim).
        dtype: float32 or float64, the dtype of q, k, v given to the cache and of its results.
        quantize: None, "float16" or "int8": how the cache is stored.
        placement: "interleave", "round_robin" or "contiguous": which rank keeps each token.
        interleave: with "interleave", tokens per run: token t lives on rank (t // interleave) % P
            (vLLM's decode context parallelism); "round_robin" is interleave=1.
        shared_values: the values are the keys' last ``value_dim`` values, stored once (MLA's latent:
            keys [k_rope | c], values c; ``core.mla``); the calls then take v=None.
        timeout: as ``ring_attention``, for every call.

    Bad arguments on any rank raise the same ValueError on every rank.
    """

    def __init__(self, comm, kv_heads, head_dim, *, dtype=np.float32, quantize=None, placement="round_robin",
                 interleave=1, value_dim=None, shared_values=False, timeout="auto"):
        self.comm = check_comm(comm)
        problem = values = None
        try:
            value_dim = head_dim if value_dim is None else value_dim
            for name, n in (("kv_heads", kv_heads), ("head_dim", head_dim), ("value_dim", value_dim)):
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                    problem = problem or f"{name} must be a positive integer, got {n!r}"
            if np.dtype(dtype) not in (np.float32, np.float64):
                problem = problem or f"dtype must be float32 or float64, got {np.dtype(dtype)}"
            if quantize not in QUANTIZE:
                problem = problem or f"quantize must be None, 'float16' or 'int8'; got {quantize!r}"
            if placement not in PLACEMENTS:
                problem = problem or f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}"
            problem = problem or interleave_problem(placement, interleave)
            if not isinstance(shared_values, bool) or (shared_values and value_dim > head_dim):
                problem = problem or f"shared_values needs True or False and value_dim <= head_dim, got " \
                                     f"{shared_values!r} with {value_dim} > {head_dim}"
            problem = problem or timeout_problem(timeout)
            values = {name: Shown(value) for name, value in (
                ("kv_heads", kv_heads), ("head_dim", head_dim), ("value_dim", value_dim),
                ("dtype", np.dtype(dtype).name), ("quantize", quantize), ("placement", placement),
                ("interleave", interleave), ("shared_values", shared_values), ("timeout", timeout))}
        except Exception as exc:  # reported collectively, never raised alone
            problem, values = describe(exc), None
        with exclusive(self.comm):
            agreed(self.comm, problem, values, timeout, entry=True)
        self.kv_heads, self.head_dim, self.value_dim = int(kv_heads), int(head_dim), int(value_dim)
        self.dtype, self.quantize, self.placement, self.timeout = np.dtype(dtype), quantize, placement, timeout
        self.interleave = None if placement == "contiguous" else int(interleave)  # "round_robin": 1
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.lengths = [0] * self.size  # every rank's cached tokens, the same list on every rank
        self.shared_values = shared_values
        self.store = KVStore(self.kv_heads, self.head_dim, self.value_dim, self.dtype, quantize, shared_values)
        self._ring = None  # a private RingComm for exchange="ring", made at the first such attend
        self._draft = None  # the last verify's (k, v, parents), until commit

    # ---------------------------------------------------------------- what it holds

    def __len__(self):
        """Tokens in the whole cache (every rank's together)."""
        return sum(self.lengths)

    @property
    def positions(self):
        """Global positions of this rank's cached tokens, sorted."""
        return self.store.positions.copy()

    @property
    def nbytes(self):
        """Bytes of this rank's cached tokens as stored (``KVStore.nbytes``)."""
        return self.store.nbytes

    def shard(self):
        """This rank's cached ``(k, v)`` dequantized, (..., Hk, n, D), in position order (``attend`` works per tile)."""
        return self.store.shard()

    def prompt_positions(self, prompt_len):
        """The positions of a prompt of ``prompt_len`` tokens that this rank keeps under the placement."""
        if self.interleave is None:
            return layout_positions(prompt_len, self.size, "contiguous")[self.rank]
        every = np.arange(prompt_len)
        return every[self.owner(every) == self.rank]

    def owner(self, positions):
        """The rank that keeps each global position under an interleaved placement: (t // interleave) % P."""
        if self.interleave is None:
            raise ValueError("under placement='contiguous' a token's owner depends on the lengths when it came")
        return (np.asarray(positions, np.int64) // self.interleave) % self.size

    # ---------------------------------------------------------------- filling it

    def prefill(self, q, k, v, positions=None, *, causal=True, scale=None, record=None, **options):
        """Attention over the prompt through the ring (``ring_attention``); this rank keeps its K/V rows.

        ``q, k, v`` are this rank's prompt rows at ``positions`` (default:
        ``prompt_positions`` of the whole prompt; any partition of the prompt
        works, the placement then rules only the tokens that ``extend`` adds).
        Returns this rank's ``(out, lse)`` in the order of its rows. ``options``
        go to ``ring_attention`` (e.g. ``rotate``).
        """
        opens, v = positions is not None, self._values(k, v)  # else the prompt's length opens the call
        if positions is None:
            with exclusive(self.comm):
                total = sum(gather_entry(self.comm, int(np.shape(q)[-2]) if np.ndim(q) >= 2 else 0, self.timeout))
            positions = self.prompt_positions(total)
        rec = Record(self.rank) if record is None else record
        problem = None if not len(self) else f"prefill needs an empty cache; it holds {len(self)} tokens"
        with exclusive(self.comm):
            agree(self.comm, problem or self._shape_problem(k, v), self.timeout, entry=opens)
        out, lse = ring_attention(q, k, v, self.comm, causal=causal, scale=scale, positions=positions,
                                  timeout=self.timeout, record=rec, **options)
        self.lengths = [len(s) for s in rec.plan.kv_shards]
        order = np.argsort(np.asarray(positions, np.int64), kind="stable")
        self.store.append(np.asarray(k)[..., order, :], np.asarray(v)[..., order, :],
                     np.asarray(positions, np.int64)[order])
        return out, lse

    def adopt(self, k, v, positions, *, record=None):
        """Fill this empty cache with a prompt prefilled under another layout: each token moves to its owner.

        ``k, v``: this rank's prompt rows (..., kv_heads, n, D) at global ``positions``
        (n of them), as any strategy and layout left them, e.g. ``ring_attention``
        with ``layout="zigzag"`` or a ``Ring`` (``Ring.positions``); together the
        ranks hold positions 0..S-1 once each. One all-to-all sends every token
        whose owner under this cache's placement (``prompt_positions(S)``) is
        another rank, straight to it, and nothing else: ``record.bytes_sent`` is
        ``infercost.relayout_bytes`` (the tokens as given, K and V). Collective.
        """
        rec, v = Record(self.rank) if record is None else record, self._values(k, v)
        with exclusive(self.comm):
            problem = None if not len(self) else f"adopt needs an empty cache; it holds {len(self)} tokens"
            try:
                problem = problem or self._shape_problem(k, v)
                positions = np.asarray(positions)
                if problem is None and (positions.ndim != 1 or len(positions) != k.shape[-2] or not (
                        np.issubdtype(positions.dtype, np.integer) or len(positions) == 0)):
                    problem = f"positions must be a 1-D integer array of this rank's {k.shape[-2]} token positions"
            except Exception as exc:  # reported collectively, never raised alone
                problem = describe(exc)
            held = agreed(self.comm, problem, None, self.timeout,
                          None if problem else np.asarray(positions, np.int64), entry=True)
            every = np.concatenate(held)
            if not np.array_equal(np.sort(every), np.arange(len(every))):
                raise ValueError(f"adopt needs positions 0..{len(every) - 1} held once each across the ranks")
        start = time.perf_counter()
        owners = [self._prompt_owners(p, len(every)) for p in held]
        mine = owners[self.rank]
        order = np.argsort(mine, kind="stable")
        rows = np.concatenate([np.moveaxis(x, -2, 0).reshape(len(mine), int(np.prod(x.shape[:-2])) * x.shape[-1])
                               for x in (k, v)[:2 - self.shared_values]], axis=1)[order]  # a token's K (and V)
        out = [int(np.count_nonzero(mine == r)) for r in range(self.size)]
        into = [int(np.count_nonzero(o == self.rank)) for o in owners]
        got = np.empty((sum(into), rows.shape[1]), rows.dtype)
        width = rows.shape[1] * rows.itemsize
        send = [rows, (np.multiply(out, width), np.cumsum([0] + out[:-1]) * width), MPI.BYTE]
        wait_until([self.comm.Ialltoallv(send, [got, (np.multiply(into, width), np.cumsum([0] + into[:-1]) * width),
                                                   MPI.BYTE])], decode_timeout(self.timeout, k, v, into),
                   self.rank, "adopt (all-to-all)")
        rec.bytes_sent += (len(mine) - out[self.rank]) * width
        rec.messages += sum(1 for r, n in enumerate(out) if n and r != self.rank)
        rec.event("relayout", start)
        pos = np.concatenate([p[o == self.rank] for p, o in zip(held, owners)])
        order = np.argsort(pos, kind="stable")
        got, split = got[order], int(np.prod(k.shape[:-2])) * self.head_dim
        parts = ((got[:, :split], self.head_dim), (got[:, split:], self.value_dim))[:2 - self.shared_values]
        k, *v = (np.ascontiguousarray(np.moveaxis(part.reshape((len(pos),) + k.shape[:-2] + (dim,)), 0, -2))
                 for part, dim in parts)
        v = v[0] if v else self._values(k, None)
        self.lengths = [int(sum(np.count_nonzero(o == r) for o in owners)) for r in range(self.size)]
        self.store.append(k, v, pos[order])

    def _prompt_owners(self, positions, prompt_len):
        """The rank that keeps each of ``positions`` of a prompt of ``prompt_len`` tokens (``prompt_positions``)."""
        if self.interleave is not None:
            return self.owner(positions)
        starts = [len(p) for p in layout_positions(prompt_len, self.size, "contiguous")]
        return np.searchsorted(np.cumsum(starts), positions, side="right")

    def extend(self, k, v=None):
        """Append new tokens (``k, v`` (..., kv_heads, T, D), the same on every rank): each owner keeps its own."""
        v = self._values(k, v)
        with exclusive(self.comm):
            problem = values = None
            try:
                problem = self._shape_problem(k, v)
                if problem is None:  # extend takes the same new tokens on every rank
                    values = {"new k": by_content("new k", k), "new v": by_content("new v", v)}
            except Exception as exc:  # reported collectively, never raised alone
                problem, values = describe(exc), None
            agreed(self.comm, problem, values, self.timeout, entry=True)
        self._add(k, v)

    def _add(self, k, v):
        """Keep this rank's share of new tokens ``k, v`` at positions len(self) ... (agreed already)."""
        first = len(self)
        owners = self._owners(k.shape[-2])
        mine = np.flatnonzero(owners == self.rank)
        for r in owners:
            self.lengths[r] += 1
        self.store.append(k[..., mine, :], v[..., mine, :], first + mine)

    def _owners(self, n):
        """The rank that keeps each of ``n`` new tokens (positions len(self) ...), the same on every rank."""
        if self.interleave is not None:
            return self.owner(len(self) + np.arange(n))
        lengths, owners = list(self.lengths), []
        for _ in range(n):
            r = int(np.argmin(lengths))
            owners.append(r)
            lengths[r] += 1
        return np.array(owners, np.int64)

    def _values(self, k, v):
        """``v``, or with ``shared_values`` and v None, the last value_dim values of k's rows (a view)."""
        if self.shared_values and v is None and isinstance(k, np.ndarray) and k.ndim:
            return k[..., self.head_dim - self.value_dim:]
        return v

    def _shape_problem(self, k, v):
        for name, a, dim in (("k", k, self.head_dim), ("v", v, self.value_dim)):
            if not isinstance(a, np.ndarray) or a.dtype != self.dtype:
                return f"{name} must be a {self.dtype} array"
            if a.ndim < 3 or a.shape[-3] != self.kv_heads or a.shape[-1] != dim:
                return f"{name} must have shape (..., {self.kv_heads}, tokens, {dim}), got {a.shape}"
            if self.store.lead is not None and a.shape[:-3] != self.store.lead:
                return f"{name} must have the cache's batch axes {self.store.lead}, got {a.shape}"
        if k.shape[:-1] != v.shape[:-1]:
            return f"k and v must agree on all but the last axis, got {k.shape} and {v.shape}"
        if self.shared_values and not np.array_equal(v, self._values(k, None)):
            return "this cache's values are its keys' last value_dim values (shared_values): give v=None"
        return None

    # ---------------------------------------------------------------- decoding

    def attend(self, q, *, causal=False, positions=None, exchange="tree", scale=None, record=None, spec=None,
               merge=None, **options):
        """``decode_attention`` of ``q`` (..., Hq, T, D), the same on every rank, over the whole cache.

        Every rank returns the same ``(out, lse)``. With ``causal``, query i sees
        the cached tokens at positions <= positions[i] (default: the last T
        positions, the tokens just added with ``extend``). ``options``: ``mask``, ``softcap``,
        ``bias``, ``sinks``, ``score_mod`` as ``decode_attention`` takes them (the same default positions).
        ``spec``: a ``Spec`` giving these instead (the cache knows where its keys are). ``exchange``: as
        ``decode_attention`` (``merge=``: its former name, deprecated).
        """
        exchange = renamed({} if merge is None else {"merge": merge}, exchange)
        with exclusive(self.comm):
            (scale, causal, positions, _), problem, scores = spec_of(
                spec, scale, causal, positions, None, who="KVCache.attend", scores=options)
            if (causal or scores) and positions is None:
                positions = np.arange(len(self) - np.shape(q)[-2], len(self)) if np.ndim(q) >= 2 else None
            problem = problem or (scores and scores.problem(q, positions, self.store.positions))
            call = Decoding(scale, self.timeout, exchange, causal, positions, self.store.positions)
            return self._attend(q, call, record, problem, scores=scores)

    def verify(self, q, k, v, parents=None, *, exchange="tree", scale=None, record=None, merge=None):
        """Speculative verification: T draft tokens' attention in one call, nothing added to the cache yet.

        ``q`` (..., Hq, T, D), ``k, v`` (..., kv_heads, T, D): the draft tokens, the
        same on every rank. ``parents[i]``: draft token i's parent (-1: it follows
        the last cached token), a chain ``[-1, 0, ..., T - 2]`` by default, or a
        tree as Medusa/EAGLE build them (parents before children). Draft token i
        sees the whole cache and, among the drafts, itself and its ancestors
        (``decode.draft_mask``). Returns ``(out, lse)``, the same bits on every
        rank; the drafts are held until ``commit`` keeps the accepted ones.
        """
        v = self._values(k, v)
        with exclusive(self.comm):
            problem = values = None
            try:
                T = np.shape(q)[-2] if np.ndim(q) >= 2 else 0
                parents = np.arange(-1, T - 1) if parents is None else parents
                problem = self._shape_problem(k, v) or parents_problem(parents, T) or (
                    None if k.shape[-2] == T else f"{k.shape[-2]} draft k/v tokens for {T} draft queries")
                if problem is None:
                    parents = np.asarray(parents, np.int64)
                    values = {"draft k": by_content("draft k", k), "draft v": by_content("draft v", v),
                              "parents": by_content("parents", parents, str(parents.tolist()))}
            except Exception as exc:  # reported collectively, never raised alone
                problem, values = describe(exc), None
            self._draft = None
            call = Decoding(scale, self.timeout, exchange, kv_positions=self.store.positions)
            result = self._attend(q, call, record, problem, values=values, draft=(k, v, parents))
            self._draft = (k.copy(), v.copy(), parents, len(self))  # T tokens: safe from the caller's later writes
            return result

    def commit(self, accepted):
        """Keep the accepted draft tokens of the last ``verify``, drop the rest: no copy of the cache.

        ``accepted``: indices of the draft tokens, root first, each the parent of the
        next (a path of the draft tree; empty: none kept), the same on every rank.
        They join the cache at positions len(self), len(self) + 1, ... by the
        placement's rule, as ``extend`` would add them. Collective.
        """
        with exclusive(self.comm):
            problem = values = None
            try:
                given = np.asarray(accepted)
                if given.size and given.dtype.kind not in "iu":
                    problem = f"accepted must be integer indices of draft tokens, got {given.dtype}: {given.tolist()}"
                accepted = given.astype(np.int64).reshape(-1)
                problem = problem or path_problem(self._draft, accepted, len(self))
                values = {"accepted": Shown(accepted)}
            except Exception as exc:  # reported collectively, never raised alone
                problem = describe(exc)
            agreed(self.comm, problem, values, self.timeout, entry=True)
        k, v = self._draft[:2]
        self._draft = None
        self._add(k[..., accepted, :], v[..., accepted, :])

    def _attend(self, q, call, record, problem, values=None, draft=None, scores=None):
        """``q`` over this rank's tiles (``call``: the ``Decoding`` options), merged with every rank's; with
        ``draft``, its tree part merged after."""
        k_like, v_like = self._like(q)
        problem = problem or self._q_problem(q)
        k_peak = self.store.k_peak if draft is None or problem or not draft[0].size else \
            max(self.store.k_peak, max_abs(draft[0]))
        rec = Record(self.rank) if record is None else record

        @computing(rec)
        def work(scale):  # this rank's tiles (and the user's functions on them), before the agreement
            own = None if call.positions is None else np.asarray(call.positions, np.int64)
            return local_partial(np.ascontiguousarray(q), self.store.tiles(), scale, own, call.causal, padded=True,
                                 scores=scores)

        scale, lengths, (out, lse) = decode_agreement(
            self.comm, q, k_like, v_like, call, k_peak=k_peak, problem=problem,
            values={**(values or {}), **(scores.values() if scores else {})}, work=work)
        timeout = decode_timeout(self.timeout, q, v_like, lengths)
        start = time.perf_counter() - work.seconds
        rows = merge_partials(packed(out, lse), self.comm, call.exchange, timeout,
                              ring=self._ring_for(call.exchange, timeout), rec=rec)
        if draft is not None:  # the drafts among themselves: the same inputs and bits on every rank
            lse_merge(packed(*draft_partial(np.ascontiguousarray(q), draft[0], draft[1], draft[2], scale)), rows)
        rec.wall_time = time.perf_counter() - start
        out, lse = unpacked(rows, out.shape, q.dtype)
        return (out, lse) if scores is None else scores.finish(out, lse)

    def _like(self, q):
        """Stand-ins of this rank's cached k and v with their shapes (no data), for ``decode_agreement``."""
        lead = self.store.lead if self.store.lead is not None else np.shape(q)[:-3]
        return tuple(np.broadcast_to(np.zeros((), self.dtype), lead + (self.kv_heads, self.store.n, d))
                     for d in (self.head_dim, self.value_dim))

    def _q_problem(self, q):
        return None if isinstance(q, np.ndarray) and q.dtype == self.dtype else \
            f"q must be a {self.dtype} array, as the cache"

    def _ring_for(self, exchange, timeout):
        """The private ``RingComm`` of the ring merge, made at the first such call (None otherwise)."""
        if exchange == "ring" and self._ring is None and self.size > 1:
            self._ring = RingComm(self.comm, timeout)
        return self._ring

    def close(self):
        """Free the private communicator of the ring merge (if one was made)."""
        if self._ring is not None:
            self._ring.free()
            self._ring = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def attend_many(caches, qs, *, exchange="tree", scale=None, record=None, comm=None, timeout=None, merge=None):
    """Continuous batching: the new tokens ``qs[i]`` of sequence i over ``caches[i]``, one agreement, one merge.

    ``caches``: ``KVCache`` objects on one communicator, one per sequence (any
    lengths, placements and batch axes; one dtype and head dim); ``qs``: each
    sequence's queries (..., Hq, T_i, D), the same on every rank. Returns
    ``[(out, lse), ...]``, the same bits on every rank: what ``attend`` gives
    for each sequence (unmasked), with one reduction for the whole batch
    (``decode.merge_many``) instead of one per sequence (``merge=``: ``exchange``'s former name). ``comm`` and
    ``timeout``: the caches' own, for a rank that passes none (it still joins the agreement and raises its
    ValueError with every rank): default COMM_WORLD and "auto".
    """
    exchange = renamed({} if merge is None else {"merge": merge}, exchange)
    problem, likes, peaks = None, [], []
    try:
        if not isinstance(caches, (list, tuple)) or not isinstance(qs, (list, tuple)):
            problem = "caches and qs must be lists, one entry per sequence"
        elif not caches:
            problem = "attend_many needs at least one cache"
        elif len(caches) != len(qs):
            problem = f"{len(caches)} caches for {len(qs)} query arrays"
        elif not all(isinstance(c, KVCache) for c in caches):
            problem = "caches must be KVCache objects"
        elif any(c.comm is not caches[0].comm for c in caches):
            problem = "every cache of one attend_many must be on the same communicator object"
        for i, (cache, q) in enumerate(zip(caches, qs) if problem is None else ()):
            found = cache._q_problem(q)
            problem = problem or (found and f"sequence {i}: {found}")
        if problem is None:
            likes = [cache._like(q) for cache, q in zip(caches, qs)]
            peaks = [c.store.k_peak for c in caches]
    except Exception as exc:  # reported collectively, never raised alone
        problem, likes, peaks = describe(exc), [], []
    comm = check_comm(caches[0].comm if problem is None else comm)  # a rank without caches: ``comm``
    first = caches[0] if problem is None else None
    timeout = first.timeout if first is not None else "auto" if timeout is None else timeout
    with exclusive(comm):
        rec = Record(comm.Get_rank()) if record is None else record

        @computing(rec)
        def work(scale):
            return [local_partial(np.ascontiguousarray(q), cache.store.tiles(), scale, padded=True)
                    for cache, q in zip(caches, qs)]

        scale, lengths, parts = decode_agreement(
            comm, list(qs)[:len(likes)], [k for k, _ in likes], [v for _, v in likes],
            Decoding(scale, timeout, exchange), k_peak=peaks, problem=problem, values={"timeout": Shown(timeout)},
            work=work)
        timeout = decode_timeout(first.timeout, max(qs, key=np.size), likes[0][1], lengths)
        start = time.perf_counter() - work.seconds
        result = merge_many(parts, comm, exchange, timeout, ring=first._ring_for(exchange, timeout), rec=rec,
                            dtype=first.dtype)
        rec.wall_time = time.perf_counter() - start
        return result
