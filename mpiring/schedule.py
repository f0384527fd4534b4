"""The ring schedule: which K/V block every rank processes at every step.

A plan is pure data, computed the same way on every rank without any
communication, and the one ring loop in ``mpiring.ring`` just follows it.

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
"""

from dataclasses import dataclass, field

import numpy as np

from .layouts import block_range, check_layout, shard_indices
from .masks import block_kind, check_cu_seqlens, check_window, visible_keys

__all__ = ["MODES", "Task", "Schedule", "Plan", "make_plan"]

MODES = ("ring", "bidirectional", "allgather")
FORWARD, BACKWARD = +1, -1  # a stream's direction: +1 sends to rank + 1


@dataclass(frozen=True)
class Task:
    """One block a rank processes at one step."""

    source: int  # rank whose K/V block it is
    kind: str  # "full", "masked" (diagonal or partial) or "skip" (nothing visible)
    stream: int = FORWARD  # +1: arrived from rank - 1; -1: arrived from rank + 1


class Schedule:
    """``table[step][rank]`` is the tuple of Tasks that rank does at that step."""

    def __init__(self, table):
        self.table = [[tuple(tasks) for tasks in row] for row in table]

    def __eq__(self, other):
        return isinstance(other, Schedule) and self.table == other.table

    def __repr__(self):
        return f"Schedule({self.table!r})"

    @property
    def n_steps(self):
        return len(self.table)

    def sources(self):
        """``sources[step][rank]``: source rank of the first block processed (seed 001's comm_schedule)."""
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
        lines.append("(entry = source rank of the K/V block; m = masked, - = skipped, no compute)")
        return "\n".join(lines)


@dataclass
class Plan:
    """Everything the ring needs to know, identical on every rank."""

    seq_len: int
    size: int
    layout: str = "contiguous"
    mode: str = "ring"
    causal: bool = False
    window: tuple = (-1, -1)
    cu_seqlens: np.ndarray | None = None
    shards: list = field(default_factory=list)  # global positions held by each rank
    runs: list = field(default_factory=list)  # row ranges of each rank's chunks (zigzag: two)
    kinds: list = field(default_factory=list)  # kinds[rank][source]
    pairs: list = field(default_factory=list)  # pairs[rank][source]: visible (query, key) pairs
    rounds: dict = field(default_factory=dict)  # transfers made along each stream
    schedule: Schedule | None = None

    @property
    def n_steps(self):
        return self.schedule.n_steps

    def tasks(self, step, rank):
        return self.schedule.table[step][rank]

    def mask(self, rank, source):
        """``(klo, khi)`` for rank's queries against source's keys."""
        return visible_keys(self.shards[rank], self.shards[source], causal=self.causal,
                            window=self.window, cu_seqlens=self.cu_seqlens)

    def held_source(self, rank, stream, step):
        """Source of the block that ``stream`` brings to ``rank`` at ``step``."""
        return (rank - stream * step) % self.size

    def pieces(self, rank, source):
        """Sub-blocks worth computing: ``(a, b, c, d, klo, khi)`` = query rows a:b against keys c:d.

        A rank's positions fall into runs (zigzag: two chunks). For each run the
        visible keys form one index range; only that range is computed, which is
        what makes zigzag's causal work half a block per step. ``klo, khi`` are
        relative to c, or None when the whole sub-block is visible.
        """
        if self.kinds[rank][source] == "skip":
            return []
        n_q, n_k = len(self.shards[rank]), len(self.shards[source])
        if self.kinds[rank][source] == "full":
            return [(0, n_q, 0, n_k, None, None)]
        klo, khi = self.mask(rank, source)
        out = []
        for a, b in self.runs[rank]:
            lo, hi = klo[a:b], khi[a:b]
            c, d = int(lo.min()), int(hi.max())
            if d <= c:
                continue
            full = bool(np.all(lo == c) and np.all(hi == d))
            out.append((a, b, c, d, None, None) if full else (a, b, c, d, lo - c, hi - c))
        return out

    def computed_pairs(self):
        """Per rank: score entries the kernel is given (its tiles may skip more inside)."""
        return [sum((b - a) * (d - c) for j in range(self.size) for a, b, c, d, _, _ in self.pieces(r, j))
                for r in range(self.size)]

    def visible_pairs(self):
        """Per rank: (query, key) pairs that the mask lets through."""
        return [int(sum(row)) for row in self.pairs]

    def messages_per_rank(self):
        """Point-to-point sends per rank (K and V are separate messages)."""
        return 2 * sum(self.rounds.values())

    def backward_messages_per_rank(self):
        """Sends per rank in the backward pass (docs/backward.md); dK and dV are separate messages.

        The dK/dV partial of a block joins it at its first visitor, so a ring
        stream of R rounds sends K and V R times, the partial onward R - 1
        times, and home once, in ``backward.home_chunks(plan)`` key chunks (4,
        or the shortest shard's length). All-gather counts its all-gather of
        K, V and reduce-scatter of dK, dV as ring collectives: P - 1 messages per array.
        """
        if self.mode == "allgather":
            return 4 * (self.size - 1)
        from .backward import home_chunks  # the backward pass decides how the hop home is cut

        chunks = home_chunks(self)
        # per stream: K and V, the partial onward (dK, dV), and its chunks home (dK, dV each)
        return sum(2 * rounds + 2 * (rounds - 1) + 2 * chunks for rounds in self.rounds.values() if rounds > 0)


def _last_needed(kinds, size, stream, max_step):
    """Last step at which some rank needs the block that ``stream`` brings."""
    last = 0
    for s in range(1, max_step + 1):
        if any(kinds[r][(r - stream * s) % size] != "skip" for r in range(size)):
            last = s
    return last


def make_plan(seq_len, size, *, layout="contiguous", mode="ring", causal=False, window=None, cu_seqlens=None):
    """Build the plan for ``size`` ranks over a sequence of ``seq_len`` tokens."""
    check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if size < 1 or seq_len < size:
        raise ValueError(f"need at least one token per rank: seq_len={seq_len}, ranks={size}")
    plan = Plan(seq_len, size, layout, mode, bool(causal), check_window(window), check_cu_seqlens(cu_seqlens, seq_len))
    plan.shards = [shard_indices(seq_len, size, r, layout) for r in range(size)]
    for r, held in enumerate(plan.shards):
        first = block_range(seq_len, 2 * size, r)[0] if layout == "zigzag" else len(held)
        plan.runs.append([(a, b) for a, b in ((0, first), (first, len(held))) if b > a])
    for r in range(size):
        row_kinds, row_pairs = [], []
        for j in range(size):
            klo, khi = plan.mask(r, j)
            kind, pairs = block_kind(klo, khi, len(plan.shards[j]))
            row_kinds.append(kind)
            row_pairs.append(len(plan.shards[r]) * len(plan.shards[j]) if pairs is None else pairs)
        plan.kinds.append(row_kinds)
        plan.pairs.append(row_pairs)

    if mode == "ring":
        plan.rounds = {FORWARD: _last_needed(plan.kinds, size, FORWARD, size - 1)}
    elif mode == "bidirectional":
        plan.rounds = {FORWARD: _last_needed(plan.kinds, size, FORWARD, size // 2),
                       BACKWARD: _last_needed(plan.kinds, size, BACKWARD, (size - 1) // 2)}
    else:
        plan.rounds = {}

    table = []
    n_steps = size if mode == "allgather" else 1 + max(plan.rounds.values(), default=0)
    for step in range(n_steps):
        row = []
        for r in range(size):
            streams = [FORWARD] if step == 0 or mode == "allgather" else [d for d in plan.rounds if step <= plan.rounds[d]]
            row.append(tuple(Task(j, plan.kinds[r][j], d) for d in streams for j in [plan.held_source(r, d, step)]))
        table.append(row)
    plan.schedule = Schedule(table)
    return plan
