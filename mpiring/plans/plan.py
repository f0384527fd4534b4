"""The ring schedule: which K/V block every rank processes at every step.

A plan is pure data, computed the same way on every rank without any
communication: the forward loop in ``mpiring.parallel.ring`` and the backward loop in
``mpiring.parallel.backward`` just follow it. No MPI here. This module builds the ring
modes' plans (``ring_plan``); ``make_plan`` (``plans.make``) builds every mode's.

Unidirectional ring (``mode="ring"``): at step s rank r holds the block of
rank (r - s) mod P, and passes it to rank r + 1 for the next step::

    step 0: r <- r      step 1: r <- r-1      ...      step P-1: r <- r+1

Bidirectional ring (``mode="bidirectional"``): a second stream runs the
other way, so at step s rank r holds blocks r - s and r + s; every block has
been seen after floor(P/2) + 1 steps instead of P.

All-gather (``mode="allgather"``): K/V are gathered once; the rank then
computes the blocks in the same order as the ring, with no further transfers.

Blocks that no rank needs any more (sliding windows, packed documents) end
the ring early: those transfers are not made.

Which tokens a rank holds is data too: ``positions`` (one array per rank, any
order and sizes) replace the built-in layouts, which only produce positions;
``kv_positions`` give K/V rows of their own (queries against a longer cache).
Block kinds, skipping and the early stop all follow from the positions.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .cross import check_cross, cross_rows
from .layouts import check_layout, positions_problem, put_rows, shard_indices, sort_order
from .problem import Problem
from .rows import (
    CountedReach,
    PairTable,
    Reach,
    Rows,
    counted_kind,
    head_pairs,
    layout_owners,
    owners,
    run_unit,
    runs_of,
    visible_per_rank,
)
from .visibility import (
    block_kind,
    check_causal_block,
    check_cu_seqlens,
    check_mask,
    check_window,
    combined,
    is_exact,
    visible_keys,
)

__all__ = ["MODES", "ALL_MODES", "NEXT", "PREV", "HOME_CHUNKS", "Task", "Piece", "Schedule", "PlannedSchedule",
           "Plan", "ring_plan", "reach", "one_way", "both_ways", "gathered",
           "home_chunks", "key_chunks", "cut_to_keys", "chunks_in_order", "problem_fields"]

MODES = ("ring", "bidirectional", "allgather")  # the ring modes: K/V blocks travel (the simulator's too)
ALL_MODES = MODES + ("ulysses", "double_ring", "sparse")  # and Ulysses (plans.heads), the double ring
# (plans.hierarchy), each block straight to the ranks that need it (plans.delivery)
NEXT, PREV = +1, -1  # a stream's direction: NEXT sends to rank + 1 (receives from rank - 1), PREV the reverse
HOME_CHUNKS = 4  # the backward pass sends a partial home in this many key chunks, each as soon as its keys are done


class Where(NamedTuple):
    """The global positions of a block's query rows and keys (sorted), and the mask the kernel must evaluate
    inside the pieces' intervals (a ``masks.MaskPiece`` that is not exact), or None: the intervals are exact."""

    q_pos: np.ndarray
    k_pos: np.ndarray
    mask: object = None


class Piece(NamedTuple):
    """Query rows q0:q1 of a rank against keys k0:k1 of a block; klo, khi (relative to k0) or None: all visible.
    ``where``: the rows' and keys' positions, for a mask with holes or scores that depend on positions."""

    q0: int
    q1: int
    k0: int
    k1: int
    klo: np.ndarray | None = None
    khi: np.ndarray | None = None
    where: Where | None = None


@dataclass(frozen=True)
class Task:
    """One block a rank processes at one step."""

    source: int  # rank whose K/V block it is
    kind: str  # "full", "masked" (diagonal or partial) or "skip" (nothing visible)
    stream: int = NEXT  # NEXT (+1): arrived from rank - 1; PREV (-1): arrived from rank + 1


class Schedule:
    """``table[step][rank]`` is the tuple of Tasks that rank does at that step.

    A schedule the ranks recorded (``distributed_*``) also carries their
    counters, ``records[rank]`` (``Record.summary()``), and the ``plan``.
    """

    legend = "source rank of the K/V block"  # what an entry of ``format`` names

    def __init__(self, table, records=None, plan=None):
        self.table = [[tuple(tasks) for tasks in row] for row in table]
        self.records = records
        self.plan = plan

    def tasks(self, step, rank):
        return self.table[step][rank]

    def __eq__(self, other):
        return isinstance(other, Schedule) and self.table == other.table

    def __repr__(self):
        return f"Schedule({self.table!r})"

    @property
    def n_steps(self):
        return len(self.table)

    def sources(self):
        """``sources[step][rank]``: source rank of the first block processed (the simulator's comm_schedule)."""
        return [[tasks[0].source if tasks else None for tasks in row] for row in self.table]

    def format(self):
        """The schedule as a text table: one row per step, one column per rank."""
        mark = {"full": "", "masked": "m", "skip": "-"}
        size = len(self.table[0]) if self.table else 0
        cells = [[",".join(f"{t.source}{mark[t.kind]}" for t in tasks) or "." for tasks in row] for row in self.table]
        width = max([len(c) for row in cells for c in row] + [len(f"rank {size - 1}")])
        lines = ["step  " + " ".join(f"rank {r}".rjust(width) for r in range(size))]
        for step, row in enumerate(cells):
            lines.append(f"{step:>4}  " + " ".join(c.rjust(width) for c in row))
        lines.append(f"(entry = {self.legend}; m = masked, - = skipped, no compute)")
        return "\n".join(lines)


class PlannedSchedule(Schedule):
    """A plan's schedule: ``tasks(step, rank)`` made when asked (a rank asks for its own), ``table`` when first read."""

    def __init__(self, n_steps, size, tasks):
        self._n_steps, self._size, self._tasks, self._table = n_steps, size, tasks, None
        self.records = self.plan = None

    @property
    def table(self):
        if self._table is None:
            self._table = [[self._tasks(step, r) for r in range(self._size)] for step in range(self.n_steps)]
        return self._table

    def tasks(self, step, rank):
        return self._tasks(step, rank)

    @property
    def n_steps(self):
        return self._n_steps


@dataclass
class Plan:
    """Everything the ring needs to know, the same on every rank; per-rank rows are made when first read
    (``plans.rows``): a rank that runs reads its own."""

    seq_len: int
    size: int
    layout: str = "contiguous"
    mode: str = "ring"
    causal: bool = False
    window: tuple = (-1, -1)
    cu_seqlens: np.ndarray | None = None
    causal_block: int | None = None  # frame size of a block-causal mask (None: token-causal)
    mask_pieces: tuple = ()  # more mask pieces (masks.MaskPiece), all of which must allow a key
    q_len: int | None = None  # cross-attention: the queries' own sequence length (None: queries among the keys)
    kv_layout: str | None = None  # cross-attention: the keys' layout
    shards: list = field(default_factory=list)  # sorted global positions of each rank's queries
    kv_shards: list = field(default_factory=list)  # ... and of its keys/values (the same list unless kv_positions)
    orders: list = field(default_factory=list)  # per rank: the sort of its query rows as passed (None: sorted)
    kv_orders: list = field(default_factory=list)  # ... of its key/value rows
    runs: list = field(default_factory=list)  # row ranges of each rank's chunks (zigzag: two)
    kinds: list = field(default_factory=list)  # kinds[rank][source]
    pairs: list = field(default_factory=list)  # pairs[rank][source]: visible (query, key) pairs
    rounds: dict = field(default_factory=dict)  # transfers made along each stream
    schedule: Schedule | None = None
    head_pairs = property(head_pairs)  # [rank, batch, head]: visible pairs where the mask is headed (rows.head_pairs)

    @property
    def strategy(self):
        """How blocks move: the mode, or "grid" for ring x Ulysses (``parallel.strategies`` has the loops)."""
        return self.mode

    @property
    def n_steps(self):
        return self.schedule.n_steps

    def tasks(self, step, rank):
        return self.schedule.tasks(step, rank)

    def steps_of(self, rank):
        """Steps ``rank`` runs: ``n_steps`` (the sparse movement's ranks each run their own, found from their own
        row of the plan, while ``n_steps`` needs every rank's)."""
        return self.n_steps

    def _pair(self, rank, source):
        """``(kind, visible pairs)`` of rank's queries against source's keys."""
        klo, khi = self.mask(rank, source)
        if not self.exact:  # holes: counted from the mask's definition (``masks.count_visible``)
            return counted_kind(self.shards[rank], self.kv_shards[source], self.mask_options(), klo, khi)
        kind, pairs = block_kind(klo, khi, len(self.kv_shards[source]))
        return kind, len(self.shards[rank]) * len(self.kv_shards[source]) if pairs is None else pairs

    @property
    def exact(self):
        """Whether each query's visible keys are exactly its interval (``visible_keys``), for every batch entry."""
        return is_exact(self.mask_options())

    def where(self, rank, source):
        """``Where`` of rank's queries against source's keys: their positions, and the mask if it has holes."""
        return Where(self.shards[rank], self.kv_shards[source],
                     None if self.exact else combined(**self.mask_options()))

    def mask_options(self):
        """The plan's mask as ``visible_keys``' keyword arguments."""
        return dict(causal=self.causal, window=self.window, cu_seqlens=self.cu_seqlens,
                    causal_block=self.causal_block, mask=self.mask_pieces)

    def mask(self, rank, source):
        """``(klo, khi)`` for rank's queries against source's keys."""
        return visible_keys(self.shards[rank], self.kv_shards[source], **self.mask_options())

    def kept(self, rank, source):
        """The rows of source's block that travel to rank: None, all (the sparse movement may send fewer)."""
        return None

    def in_caller_order(self, rank, a, kv=False, axis=-2):
        """``rank``'s results, computed on its rows sorted by position, back in the order it passed them.

        ``kv``: rows of its keys/values (dk, dv); ``axis``: the rows' axis (-1 for lse).
        """
        return put_rows(a, (self.kv_orders if kv else self.orders)[rank], axis)

    def held_source(self, rank, stream, step):
        """Source of the block that ``stream`` brings to ``rank`` at ``step``."""
        return (rank - stream * step) % self.size

    def pieces(self, rank, source, rows=None):
        """Sub-blocks worth computing, as ``Piece(q0, q1, k0, k1, klo, khi)``: query rows q0:q1 against keys k0:k1.

        A rank's positions fall into runs (zigzag: two chunks). For each run the visible keys form one index
        range; only that range is computed, which is what makes zigzag's causal work half a block per step.
        ``klo, khi`` are relative to c, or None when the whole sub-block is visible. ``rows``: only these
        (sorted) key rows of source's block, indexed as they are taken.
        """
        if self.kinds[rank][source] == "skip":
            return []
        where = self.where(rank, source)
        if rows is not None:
            where = where._replace(k_pos=where.k_pos[rows])
        n_q, n_k = len(self.shards[rank]), len(where.k_pos)
        if self.kinds[rank][source] == "full":
            return [Piece(0, n_q, 0, n_k, where=where._replace(mask=None))]
        klo, khi = (self.mask(rank, source) if rows is None
                    else visible_keys(where.q_pos, where.k_pos, **self.mask_options()))
        out = []
        for a, b in self.runs[rank]:
            lo, hi = klo[a:b], khi[a:b]
            c, d = int(lo.min()), int(hi.max())
            if d <= c:
                continue
            full = bool(np.all(lo == c) and np.all(hi == d))
            out.append(Piece(a, b, c, d, where=where) if full else Piece(a, b, c, d, lo - c, hi - c, where))
        return out

    def computed_pairs(self):
        """Per rank: score entries the kernel is given (its tiles may skip more inside)."""
        return [sum((p.q1 - p.q0) * (p.k1 - p.k0) for j in range(self.size) for p in self.pieces(r, j))
                for r in range(self.size)]

    def visible_pairs(self):
        """Per rank: (query, key) pairs that the mask lets through (from the whole sequence at once: O(S))."""
        return visible_per_rank(self.seq_len, self.size, self.q_owner, self.mask_options())

    @property
    def q_owner(self):
        """``q_owner[p]``: the rank holding query position p (-1: none), made once."""
        if getattr(self, "_q_owner", None) is None:
            self._q_owner = (layout_owners(self.q_len or self.seq_len, self.size, self.layout)
                             if self.layout != "positions" else owners(self.q_len or self.seq_len, self.shards))
        return self._q_owner

    @property
    def k_owner(self):
        """``k_owner[p]``: the rank holding key position p."""
        if self.kv_shards is self.shards:
            return self.q_owner
        if getattr(self, "_k_owner", None) is None:
            self._k_owner = owners(self.seq_len, self.kv_shards)
        return self._k_owner

    def sequence_pairs(self):
        """The whole sequence's visible (query, key) pairs."""
        return int(sum(self.visible_pairs()))

    def messages_per_rank(self):
        """Point-to-point sends per rank (K and V are separate messages)."""
        return 2 * sum(self.rounds.values())

    def messages_of(self, rank, backward=False):
        """Point-to-point sends of ``rank``, forward or ``backward`` (the same on every rank but the sparse
        movement's)."""
        return self.backward_messages_per_rank() if backward else self.messages_per_rank()

    def backward_messages_per_rank(self):
        """Sends per rank in the backward pass (docs/backward.md); dK and dV are separate messages.

        The dK/dV partial of a block joins it at its first visitor, so a ring
        stream of R rounds sends K and V R times, the partial onward R - 1
        times, and home once, in ``home_chunks(plan)`` key chunks (4, or the
        shortest shard's length). All-gather counts its all-gather of K, V and
        reduce-scatter of dK, dV as ring collectives: P - 1 messages per array.
        """
        if not self.rounds:  # no stream: the all-gather
            return 4 * (self.size - 1)
        chunks = home_chunks(self)
        # per stream: K and V, the partial onward (dK, dV), and its chunks home (dK, dV each)
        return sum(2 * rounds + 2 * (rounds - 1) + 2 * chunks for rounds in self.rounds.values() if rounds > 0)


PROBLEM_FIELDS = ("seq_len", "size", "layout", "causal", "window", "cu_seqlens", "causal_block", "mask_pieces",
                  "q_len", "kv_layout", "shards", "kv_shards", "orders", "kv_orders", "runs", "kinds",
                  "pairs")  # what a call computes


def problem_fields(plan):
    """``plan``'s tokens, masks and blocks, by field name: a strategy's plan over the same problem starts from them."""
    return {name: getattr(plan, name) for name in PROBLEM_FIELDS}


def _held(parts, seq_len, size, name, partition):
    """``(sorted positions, orders)`` of every rank from its positions as passed; ValueError if not valid."""
    if len(parts) != size:
        raise ValueError(f"{name} must give one array per rank: {size} ranks, {len(parts)} arrays")
    parts = [np.asarray(p) for p in parts]
    for r, p in enumerate(parts):
        if p.ndim != 1 or not (np.issubdtype(p.dtype, np.integer) or p.size == 0):
            raise ValueError(f"{name} of rank {r} must be a 1-D integer array, got {p.dtype} of shape {p.shape}")
    parts = [p.astype(np.int64) for p in parts]
    problem = positions_problem(parts, seq_len, name, partition)
    if problem:
        raise ValueError(problem)
    orders = [sort_order(p) for p in parts]
    return [p if o is None else p[o] for p, o in zip(parts, orders)], orders


def ring_plan(seq_len: int, size: int, problem: Problem, *, mode: str = "ring", rounds=None) -> Plan:
    """The plan of a ring mode (``MODES``: K/V blocks travel) for ``size`` ranks over ``seq_len`` tokens (keys).

    ``mpiring.plans.make.make_plan`` takes every mode and calls this one for the
    ring modes, and for the tokens and masks the other strategies start from.
    ``rounds(plan) -> {stream: transfers}``: how the blocks move (``one_way``,
    ``both_ways`` or ``gathered``; ``make.RING_MODES`` gives each mode's); ``mode`` names it.
    """
    if rounds is None:
        raise ValueError(f"a ring plan needs the rule of its streams (make.RING_MODES: {', '.join(MODES)})")
    positions, kv_positions, q_len = problem.positions, problem.kv_positions, problem.q_len
    if positions is None:
        check_layout(problem.layout)
    if size < 1 or seq_len < size:
        raise ValueError(f"need at least one token per rank: {'seq_len' if q_len is None else 'kv_seq_len'}="
                         f"{seq_len}, ranks={size}")
    check_cross(q_len, size, positions, kv_positions, problem.cu_seqlens, problem.kv_layout)
    if kv_positions is not None and positions is None:
        raise ValueError("kv_positions needs positions: the query rows' own positions")
    plan = Plan(seq_len, size, "positions" if positions is not None else problem.layout, mode, bool(problem.causal),
                check_window(problem.window), check_cu_seqlens(problem.cu_seqlens, seq_len),
                check_causal_block(problem.causal_block, problem.causal), check_mask(problem.mask, seq_len))
    if positions is None:
        plan.shards, plan.orders = Rows(size, lambda r: shard_indices(seq_len, size, r, problem.layout)), [None] * size
    else:
        plan.shards, plan.orders = _held(positions, seq_len if q_len is None else q_len, size, "positions",
                                         kv_positions is None or q_len is not None)
    plan.kv_shards, plan.kv_orders = plan.shards, plan.orders
    if q_len is not None:
        cross_rows(plan, q_len, problem.kv_layout, positions is None)
    if kv_positions is not None:
        plan.kv_shards, plan.kv_orders = _held(kv_positions, seq_len, size, "kv_positions", True)
    plan.runs = Rows(size, lambda r: runs_of(plan.shards[r], _run_unit(plan)))
    plan.kinds, plan.pairs = PairTable(size, plan._pair, 0), PairTable(size, plan._pair, 1)
    plan.rounds = rounds(plan)
    n_steps = size if not plan.rounds else 1 + max(plan.rounds.values(), default=0)  # no stream: the all-gather
    plan.schedule = PlannedSchedule(n_steps, size, lambda step, r: _ring_tasks(plan, step, r))
    return plan


def _run_unit(plan):
    """The length ``runs_of`` cuts runs to, from every rank's positions: found once, when first needed."""
    if getattr(plan, "_unit", None) is None:
        plan._unit = run_unit(plan.q_owner)
    return plan._unit


def reach(plan):
    """The plan's ``rows.Reach``: which ring offsets some rank needs (made once); for a mask with holes, the
    offsets at which some rank's block is not empty (``CountedReach``)."""
    if getattr(plan, "_reach", None) is None:
        plan._reach = (Reach(plan.seq_len, plan.size, plan.q_owner, plan.k_owner, plan.mask_options())
                       if plan.exact else CountedReach(plan))
    return plan._reach


def one_way(plan):
    """The ring's stream: transfers up to the last step at which some rank needs the block it brings."""
    return {NEXT: reach(plan).last(1, plan.size - 1) or 0}


def both_ways(plan):
    """The bidirectional ring's two streams, each up to the last step at which some rank needs its block."""
    size = plan.size  # the PREV stream brings source r + s: offset P - s, the last s the first offset
    prev = reach(plan).first(size - (size - 1) // 2, size - 1)
    return {NEXT: reach(plan).last(1, size // 2) or 0, PREV: 0 if prev is None else size - prev}


def gathered(plan):
    """No stream: the all-gather brings every block at once."""
    return {}


def _ring_tasks(plan, step, r):
    """The Tasks of rank r at ``step`` of a ring mode's plan."""
    streams = [NEXT] if step == 0 or not plan.rounds else [d for d in plan.rounds if step <= plan.rounds[d]]
    return tuple(Task(j, plan.kinds[r][j], d) for d in streams for j in [plan.held_source(r, d, step)])


# ---------------------------------------------------------------- key chunks of the backward's hop home


def home_chunks(plan):
    """Key chunks of every hop home: HOME_CHUNKS, or fewer if a shard is shorter (the same on every rank)."""
    return min(HOME_CHUNKS, min(len(s) for s in plan.kv_shards))


def key_chunks(n, chunks):
    """``chunks`` near-equal, non-empty key ranges ``(lo, hi)`` that cover 0:n in order (needs chunks <= n)."""
    return [(i * n // chunks, (i + 1) * n // chunks) for i in range(chunks)]


def cut_to_keys(pieces, lo, hi):
    """The parts of ``pieces`` (as ``plan.pieces`` gives them) on keys lo:hi, with the query rows that see them.

    Together, the cuts of a block's key chunks cover exactly its pieces' visible
    (query, key) pairs, so the dK/dV of keys lo:hi are complete once these are done.
    """
    cut = []
    for a, b, c, d, klo, khi, where in pieces:
        c2, d2 = max(c, lo), min(d, hi)
        if d2 <= c2:
            continue
        if klo is None:  # every row sees every key
            cut.append(Piece(a, b, c2, d2, where=where))
            continue
        first, last = np.clip(c + klo, c2, d2), np.clip(c + khi, c2, d2)  # each row's visible keys in lo:hi
        seen = np.flatnonzero(last > first)
        if seen.size == 0:
            continue
        r0, r1 = int(seen[0]), int(seen[-1]) + 1
        first, last = first[r0:r1], last[r0:r1]
        if np.all(first == c2) and np.all(last == d2):
            cut.append(Piece(a + r0, a + r1, c2, d2, where=where))
        else:
            cut.append(Piece(a + r0, a + r1, c2, d2, first - c2, last - c2, where))
    return cut


def chunks_in_order(pieces, n, chunks):
    """A block's key chunks as ``(chunk, lo, hi, pieces)``, in the order to compute and send them home.

    Chunks in key order, except those this rank adds nothing to: they are
    complete as soon as the arriving partial is, so they go right after the
    first chunk with work (by then that partial has been waited for) rather
    than add to the transfers left at the end.
    """
    cuts = [(chunk, lo, hi, cut_to_keys(pieces, lo, hi)) for chunk, (lo, hi) in enumerate(key_chunks(n, chunks))]
    busy = [c for c in cuts if c[3]]
    return busy[:1] + [c for c in cuts if not c[3]] + busy[1:]
