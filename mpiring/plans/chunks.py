"""Plans of the sequence mixers: which runs of tokens each rank holds, in sequence order, and whose rows each needs.

    spec = MixerSpec.of(seq_len=4096, layout="zigzag", cu_seqlens=[0, 1000, 4096], passing="scan")
    plan = spec.plan(size=4)          # MixerPlan: every rank's chunks, the state chains, the conv halos
    plan.chain()                      # chunks in sequence order: who holds each, where a document restarts
    plan.chain(reverse=True)          # the backward's order
    plan.halo(width=4, rank=1)        # the rows rank 1 receives and sends for a width-4 convolution

A chunk is a maximal run of consecutive positions on one rank within one
document: contiguous gives each rank one chunk, zigzag two, striped one per
token. A recurrence passes its state from chunk to chunk in sequence order
(never rank order: zigzag's two chunks of a rank are far apart). No MPI.
"""

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .layouts import check_layout, layout_positions, positions_problem
from .spec import count, integers

__all__ = ["MixerSpec", "MixerPlan", "Chain", "Halo", "PASSING"]

PASSING = ("ring", "allgather", "scan")  # how states pass: LASP's ring, LASP-2's all-gather, a prefix scan


@dataclass(frozen=True, eq=False)
class MixerSpec:
    """Which tokens each rank holds, the documents, and how states pass between ranks. Build it with ``of``."""

    seq_len: int | None = None  # None: the ranks' shards add up to it
    layout: str = "contiguous"
    positions: np.ndarray | None = None  # this rank's global positions (then, agreed, every rank's: a list)
    cu_seqlens: np.ndarray | None = None  # packed documents [0, e1, ..., seq_len]: states restart at each
    passing: str = "allgather"
    block: int | None = None  # tokens per block of the local kernels (None: their default)

    @classmethod
    def of(cls, **options):
        """The spec of these options, checked on this rank: ValueError naming the first bad one."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown mixer options {sorted(unknown)}; the options are "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        spec = cls(**options)
        check_layout(spec.layout)
        if spec.passing not in PASSING:
            raise ValueError(f"passing must be one of {', '.join(PASSING)}; got {spec.passing!r}")
        for name in ("seq_len", "block"):
            count(name, getattr(spec, name))  # checked, kept as given
        return dataclasses.replace(spec, positions=integers("positions", spec.positions, ""),
                                   cu_seqlens=integers("cu_seqlens", spec.cu_seqlens, ""))

    def shown(self):
        """What every rank must pass alike, by name (positions are each rank's own: only whether given)."""
        cu = None if self.cu_seqlens is None else self.cu_seqlens.tolist()
        return {"seq_len": self.seq_len, "layout": self.layout, "positions": self.positions is not None,
                "cu_seqlens": cu, "passing": self.passing, "block": self.block}

    def plan(self, size, lengths=None, positions=None):
        """The plan of ``size`` ranks. ``lengths``: every rank's token count, checked against the layout;
        ``positions``: every rank's positions (when the spec's are given). ValueError when they do not fit."""
        if positions is not None:
            problem = positions_problem(positions, sum(len(p) for p in positions))
            if problem:
                raise ValueError(problem)
            seq_len = sum(len(p) for p in positions)
            if self.seq_len is not None and self.seq_len != seq_len:
                raise ValueError(f"seq_len={self.seq_len} but the ranks' positions hold {seq_len} tokens")
            shards = [np.sort(p) for p in positions]
        else:
            seq_len = self.seq_len if self.seq_len is not None else sum(lengths)
            if seq_len < size:
                raise ValueError(f"{seq_len} tokens cannot be dealt to {size} ranks: every rank needs one")
            shards = layout_positions(seq_len, size, self.layout)
            if lengths is not None and list(lengths) != [len(s) for s in shards]:
                raise ValueError(f"local sequence lengths {list(lengths)} do not match the {self.layout} layout of "
                                 f"{seq_len} tokens over {size} ranks, which needs {[len(s) for s in shards]}")
        return MixerPlan(shards, seq_len, self.cu_seqlens)


class Chain(NamedTuple):
    """Chunks in the order a state passes through them."""

    chunk: np.ndarray  # (m,) chunk ids in passing order
    owner: np.ndarray  # (m,) the rank holding each
    cut: np.ndarray  # (m,) True where nothing passes in: a document (or the sequence) starts there

    def runs(self, size):
        """The ranks in chain order when each of the ``size`` ranks holds one run of the chain, else None."""
        starts = np.concatenate([[0], np.flatnonzero(np.diff(self.owner)) + 1])
        order = self.owner[starts]
        return order if len(order) == size else None


class Halo(NamedTuple):
    """A rank's rows of a causal convolution: what it receives, what it sends, and where each tap reads."""

    recv: dict  # source rank -> rows it sends here (in the order of the halo buffer)
    send: dict  # destination rank -> this rank's rows it needs
    taps: np.ndarray  # (n, width): per own token and tap, a row of [own rows | halo rows | one zero row]
    rows: int  # halo rows received


class MixerPlan:
    """Every rank's chunks and their order: the same on every rank."""

    def __init__(self, shards, seq_len, cu_seqlens=None):
        self.shards, self.seq_len, self.size = shards, int(seq_len), len(shards)
        starts = np.zeros(1, np.int64)
        if cu_seqlens is not None:
            cu = np.asarray(cu_seqlens, np.int64)
            if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or np.any(np.diff(cu) <= 0):
                raise ValueError(f"cu_seqlens must rise strictly from 0 to the sequence length {seq_len}, "
                                 f"got {cu.tolist()}")
            starts = cu[:-1]
        self.doc_starts = starts
        self.owner = np.empty(seq_len, np.int64)
        self.row = np.empty(seq_len, np.int64)
        for r, p in enumerate(shards):
            self.owner[p], self.row[p] = r, np.arange(len(p))
        first = np.zeros(seq_len, bool)
        first[starts] = True
        boundary = first.copy()
        boundary[1:] |= self.owner[1:] != self.owner[:-1]
        self.first = np.flatnonzero(boundary)  # the first position of every chunk, in sequence order
        self.length = np.diff(np.append(self.first, seq_len))
        self.chunk_owner = self.owner[self.first]
        self.starts_doc = first[self.first]

    @property
    def chunks(self):
        return len(self.first)

    def mine(self, rank):
        """``rank``'s chunks in sequence order, each as (chunk id, first row, row after its last)."""
        ids = np.flatnonzero(self.chunk_owner == rank)
        lo = self.row[self.first[ids]]
        return [(int(c), int(a), int(a + self.length[c])) for c, a in zip(ids, lo)]

    def chain(self, reverse=False):
        """The forward's chain (sequence order; a cut where a document starts) or the backward's (reversed;
        a cut where the next chunk starts a document or none follows)."""
        m = self.chunks
        if not reverse:
            return Chain(np.arange(m), self.chunk_owner, self.starts_doc.copy())
        ends = np.append(self.starts_doc[1:], True)
        order = np.arange(m)[::-1]
        return Chain(order, self.chunk_owner[order], ends[order])

    def doc_start_of(self, positions):
        """The first position of each position's document."""
        return self.doc_starts[np.searchsorted(self.doc_starts, positions, side="right") - 1]

    def _taps(self, rank, width):
        """Global position read by each tap of each of ``rank``'s tokens, and whether it is in the document."""
        p = self.shards[rank]
        pos = p[:, None] - (width - 1) + np.arange(width)
        return pos, pos >= self.doc_start_of(p)[:, None]

    def _needs(self, rank, width):
        """Positions ``rank`` reads but others hold, ordered by holder, then position."""
        pos, valid = self._taps(rank, width)
        wanted = np.unique(pos[valid])
        wanted = wanted[self.owner[wanted] != rank]
        return wanted[np.lexsort((wanted, self.owner[wanted]))]

    def halo(self, width, rank):
        """The rows ``rank`` exchanges for a causal convolution of ``width`` taps (``Halo``)."""
        n = len(self.shards[rank])
        needs = self._needs(rank, width)
        recv = {int(src): int(np.sum(self.owner[needs] == src)) for src in np.unique(self.owner[needs])}
        send = {}
        for dst in range(self.size):
            if dst != rank:
                theirs = self._needs(dst, width)
                rows = self.row[theirs[self.owner[theirs] == rank]]
                if len(rows):
                    send[dst] = rows
        pos, valid = self._taps(rank, width)
        taps = np.full(pos.shape, n + len(needs), np.int64)  # the zero row, unless the tap is in the document
        safe = np.where(valid, pos, 0)
        own = valid & (self.owner[safe] == rank)
        taps[own] = self.row[pos[own]]
        other = valid & ~own
        by_position = np.argsort(needs)
        taps[other] = n + by_position[np.searchsorted(needs, pos[other], sorter=by_position)]
        return Halo(recv, send, taps, len(needs))
