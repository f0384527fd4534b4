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


def _seq_axis(x, axis):
    """The sequence axis: ``axis``, or by default -2 ((..., seq, dim) arrays) and 0 for 1-D arrays."""
    if axis is None:
        return 0 if x.ndim == 1 else -2
    return axis


def shard(x: np.ndarray, size: int, rank: int, layout: str = "contiguous", axis: int | None = None) -> np.ndarray:
    """The part of a full array ``x`` that ``rank`` holds, the sequence on ``axis``.

    ``axis`` defaults to -2 ((..., seq, dim) arrays such as q, k, v) and to 0
    for 1-D arrays; (B, S) token ids take ``axis=-1``, (B, S, H, D) ``axis=1``.
    contiguous and striped return a view of ``x`` (no copy; writes reach x);
    zigzag, whose two chunks are apart, returns a copy.
    """
    x = np.asarray(x)
    axis = _seq_axis(x, axis)
    seq_len = x.shape[axis]
    if layout == "zigzag":
        return np.take(x, shard_indices(seq_len, size, rank, layout), axis=axis)
    check_layout(layout)
    where = [slice(None)] * x.ndim
    if layout == "contiguous":
        n, start = block_range(seq_len, size, rank)
        where[axis] = slice(start, start + n)
    else:  # striped: every size-th token from rank
        where[axis] = slice(rank, None, size)
    return x[tuple(where)]


def unshard(pieces: list, layout: str = "contiguous", axis: int | None = None) -> np.ndarray:
    """Inverse of ``shard``: every rank's piece put back in sequence order, in a new array.

    ``axis`` as for ``shard`` (default -2, or 0 for 1-D pieces).
    """
    size = len(pieces)
    first = np.asarray(pieces[0])
    axis = _seq_axis(first, axis)
    seq_len = sum(np.shape(p)[axis] for p in pieces)
    shape = list(first.shape)
    shape[axis] = seq_len
    full = np.empty(shape, dtype=np.result_type(*pieces))
    moved = np.moveaxis(full, axis, 0)
    for rank, piece in enumerate(pieces):
        moved[shard_indices(seq_len, size, rank, layout)] = np.moveaxis(np.asarray(piece), axis, 0)
    return full
