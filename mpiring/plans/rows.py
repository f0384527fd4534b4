"""What a plan knows of every rank, made when first read: a rank plans its own steps in O(P). No MPI.

A plan's per-rank data (positions, block kinds, visible pairs) are ``Rows``
and ``PairTable``, never P x P masks (docs/performance.md §13): the entry of rank r (or of the pair r,
j) is computed the first time something reads it and kept, so a rank that
runs the ring computes its own row only, and a verifier that reads every
row still gets them all, the same values bit for bit.

The few facts that need every rank are found from the whole sequence at
once, in O(S) NumPy rather than P x P masks: which ranks hold each
position (``owners``), the typical run of consecutive positions
(``run_unit``), every rank's visible pairs (``visible_per_rank``), and the
ring offsets at which some rank still needs a block (``Reach``: the early
stop of windows and packed documents). They rest on one fact of every mask
(``masks``): query i sees the keys of one interval of positions,
``[lo(i), hi(i)]``, which holds i and whose ends never decrease as i grows.
"""

from collections.abc import Sequence

import numpy as np

from ..core.scores import allowed_rows
from .layouts import block_range
from .visibility import combined, count_visible, is_exact, visible_keys

__all__ = ["Rows", "PairTable", "owners", "layout_owners", "run_unit", "runs_of", "visible_per_rank", "Reach",
           "CountedReach", "counted_kind", "head_pairs"]

_UNSET = object()


class Rows(Sequence):
    """``rows[r]`` is ``make(r)``, computed when first read and kept; a sequence of ``n`` entries."""

    def __init__(self, n, make):
        self._n, self._make, self._got = n, make, {}

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i) + (self._n if i < 0 else 0)
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} of {self._n}")
        got = self._got.get(i, _UNSET)
        if got is _UNSET:
            got = self._got[i] = self._make(i)
        return got

    def __repr__(self):
        return f"Rows({self._n}, {len(self._got)} made)"

    def __eq__(self, other):  # every entry made: for tests and tools that compare whole plans
        return isinstance(other, (Sequence, list)) and _plain(self) == _plain(other)

    __hash__ = None


class PairTable(Sequence):
    """``table[r][j]``: ``entry(r, j)[index]``, each pair computed when first read (``kinds``, ``pairs``)."""

    def __init__(self, n, entry, index):
        self._rows = Rows(n, lambda r: Rows(n, lambda j: entry(r, j)[index]))

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, r):
        return self._rows[r]

    __eq__ = Rows.__eq__
    __hash__ = None


def _plain(rows):
    """Nested rows as nested lists."""
    return [_plain(x) if isinstance(x, (Rows, PairTable)) else x for x in rows]


# ---------------------------------------------------------------- the whole sequence at once


def layout_owners(seq_len, size, layout):
    """``owner[p]``: the rank that holds position p under a built-in layout (O(S), no per-rank arrays)."""
    if layout == "striped":
        return np.arange(seq_len, dtype=np.int64) % size
    if layout == "contiguous":
        counts = [block_range(seq_len, size, r)[0] for r in range(size)]
        return np.repeat(np.arange(size, dtype=np.int64), counts)
    chunks = 2 * size  # zigzag: chunk c belongs to rank min(c, 2P - 1 - c)
    counts = [block_range(seq_len, chunks, c)[0] for c in range(chunks)]
    return np.repeat(np.minimum(np.arange(chunks), chunks - 1 - np.arange(chunks)).astype(np.int64), counts)


def owners(seq_len, shards):
    """``owner[p]``: the rank whose ``shards`` hold position p, or -1 (query positions of a longer K/V)."""
    owner = np.full(seq_len, -1, np.int64)
    owner[np.concatenate(list(shards))] = np.repeat(np.arange(len(shards)), [len(s) for s in shards])
    return owner


def _runs(owner):
    """Maximal runs of one rank's consecutive positions: ``(starts, ends, ranks)``, positions held by none left out."""
    cut = np.flatnonzero(np.diff(owner)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(owner)]])
    held = owner[starts] >= 0
    return starts[held], ends[held], owner[starts[held]]


def run_unit(owner):
    """The median length of the runs of consecutive positions a rank holds: the unit ``runs_of`` cuts runs into."""
    starts, ends, _ = _runs(owner)
    lengths = np.sort(ends - starts)
    return int(lengths[(len(lengths) - 1) // 2])


MAX_RUNS = 32  # beyond this many runs a rank's rows are one run (striped): the kernel's tiles skip inside it


def runs_of(shard, unit):
    """The row ranges ``(a, b)`` of one rank's sorted positions (``layouts.position_runs`` for one rank)."""
    bounds = [0, *(np.flatnonzero(np.diff(shard) != 1) + 1).tolist(), len(shard)]
    if len(bounds) - 1 > min(MAX_RUNS, max(2, len(shard) // 2)):  # mostly single tokens (striped): one run
        return [(0, len(shard))]
    mine = []
    for a, b in zip(bounds, bounds[1:]):
        n, parts = b - a, max(1, int((b - a) / unit + 0.5))
        mine += [(a + -(-i * n // parts), a + -(-(i + 1) * n // parts)) for i in range(parts)]
    return mine if len(mine) <= MAX_RUNS else list(zip(bounds, bounds[1:]))


def _bounds(positions, seq_len, mask):
    """``(lo, hi)``: the first and last key position each query position may see, within 0 .. seq_len - 1."""
    every = np.arange(seq_len, dtype=np.int64)
    klo, khi = visible_keys(positions, every, **mask)
    if klo is None:
        return np.zeros(len(positions), np.int64), np.full(len(positions), seq_len - 1, np.int64)
    return klo, khi - 1  # keys are every position: an index is a position


def visible_per_rank(seq_len, size, q_owner, mask):
    """Every rank's visible (query, key) pairs, from each query position's interval of keys (every position a key)."""
    held = np.flatnonzero(q_owner >= 0)
    if is_exact(mask):
        lo, hi = _bounds(held, seq_len, mask)
        seen = np.maximum(hi - lo + 1, 0)
    else:  # holes inside the intervals: counted from the mask's definition
        seen = count_visible(held, np.arange(seq_len, dtype=np.int64), mask)[0]
    return [int(x) for x in np.bincount(q_owner[held], weights=seen.astype(np.float64), minlength=size).round()]


def head_pairs(plan):
    """``plan.head_pairs``: an int64 array (ranks, batch entries, heads), the (query, key) pairs each batch entry
    and head sees among the query tokens a rank holds, where a mask piece is headed (``MaskPiece.headed``); None
    otherwise. The ring modes' ``plan.pairs`` and ``visible_pairs`` count their union, the work the kernel is
    given (Ulysses' ranks each do the whole sequence for their heads). From the whole sequence at once, a chunk
    of query rows at a time (``core.scores.allowed_rows``); made once."""
    if "_head_pairs" not in vars(plan):
        plan._head_pairs = _head_pairs(plan)
    return plan._head_pairs


def _head_pairs(plan):
    options = plan.mask_options()
    mask = combined(**options)
    if mask is None or not mask.headed:
        return None
    counts = mask.counts()
    held = np.flatnonzero(plan.q_owner >= 0)
    every = np.arange(plan.seq_len, dtype=np.int64)  # keys: every position (each held by some rank)
    klo, khi = visible_keys(held, every, **options)
    found = np.zeros((plan.size, *counts), np.int64)
    for a, b, ok in allowed_rows(mask, held, every, klo, khi):
        seen = np.broadcast_to(ok, counts + ok.shape[-2:]).sum(axis=-1, dtype=np.int64)  # (batch, heads, rows)
        np.add.at(found, plan.q_owner[held[a:b]], np.moveaxis(seen, -1, 0))
    return found


class Reach:
    """The ring offsets at which some rank needs a block: rank r needs source j at offset (r - j) mod P.

    Rank r needs j iff one of r's runs of consecutive query positions sees a
    key of j: a run [a, b) sees exactly the key positions lo(a) .. hi(b - 1).
    ``last(lo, hi)`` is the largest needed offset in lo .. hi (or None).
    Dense masks (none, causal) are answered by checking single offsets from
    the top down (each one vectorized over the query runs); sparse ones
    (windows, documents) by listing every (query run, key run) pair that meets.
    """

    def __init__(self, seq_len, size, q_owner, k_owner, mask):
        self.size = size
        qa, qb, self.q_rank = _runs(q_owner)
        ka, kb, self.k_rank = _runs(k_owner)  # the key positions are every position: runs in order
        lo, _ = _bounds(qa, seq_len, mask)
        _, hi = _bounds(qb - 1, seq_len, mask)
        self.lo, self.hi = lo, hi
        self.from_run = np.searchsorted(kb, lo, side="right")  # first key run that ends after lo
        self.to_run = np.searchsorted(ka, hi, side="right")  # key runs up to the one holding hi
        order = np.lexsort((ka, self.k_rank))  # key runs by rank, then position: each rank's in order
        self._by_rank = (self.k_rank[order], ka[order], kb[order])
        self._key = self.k_rank[order] * (seq_len + 1) + kb[order]  # sorted: (rank, end)
        self._span = seq_len + 1
        self._offsets = None
        meets = int(np.sum(np.maximum(self.to_run - self.from_run, 0)))
        if meets <= 8 * (len(qa) + len(ka) + size):  # few meetings: list them all
            self._offsets = self._every_offset()

    def _every_offset(self):
        counts = np.maximum(self.to_run - self.from_run, 0)
        q = np.repeat(np.arange(len(counts)), counts)
        t = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + self.from_run[q]
        found = np.zeros(self.size, bool)
        found[(self.q_rank[q] - self.k_rank[t]) % self.size] = True
        return found

    def needed(self, offset):
        """Whether some rank needs the block ``offset`` ranks back (source r - offset)."""
        if self._offsets is not None:
            return bool(self._offsets[offset % self.size])
        source = (self.q_rank - offset) % self.size
        at = np.searchsorted(self._key, source * self._span + self.lo, side="right")  # first run ending past lo
        ok = at < len(self._key)
        at = np.minimum(at, len(self._key) - 1)
        ranks, starts, _ = self._by_rank
        return bool(np.any(ok & (ranks[at] == source) & (starts[at] <= self.hi)))

    def last(self, lo, hi):
        """The largest offset in lo .. hi that some rank needs, or None."""
        return next((s for s in range(hi, lo - 1, -1) if self.needed(s)), None)

    def first(self, lo, hi):
        """The smallest offset in lo .. hi that some rank needs, or None."""
        return next((s for s in range(lo, hi + 1) if self.needed(s)), None)


class CountedReach:
    """``Reach`` counted from the plan's block kinds (every rank's against every source: P x P counted blocks)."""

    def __init__(self, plan):
        size = plan.size
        self._needed = [any(plan.kinds[r][(r - s) % size] != "skip" for r in range(size)) for s in range(size)]

    def needed(self, offset):
        return self._needed[offset % len(self._needed)]

    last, first = Reach.last, Reach.first


def counted_kind(q_pos, k_pos, mask, klo, khi):
    """``(kind, visible pairs)`` of a block under a mask with holes, from ``masks.count_visible``."""
    counts, full = count_visible(q_pos, k_pos, mask, klo, khi)
    pairs = int(counts.sum())
    return ("skip" if pairs == 0 else "full" if full else "masked"), pairs
