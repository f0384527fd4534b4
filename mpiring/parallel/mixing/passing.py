"""How a recurrence's state passes between ranks: three strategies over one chain of affine maps.

    incoming = PASSING[spec.passing](call, chain, maps)

``chain`` (``plans.chunks.Chain``) lists the chunks in the order the state
passes through them (sequence order forward, its reverse backward) with the
rank holding each and where it restarts (a document); ``maps`` are this
rank's chunks' maps (``core.mixers.affine.Affine``) in that order. Each
strategy returns the state entering each of this rank's chunks: the
composition of every earlier map of its document applied to a zero state.

- ``ring`` (LASP): each chunk's outgoing state A S_in + b goes to the rank of
  the next chunk, which waits for it: only states travel, one hop per chunk
  boundary between ranks, in sequence.
- ``allgather`` (LASP-2): one all-gather of every rank's (A, b); every rank
  composes the chain itself.
- ``scan``: an exclusive prefix scan. Where every rank's chunks are one run
  of the chain (contiguous layouts), ``MPI_Exscan`` with a user-defined,
  non-commutative operator that composes maps, over the ranks in chain
  order; otherwise (zigzag, striped, explicit positions: chunks out of rank
  order) a log-depth scan of its own over the chunks (Hillis-Steele, one
  message per peer and round).
"""

import numpy as np
from mpi4py import MPI

from ...core.mixers.affine import apply, compose, cut, pack, unpack
from ...cost.statebytes import exscan_rounds

__all__ = ["PASSING", "ring", "allgather", "scan"]

RING_TAG, SHIFT_TAG, SCAN_TAG = 11, 12, 13  # a scan's round r uses SCAN_TAG + r


def _mine(call, chain):
    return np.flatnonzero(chain.owner == call.rank)


def ring(call, chain, maps):
    """LASP's ring: states hop from chunk to chunk in sequence order."""
    owner, rank, m = chain.owner, call.rank, len(chain.owner)
    zero = np.zeros_like(maps[0].b)
    waiting = {}
    for e in _mine(call, chain):  # every receive posted before any wait: no order of arrival can stall
        if e > 0 and not chain.cut[e] and owner[e - 1] != rank:
            buffer = np.empty_like(zero)
            waiting[e] = (buffer, call.irecv(buffer, owner[e - 1], RING_TAG))
    incoming, sends, out = [], [], None
    for e, piece in zip(_mine(call, chain), maps):
        if chain.cut[e]:
            state = zero
        elif e in waiting:
            call.wait([waiting[e][1]], f"the state of chunk {e - 1} from rank {owner[e - 1]}")
            state = waiting[e][0]
        else:
            state = out  # the previous chunk is this rank's own
        incoming.append(state)
        out = apply(piece.A, state) + piece.b
        if e + 1 < m and not chain.cut[e + 1] and owner[e + 1] != rank:
            sends.append(call.isend(out, owner[e + 1], RING_TAG))
    call.wait(sends, "the ring of states")
    return incoming


def allgather(call, chain, maps):
    """LASP-2: every rank's maps to every rank at once; each composes the whole chain."""
    A_shape, b_shape = maps[0].A.shape, maps[0].b.shape
    per = int(np.prod(A_shape)) + int(np.prod(b_shape))
    counts = [int(np.sum(chain.owner == r)) * per for r in range(call.size)]
    mine = pack(maps, maps[0].b.dtype)
    flat = np.empty(sum(counts), mine.dtype)
    request = call.comm.Iallgatherv(mine, [flat, counts])
    call.record.bytes_sent += mine.nbytes * (call.size - 1)  # as a ring all-gather moves them
    call.record.messages += call.size - 1
    call.wait([request], "the all-gather of states")
    offsets = np.concatenate([[0], np.cumsum(counts)])
    every = [unpack(flat[offsets[r]:offsets[r + 1]], counts[r] // per, A_shape, b_shape) for r in range(call.size)]
    taken = [0] * call.size
    state, incoming = np.zeros(b_shape, mine.dtype), []
    for e, r in enumerate(chain.owner):
        piece = every[r][taken[r]]
        taken[r] += 1
        if chain.cut[e]:
            state = np.zeros_like(state)
        if r == call.rank:
            incoming.append(state)
        state = apply(piece.A, state) + piece.b
    return incoming


def scan(call, chain, maps):
    """An exclusive prefix scan of the maps in chain order: Exscan where the chunks are in runs, else log-depth."""
    order = chain.runs(call.size)
    if order is None:
        return _doubling(call, chain, maps)
    return _exscan(call, chain, maps, order)


def _exscan(call, chain, maps, order):
    """MPI_Exscan with a user-defined operator composing maps, over the ranks in chain order."""
    mine = _mine(call, chain)
    pieces = [cut(p) if chain.cut[e] else p for e, p in zip(mine, maps)]
    total = pieces[0]
    for piece in pieces[1:]:
        total = compose(piece, total)
    A_shape, b_shape, dtype = total.A.shape, total.b.shape, total.b.dtype
    mine_flat = pack([total], dtype)
    result = np.zeros_like(mine_flat)

    def combine(earlier, later, datatype):  # MPI: later := earlier op later, earlier from the lower ranks
        a = unpack(np.frombuffer(earlier, dtype), 1, A_shape, b_shape)[0]
        out = np.frombuffer(later, dtype)
        out[:] = pack([compose(unpack(out.copy(), 1, A_shape, b_shape)[0], a)], dtype)

    comm = call.ordered(order)
    element = call.datatype(dtype, mine_flat.size)
    op = MPI.Op.Create(combine, commute=False)
    try:
        request = comm.Iexscan([mine_flat, 1, element], [result, 1, element], op)
        position = comm.Get_rank()
        call.record.bytes_sent += mine_flat.nbytes * exscan_rounds(position, call.size)
        call.record.messages += exscan_rounds(position, call.size)
        call.wait([request], "the exclusive scan of states")
    finally:
        op.Free()
    state = unpack(result, 1, A_shape, b_shape)[0].b if position else np.zeros(b_shape, dtype)
    incoming = []
    for e, piece in zip(mine, maps):
        state = np.zeros_like(state) if chain.cut[e] else state
        incoming.append(state)
        state = apply(piece.A, state) + piece.b
    return incoming


def _exchange(call, sends, recvs, tag, what, shapes):
    """Send each peer its list of maps and receive each peer's: ``{peer: [maps]}`` both ways; returns received."""
    A_shape, b_shape, dtype = shapes
    per = int(np.prod(A_shape)) + int(np.prod(b_shape))
    buffers = {src: np.empty(len(es) * per, dtype) for src, es in recvs.items()}
    call.swap([(dst, pack(pieces, dtype)) for dst, pieces in sends.items()], buffers.items(), tag, what)
    return {src: unpack(buffers[src], len(es), A_shape, b_shape) for src, es in recvs.items()}


def _doubling(call, chain, maps):
    """Hillis-Steele over the chunks: in round r every chunk takes the composite 2^r chunks before it."""
    owner, rank, m = chain.owner, call.rank, len(chain.owner)
    mine = _mine(call, chain)
    held = {int(e): cut(p) if chain.cut[e] else p for e, p in zip(mine, maps)}
    shapes = (maps[0].A.shape, maps[0].b.shape, maps[0].b.dtype)
    step, tag = 1, SCAN_TAG
    while step < m:
        sends, recvs = {}, {}
        for e in mine:
            if e + step < m and owner[e + step] != rank:
                sends.setdefault(int(owner[e + step]), []).append(held[int(e)])
            if e - step >= 0 and owner[e - step] != rank:
                recvs.setdefault(int(owner[e - step]), []).append(int(e))
        got = _exchange(call, sends, recvs, tag, f"round {tag - SCAN_TAG} of the scan of states", shapes)
        before = {e - step: piece for src, es in recvs.items() for e, piece in zip(es, got[src])}
        held = {e: compose(p, held[e - step] if e - step in held else before[e - step]) if e >= step else p
                for e, p in held.items()}
        step, tag = 2 * step, tag + 1
    return _shifted(call, chain, mine, held)


def _shifted(call, chain, mine, held):
    """Inclusive composites to exclusive states: each chunk takes its predecessor's b (zero after a cut)."""
    owner, rank, m = chain.owner, call.rank, len(chain.owner)
    zero = np.zeros_like(next(iter(held.values())).b)
    buffers = {int(e): np.empty_like(zero) for e in mine if e > 0 and not chain.cut[e] and owner[e - 1] != rank}
    call.swap([(owner[e + 1], held[int(e)].b) for e in mine if e + 1 < m and not chain.cut[e + 1]
               and owner[e + 1] != rank], [(owner[e - 1], buffer) for e, buffer in buffers.items()], SHIFT_TAG,
              "the scan's last shift")
    return [zero if chain.cut[e] or e == 0 else held[int(e) - 1].b if int(e) - 1 in held else buffers[int(e)]
            for e in mine]


PASSING = {"ring": ring, "allgather": allgather, "scan": scan}
