"""How the sequence is dealt out to ranks: contiguous, zigzag and striped.

- contiguous: rank r holds the r-th of P consecutive chunks.
- zigzag: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, so every rank has as much causal work as every other.
- striped: token t lives on rank t mod P (Brandon et al., Striped Attention).

Lengths need not divide evenly: chunk sizes differ by at most one token.

A layout is just one way to produce positions: ``ring_attention(positions=...)``
takes any arrays that partition the sequence (``mpiring.balance`` makes more).
The ring keeps each rank's rows in position order (``sort_order``,
``take_rows``) and gives results back in the caller's (``put_rows``).
"""

import numpy as np

from ..core.ranks import ranks_text

__all__ = ["LAYOUTS", "block_range", "shard_indices", "shard", "unshard", "layout_positions", "positions_problem",
           "sort_order", "take_rows", "put_rows"]

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


# ---------------------------------------------------------------- positions as data


def layout_positions(seq_len, size, layout="contiguous"):
    """The positions every rank holds under a built-in layout: ``size`` sorted arrays."""
    return [shard_indices(seq_len, size, r, layout) for r in range(size)]


def positions_problem(parts, seq_len, name="positions", partition=True):
    """Why ``parts`` (one integer array per rank) is not a partition of range(seq_len), or None.

    ``partition=False``: the positions need only be distinct and in range (queries
    against a longer K/V hold a subset of the keys' positions).
    """
    for r, p in enumerate(parts):
        if len(p) == 0:
            return f"{name} of rank {r} is empty: every rank needs at least one token"
        low, high = int(p.min()), int(p.max())
        if low < 0 or high >= seq_len:
            bad = low if low < 0 else high
            return f"{name} of rank {r} holds {bad}, outside 0 .. {seq_len - 1}"
    counts = np.bincount(np.concatenate(parts), minlength=seq_len)  # every position is in range here
    twice = np.flatnonzero(counts > 1)
    if twice.size:
        holders = [r for r, p in enumerate(parts) if np.any(p == twice[0])]
        return (f"{name}: position {int(twice[0])} is held more than once (by {ranks_text(holders)}); "
                f"each must be held once")
    if partition and counts.size and counts.min() == 0:
        return f"{name} must hold every position 0 .. {seq_len - 1} once; no rank holds {int(np.argmin(counts))}"
    return None


def sort_order(positions):
    """The permutation that sorts ``positions``, or None when they already are or are None (nothing to move)."""
    if positions is None:
        return None
    positions = np.asarray(positions)
    if positions.size < 2 or np.all(positions[1:] > positions[:-1]):
        return None
    return np.argsort(positions, kind="stable")


def take_rows(a, order, axis=-2):
    """``a``'s rows (on ``axis``) in position order; ``a`` itself when ``order`` is None."""
    return a if order is None else np.take(a, order, axis=axis)


def put_rows(a, order, axis=-2):
    """Inverse of ``take_rows``: rows in position order back to the caller's order."""
    if order is None:
        return a
    out = np.empty_like(a)
    moved = np.moveaxis(out, axis, 0)
    moved[order] = np.moveaxis(a, axis, 0)
    return out
