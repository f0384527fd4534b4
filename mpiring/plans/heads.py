"""Ulysses (DeepSpeed-Ulysses): heads move, not K/V blocks. The plan and its bytes; no MPI.

    python -m mpiring schedule -P 4 --mode ulysses --causal --layout zigzag

One all-to-all turns every rank's sequence shard of all heads into all tokens
of its share of the heads: rank d gets its run of query heads (``deal_heads``,
``d*Hq/P .. (d+1)*Hq/P`` when P divides Hq) of every rank's tokens. It attends
them over the whole sequence with the same block code as the ring
(``block.attend`` / ``block.grads_of``), and a second all-to-all returns each
rank's tokens.

After the first all-to-all a rank holds the tokens in shard order (rank 0's
positions, then rank 1's, ...). It puts the rows in position order once
(``UlyssesPlan.order``: a permutation, None for the contiguous layout, whose
shards already are), so that whatever the layout every query sees one
interval of the sorted keys (``masks.visible_keys``). Key block j is then the
j-th run of sorted keys, as many as rank j holds (rank j's own keys with the
contiguous layout), and the queries against it are one piece: the rows that
see some of its keys, with each row's interval (``UlyssesPlan.block_pieces``).
So a rank calls the kernel once per key block that some query sees, at most
P times a pass, whatever the layout (with zigzag or striped shards in shard
order it was once per query shard and key block, O(P^2)); the kernel's tiles
skip what the intervals leave out, as under the ring's diagonal blocks. The
results go back to shard order before the second all-to-all.

Heads: any number of query heads Hq >= P (``deal_heads``). Each rank gets a
run of query heads, as evenly as possible (Hq // P or one more: the compute
is Hq/P heads' whatever the split), and the K/V heads those use. Which ranks
take the one more is chosen to keep GQA groups whole where they can be: a
group split between two ranks sends its K/V head to both, so the deal takes,
of the even splits, one that sends the fewest K/V heads (then the one whose
ranks hold the fewest, below). With Hk dividing P or divisible by it and Hq
divisible by P the deal is the even one: Hk/P K/V heads each, or with fewer
K/V heads than ranks the one its query heads use (every K/V head goes to
P/Hk ranks: the K/V part of the all-to-all is ``1 x n x (D + Dv)`` per
destination instead of ``Hk/P`` of that). In the backward pass the replicas'
dK, dV (each from a subset of the group's query heads) are summed at the
owner. A rank whose run breaks a group so that its query heads do not use
its K/V heads evenly (2 heads of one group, 1 of the next) computes with
those K/V heads repeated to the largest even ratio (``HeadDeal.held``): the
all-to-all still sends each K/V head once per rank; only the grid's ring
across the groups moves the repeated heads.
"""

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..core.precision import compute_itemsize, row_bytes
from .layouts import sort_order
from .plan import Piece, Plan, PlannedSchedule, Task, Where, problem_fields, ring_plan
from .problem import Problem
from .rows import counted_kind
from .visibility import combined, count_visible, visible_keys

__all__ = ["HEAD_MODES", "UlyssesPlan", "ulysses_plan", "heads_problem", "HeadDeal", "deal_heads",
           "ulysses_pair_bytes", "HybridPlan", "hybrid_plan",
           "sequence_pairs"]

HEAD_MODES = ("ulysses",)


def heads_problem(q, k, parts, who, what):
    """Why the heads of q, k do not split into ``parts`` (``who`` splits them, ``what`` names the parts), or None.

    Never raises. Called on each rank before the agreement (``Spec.heads_problem``
    says who splits the heads); every rank has the same head counts (the
    agreement compares shapes), so every rank finds the same problem. Any
    number of query heads from ``parts`` up splits (``deal_heads``).
    """
    try:
        if q.ndim < 3:
            return None if parts == 1 else (f"{who} splits the heads axis over the ranks: q needs shape "
                                            f"(..., heads, seq, dim), got {q.shape}")
        hq = q.shape[-3]
    except AttributeError:  # not arrays: local_problem reports it
        return None
    if hq < parts:
        return (f"{who} needs at least one query head per part: {hq} query heads for {what} ({parts}); "
                f"the ring modes take any number of heads")
    return None


class HeadDeal(NamedTuple):
    """Per rank of ``deal_heads``: ``q`` its query heads and ``kv`` the K/V heads they use (slices of the global
    heads); ``held`` the K/V heads it computes with, as indices into its ``kv`` slice (each used by the same
    number of its query heads, in order), or None when that is its ``kv`` slice itself."""

    q: tuple
    kv: tuple
    held: tuple

    def counts(self, kv=False):
        """Per rank: how many query (``kv``: K/V) heads it gets."""
        return [s.stop - s.start for s in (self.kv if kv else self.q)]

    def held_counts(self):
        """Per rank: how many K/V heads it computes with (the ring across a grid's groups moves these)."""
        return [len(h) if h is not None else s.stop - s.start for h, s in zip(self.held, self.kv)]

    def expand(self, rank, a):
        """``a`` (..., its K/V heads, n, d) as ``rank`` computes with it: its ``held`` heads (``a`` if None)."""
        held = self.held[rank]
        return a if held is None else np.take(a, held, axis=-3)

    def fold(self, rank, a):
        """The inverse for gradients: the ``held`` heads' dK (or dV) summed into ``rank``'s K/V heads."""
        held = self.held[rank]
        if held is None:
            return a
        out = np.zeros(a.shape[:-3] + (self.kv[rank].stop - self.kv[rank].start,) + a.shape[-2:],
                       np.result_type(a.dtype, np.float64))
        for j, c in enumerate(held):
            out[..., c, :, :] += a[..., j, :, :]
        return out


def _run(a, b, group):
    """``(K/V heads, held heads, held)`` of the query heads a:b, ``group`` query heads per K/V head."""
    if b <= a:
        return 0, 0, None
    first, last = a // group, (b - 1) // group
    uses = [min(b, (c + 1) * group) - max(a, c * group) for c in range(first, last + 1)]
    ratio = functools.reduce(math.gcd, uses)
    if all(u == ratio for u in uses):
        return len(uses), len(uses), None
    held = tuple(int(c) for c in np.repeat(np.arange(len(uses)), [u // ratio for u in uses]))
    return len(uses), len(held), held


@functools.lru_cache(maxsize=256)
def deal_heads(hq, hk, parts):
    """The ``HeadDeal`` of ``hq`` query heads (``hq // hk`` per K/V head) over ``parts`` ranks (hq >= parts).

    Runs of query heads in rank order, ``hq // parts`` or one more each; of the ways to place the longer runs,
    the one that sends the fewest K/V heads, then holds the fewest, then gives the longer runs to the first
    ranks (a dynamic programme over the ranks and the longer runs placed so far).
    """
    if hk < 1 or hq % hk or not 1 <= parts <= hq:
        raise ValueError(f"cannot deal {hq} query heads, {hk} K/V heads over {parts} ranks")
    group, (base, extra) = hq // hk, divmod(hq, parts)
    best = {(parts, extra): (0, ())}  # (ranks done, longer runs placed) -> (cost of the rest, their runs)
    for i in range(parts - 1, -1, -1):
        for j in range(max(0, extra - (parts - i)), min(i, extra) + 1):
            options = []
            for e in (1, 0):  # a longer run first: ties keep it
                if (i + 1, j + e) in best:
                    a = i * base + j
                    sent, held, _ = _run(a, a + base + e, group)
                    cost, rest = best[(i + 1, j + e)]
                    options.append((cost + sent * (hq + 1) + held, (a + base + e,) + rest))
            best[(i, j)] = min(options, key=lambda o: o[0])
    ends = best[(0, 0)][1]
    starts = (0,) + ends[:-1]
    runs = [_run(a, b, group) for a, b in zip(starts, ends)]
    kv = tuple(slice(a // group, a // group + n) for a, (n, _, _) in zip(starts, runs))
    return HeadDeal(tuple(slice(a, b) for a, b in zip(starts, ends)), kv, tuple(h for _, _, h in runs))


@dataclass
class UlyssesPlan(Plan):
    """A ring plan's shards and masks, followed in one step: every rank does every key block of the whole
    sequence in position order, for its heads."""

    def order(self, kv=False):
        """The permutation that puts the gathered (shard-ordered) query (``kv``: key) rows in position order,
        or None when they already are (the contiguous layout); ``layouts.take_rows`` applies it."""
        return self._sorted(kv)[1]

    def block_pieces(self, source):
        """The sorted queries against key block ``source`` (``key_block``): one ``Piece`` of the rows that see
        some of its keys, keys relative to the block; [] when no query sees it."""
        span = self._span(source)
        if span is None:
            return []
        a, b, c, d, full = span
        block = self.key_block(source)
        where = Where(self._sorted()[0], self._sorted(kv=True)[0][block],
                      None if self.exact else combined(**self.mask_options()))
        if full and self.block_tasks()[source].kind == "full":
            return [Piece(a, b, c, d, where=where._replace(mask=None))]
        if full:
            return [Piece(a, b, c, d, where=where)]
        klo, khi = self._intervals()
        s = block.start
        return [Piece(a, b, c, d, np.clip(klo[a:b] - s, c, d) - c, np.clip(khi[a:b] - s, c, d) - c, where)]

    def key_block(self, source):
        """Where key block ``source`` sits in the sorted keys: the source-th run, as many keys as rank source holds."""
        start = self.offsets(kv=True)[source]
        return slice(start, start + len(self.kv_shards[source]))

    def offsets(self, kv=False):
        """Where each rank's query (``kv``: key) tokens start in the gathered (shard-ordered) sequence, made once."""
        name = "_kv_starts" if kv else "_q_starts"
        if getattr(self, name, None) is None:
            setattr(self, name, _starts(self.kv_shards if kv else self.shards))
        return getattr(self, name)

    def block_tasks(self):
        """Every rank's one step: every key block, "skip" when no query sees it (the same for every rank)."""
        if getattr(self, "_tasks", None) is None:
            self._tasks = tuple(Task(j, self._kind(j), 0) for j in range(self.size))
        return self._tasks

    def visible_pairs(self):
        """Per rank: (query, key) pairs its kernel is given the mask of, for its heads: the whole sequence's."""
        klo, khi = self._intervals()
        if not self.exact:
            total = int(count_visible(self._sorted()[0], self._sorted(kv=True)[0], self.mask_options(), klo, khi)[0]
                        .sum())
        else:
            total = len(self._sorted()[0]) * len(self._sorted(kv=True)[0]) if klo is None else int(np.sum(khi - klo))
        return [total] * self.size

    def computed_pairs(self):
        total = sum((b - a) * (d - c) for a, b, c, d, _ in filter(None, map(self._span, range(self.size))))
        return [total] * self.size

    def messages_per_rank(self):
        """Two all-to-alls (heads out, results back), P - 1 messages each."""
        return 2 * (self.size - 1)

    def backward_messages_per_rank(self):
        return 2 * (self.size - 1)

    def _sorted(self, kv=False):
        """``(positions in order, order)`` of the gathered query (``kv``: key) rows, made once."""
        name = "_kv_sorted" if kv else "_q_sorted"
        if getattr(self, name, None) is None:
            if kv and self.kv_shards is self.shards:
                setattr(self, name, self._sorted())
            else:
                gathered = np.concatenate(self.kv_shards if kv else self.shards)
                order = sort_order(gathered)
                setattr(self, name, (gathered if order is None else gathered[order], order))
        return getattr(self, name)

    def _intervals(self):
        """Each sorted query's visible keys ``[klo, khi)`` in the sorted keys, or (None, None): nothing masked.
        Both never decrease from row to row (every mask's interval of positions does: ``plans.rows``)."""
        if getattr(self, "_klo_khi", None) is None:
            self._klo_khi = visible_keys(self._sorted()[0], self._sorted(kv=True)[0], **self.mask_options())
        return self._klo_khi

    def _seen(self):
        """The sorted query rows that see some key: their indices, increasing."""
        if getattr(self, "_seen_rows", None) is None:
            klo, khi = self._intervals()
            self._seen_rows = np.flatnonzero(khi > klo)
        return self._seen_rows

    def _span(self, source):
        """``(a, b, c, d, full)`` of key block ``source``'s piece (rows a:b, keys c:d of the block; ``full``: every
        row sees every key), or None when no query sees it. From the intervals' monotony: O(log S)."""
        block = self.key_block(source)
        n_q, s, e = len(self._sorted()[0]), block.start, block.stop
        klo, khi = self._intervals()
        if klo is None or not n_q or e <= s:
            return (0, n_q, 0, e - s, True) if n_q and e > s else None
        seen = self._seen()  # rows with khi > s and klo < e that see some key: they see some key of s:e
        first = np.searchsorted(seen, np.searchsorted(khi, s, side="right"))
        last = np.searchsorted(seen, np.searchsorted(klo, e, side="left")) - 1
        if last < first:
            return None
        a, b = int(seen[first]), int(seen[last]) + 1
        c, d = max(int(klo[a]), s), min(int(khi[b - 1]), e)
        return a, b, c - s, d - s, bool(klo[b - 1] <= c and khi[a] >= d)

    def _kind(self, source):
        span = self._span(source)
        if span is None:
            return "skip"
        if not self.exact:  # holes: the block's pairs counted from the mask's definition
            block = self.key_block(source)
            klo, khi = self._intervals()
            s = block.start
            return counted_kind(self._sorted()[0], self._sorted(kv=True)[0][block], self.mask_options(),
                                np.clip(klo - s, 0, block.stop - s), np.clip(khi - s, 0, block.stop - s))[0]
        a, b, c, d, full = span
        return "full" if full and (a, b, c, d) == (0, len(self._sorted()[0]), 0, len(self.kv_shards[source])) \
            else "masked"


def _starts(shards):
    """Where each shard starts when the shards are laid one after the other."""
    return [int(x) for x in np.cumsum([0] + [len(s) for s in shards])[:-1]]


def ulysses_plan(base):
    """The Ulysses plan over the shards and masks of ``base`` (a ring plan of the same options)."""
    plan = UlyssesPlan(**problem_fields(base), mode="ulysses", rounds={})
    plan.schedule = PlannedSchedule(1, base.size, lambda step, r: plan.block_tasks())
    plan.schedule.legend = "key block j: the j-th run of the sorted keys, as long as rank j's shard"
    return plan


def ulysses_pair_bytes(plan, r, d, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None,
                       wire_dtype=None):
    """Bytes rank r sends rank d under a Ulysses plan (0 to itself: that share never leaves it).

    Forward: d's query heads of r's tokens (``q_d x n_r x D``, ``q_d``: d's
    query heads of ``deal_heads``) and the K/V heads d uses of r's keys
    (``kv_d x m_r`` rows of D and Dv on the K/V wire, ``precision.row_bytes``),
    then back d's tokens of r's heads: out in the input dtype and lse in the
    dtype tiles compute in (``q_r x n_d x Dv`` and ``x 1``). Backward: out goes
    as delta, so ``q_d x n_r x (D + Dv + 2)``
    (q, dout, lse, delta, in the compute dtype) and the K/V heads on the wire;
    back dq and the dK, dV of r's K/V heads for d's keys, in ``grad_itemsize``
    bytes (default: the ``grad_wire_dtype`` default for ``itemsize``).
    """
    if r == d:
        return 0
    deal = deal_heads(hq, hk, plan.size)
    (q_r, q_d), (kv_r, kv_d) = ([c[x] for x in (r, d)] for c in (deal.counts(), deal.counts(kv=True)))
    n_r, n_d = len(plan.shards[r]), len(plan.shards[d])
    m_r, m_d = len(plan.kv_shards[r]), len(plan.kv_shards[d])  # key tokens (kv_positions: other than q's)
    kv_row = row_bytes(wire_dtype, dim, itemsize) + row_bytes(wire_dtype, dim_v, itemsize)
    compute = compute_itemsize(itemsize)
    if backward:
        grad_itemsize = compute_itemsize(itemsize) if grad_itemsize is None else grad_itemsize
        return batch * (n_r * q_d * (dim + dim_v + 2) * compute + m_r * kv_d * kv_row
                        + (n_d * q_r * dim + m_d * kv_r * (dim + dim_v)) * grad_itemsize)
    return batch * (n_r * q_d * dim * itemsize + m_r * kv_d * kv_row + n_d * q_r * (dim_v * itemsize + compute))


# ---------------------------------------------------------------- ring x Ulysses: a u x (P/u) grid


@dataclass
class HybridPlan(Plan):
    """``ulysses_size=u``: Ulysses inside each group of u consecutive ranks, a ring plan across the P/u groups.

    Every rank holds the tokens the layout (or ``positions``) gives it, as in
    every other mode (``shard_indices``); a group's tokens are its members'
    together, in member order. After the group's all-to-all, each rank holds
    the group's tokens for Hq/u heads; ``ring_plan`` (over the P/u groups,
    their tokens as ``positions``) then moves K/V between the ranks of the same
    place in every group. With zigzag or striped, the groups' causal work is as
    balanced as the ranks'.
    """

    ulysses_size: int = 1
    ring_plan: Plan | None = None

    @property
    def strategy(self):
        return "grid"

    def group(self, rank):
        """``(group, place in the group)`` of ``rank``."""
        return divmod(rank, self.ulysses_size)

    def members(self, group):
        return range(group * self.ulysses_size, (group + 1) * self.ulysses_size)

    def group_positions(self, group, kv=False):
        """The group's query (``kv``: key) positions in the order its all-to-all lays them: member by member."""
        shards = self.kv_shards if kv else self.shards
        return np.concatenate([shards[r] for r in self.members(group)])

    def sequence_pairs(self):
        return self.ring_plan.sequence_pairs()

    def visible_pairs(self):
        """Per rank: its group's visible pairs, which it computes for its Hq/u heads."""
        return [self.ring_plan.visible_pairs()[r // self.ulysses_size] for r in range(self.size)]

    def computed_pairs(self):
        return [self.ring_plan.computed_pairs()[r // self.ulysses_size] for r in range(self.size)]

    def messages_per_rank(self):
        """The group's two all-to-alls (u - 1 messages each), and the ring's across the groups."""
        return 2 * (self.ulysses_size - 1) + self.ring_plan.messages_per_rank()

    def backward_messages_per_rank(self):
        return 2 * (self.ulysses_size - 1) + self.ring_plan.backward_messages_per_rank()


def sequence_pairs(plan):
    """The whole sequence's visible (query, key) pairs, under any plan."""
    return plan.sequence_pairs()


def hybrid_plan(base, ulysses_size, mode, rounds):
    """The u x (P/u) grid over the tokens and masks of ``base`` (a plan of the P ranks): a ``mode`` ring of groups
    whose streams follow ``rounds`` (``ring_plan``'s)."""
    u, P = ulysses_size, base.size
    grid = HybridPlan(**problem_fields(base), mode=mode, ulysses_size=u)
    groups = range(P // u)
    separate_kv = base.kv_shards is not base.shards
    problem = Problem(causal=base.causal, window=base.window, cu_seqlens=base.cu_seqlens,
                      causal_block=base.causal_block, mask=base.mask_pieces,
                      positions=[grid.group_positions(g) for g in groups],
                      kv_positions=[grid.group_positions(g, kv=True) for g in groups] if separate_kv else None,
                      q_len=base.q_len)
    grid.ring_plan = ring = ring_plan(base.seq_len, P // u, problem, mode=mode, rounds=rounds)
    grid.kinds = [ring.kinds[r // u] for r in range(P)]
    grid.pairs = [ring.pairs[r // u] for r in range(P)]
    grid.rounds = ring.rounds
    grid.schedule = PlannedSchedule(ring.n_steps, P, lambda step, r: ring.tasks(step, r // u))
    return grid
