"""Which keys each query may see: causal (or block-causal), sliding window and packed documents.

The ring keeps every block's global token positions sorted (a rank's rows
are put in position order before the ring and back after it), and every
rule allows an interval of positions, so the keys one query may see always
form one contiguous run of local key indices. A block
mask is therefore two integer arrays ``klo, khi``: row i sees keys
``klo[i] <= j < khi[i]``. This covers every option with one representation.
"""

import numpy as np

__all__ = ["visible_keys", "block_kind", "doc_ids", "check_window", "check_cu_seqlens", "check_causal_block",
           "row_work"]

_INT64_MAX = int(np.iinfo(np.int64).max)
_BIG = _INT64_MAX // 4  # beyond any position: q_pos +/- _BIG cannot wrap around


def check_window(window):
    """Return the window as (left, right) with -1 meaning unbounded (flash-attn's convention)."""
    if window is None:
        return (-1, -1)
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    out = []
    for name, w in (("left", left), ("right", right)):
        if w is None:
            w = -1
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < -1:
            raise ValueError(f"window {name} must be an integer >= 0, or -1/None for unbounded; got {w!r}")
        if w > _INT64_MAX:
            raise ValueError(f"window {name} must fit in 64 bits (at most {_INT64_MAX}); got {w!r}")
        out.append(int(w))
    return tuple(out)


def check_cu_seqlens(cu_seqlens, seq_len):
    """Validate flash-attn style cumulative document lengths; return them as int64."""
    if cu_seqlens is None:
        return None
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError("cu_seqlens must be a 1-D integer array [0, ..., seq_len] with at least 2 entries")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens must start at 0 and end at the total length {seq_len}; got {cu[0]} .. {cu[-1]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu


def check_causal_block(causal_block, causal):
    """Validate the frame size of a block-causal mask (None: plain causal); return it as an int or None."""
    if causal_block is None:
        return None
    if isinstance(causal_block, (bool, np.bool_)) or not isinstance(causal_block, (int, np.integer)) \
            or causal_block < 1:
        raise ValueError(f"causal_block must be a positive integer (tokens per frame), got {causal_block!r}")
    if not causal:
        raise ValueError(f"causal_block={causal_block} needs causal=True: it makes the causal mask block-causal")
    return int(causal_block)


def doc_ids(pos, cu_seqlens):
    """Index of the packed document each global position belongs to."""
    return np.searchsorted(cu_seqlens, pos, side="right") - 1


def visible_keys(q_pos, k_pos, *, causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None):
    """Per-query half-open ranges [klo, khi) of visible local key indices.

    ``q_pos`` are the global positions of a query block, ``k_pos`` the sorted
    global positions of a key block. ``causal_block=F``: key j is visible to
    query i iff j // F <= i // F (frame-causal). Returns ``(None, None)`` when
    nothing is masked at all.
    """
    left, right = window
    if not causal and left < 0 and right < 0 and cu_seqlens is None:
        return None, None
    q_pos = np.asarray(q_pos, dtype=np.int64)
    lo = np.full(q_pos.shape, -_BIG, dtype=np.int64)  # first visible position (inclusive)
    hi = np.full(q_pos.shape, _BIG, dtype=np.int64)  # last visible position (inclusive)
    if causal:  # the last key of the query's frame; a frame of 1 token: the query itself
        np.minimum(hi, q_pos if not causal_block else (q_pos // causal_block + 1) * causal_block - 1, out=hi)
    if right >= 0:  # a window wider than any sequence is clipped: q_pos + right must not wrap around
        np.minimum(hi, q_pos + min(right, _BIG), out=hi)
    if left >= 0:
        np.maximum(lo, q_pos - min(left, _BIG), out=lo)
    if cu_seqlens is not None:
        d = doc_ids(q_pos, cu_seqlens)
        np.maximum(lo, cu_seqlens[d], out=lo)
        np.minimum(hi, cu_seqlens[d + 1] - 1, out=hi)
    klo = np.searchsorted(k_pos, lo, side="left")
    khi = np.searchsorted(k_pos, hi, side="right")
    return klo, np.maximum(khi, klo)


def block_kind(klo, khi, n_keys):
    """Classify a block as "full", "masked" or "skip"; also return its visible pairs."""
    if klo is None:
        return "full", None
    pairs = int(np.sum(khi - klo))
    if pairs == 0:
        return "skip", 0
    if pairs == len(klo) * n_keys:
        return "full", pairs
    return "masked", pairs


def row_work(seq_len, *, causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None):
    """Visible keys of every query position 0 .. seq_len-1 against the whole sequence (int64)."""
    pos = np.arange(seq_len, dtype=np.int64)
    klo, khi = visible_keys(pos, pos, causal=causal, window=check_window(window), cu_seqlens=cu_seqlens,
                            causal_block=causal_block)
    return np.full(seq_len, seq_len, np.int64) if klo is None else khi - klo
