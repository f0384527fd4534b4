"""How the sequence is dealt out to ranks: contiguous, zigzag and striped.

- contiguous: rank r holds the r-th of P consecutive chunks.
- zigzag: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, so every rank has as much causal work as every other.
- striped: token t lives on rank t mod P (Brandon et al., Striped Attention).

Lengths need not divide evenly: chunk sizes differ by at most one token.
"""

import numpy as np

__all__ = ["LAYOUTS", "block_range", "shard_indices", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def block_range(n, size, rank):
    """Length and start of block ``rank`` when n items are cut into ``size`` blocks."""
    q, r = divmod(n, size)
    count = q + (1 if rank < r else 0)
    start = rank * q + min(rank, r)
    return count, start


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return layout


def shard_indices(seq_len: int, size: int, rank: int, layout: str = "contiguous") -> np.ndarray:
    """Sorted global token positions that ``rank`` holds."""
    check_layout(layout)
    if layout == "contiguous":
        n, s = block_range(seq_len, size, rank)
        return np.arange(s, s + n)
    if layout == "zigzag":
        n0, s0 = block_range(seq_len, 2 * size, rank)
        n1, s1 = block_range(seq_len, 2 * size, 2 * size - 1 - rank)
        return np.concatenate([np.arange(s0, s0 + n0), np.arange(s1, s1 + n1)])
    return np.arange(rank, seq_len, size)


def shard(x: np.ndarray, size: int, rank: int, layout: str = "contiguous", axis: int = -2) -> np.ndarray:
    """The part of a full array ``x`` that ``rank`` holds (sequence on ``axis``)."""
    idx = shard_indices(x.shape[axis], size, rank, layout)
    if layout == "contiguous" and len(idx):
        sl = [slice(None)] * x.ndim
        sl[axis] = slice(idx[0], idx[-1] + 1)
        return x[tuple(sl)]
    return np.take(x, idx, axis=axis)


def unshard(pieces: list, layout: str = "contiguous", axis: int = -2) -> np.ndarray:
    """Inverse of ``shard``: put every rank's piece back in sequence order."""
    size = len(pieces)
    seq_len = sum(p.shape[axis] for p in pieces)
    first = pieces[0]
    shape = list(first.shape)
    shape[axis] = seq_len
    full = np.empty(shape, dtype=np.result_type(*pieces))
    moved = np.moveaxis(full, axis, 0)
    for rank, piece in enumerate(pieces):
        moved[shard_indices(seq_len, size, rank, layout)] = np.moveaxis(piece, axis, 0)
    return full
