"""Which keys each query may see: the mask pieces (causal, block-causal frames, windows, documents, a prefix,
padding, any function of positions) and how they combine (``&``, ``|``).

The ring keeps every block's global token positions sorted (a rank's rows
are put in position order before the ring and back after it), and every
rule allows an interval of positions, so the keys one query may see always
form one contiguous run of local key indices. A block
mask is therefore two integer arrays ``klo, khi``: row i sees keys
``klo[i] <= j < khi[i]``. This covers every option with one representation.

Each kind of mask is a ``MaskPiece``: ``bounds(q_pos)`` gives the first and
last key position each query may see (both non-decreasing in the query's
position), ``allows(q_pos, k_pos)`` the same from the definition, for the
references. A call's mask is the pieces its options name (``pieces``:
``Causal``, ``Window``, ``Documents``) and any it is given (``Spec.of(mask=...)``),
all of which must allow a key: their intervals intersect. A new kind is one
such class (docs/extending.md); the plans, the balancers, the cost model and
the references take it as they are.

Not every mask is one interval per query: ``a | b`` (a window or a few
global tokens), ``function(fn)`` (any rule of positions), ``padding(lengths)``
(a different length per batch row). Such a piece says ``exact = False``:
``bounds`` is then only an envelope (every visible key lies inside it) and
``allows`` is the truth. The plan counts a block's visible pairs from
``allows`` (``count_visible``: empty blocks are skipped), and the kernel
evaluates ``allows`` on each tile of the envelope (``core.scores``).
"""

import functools

import numpy as np

from ..core.scores import count_allowed
from .content import content

__all__ = ["visible_keys", "block_kind", "doc_ids", "check_window", "check_cu_seqlens", "check_causal_block",
           "row_work", "MaskPiece", "Causal", "Window", "Documents", "Prefix", "Padding", "And", "Or",
           "pieces", "check_mask", "combined", "is_exact", "count_visible"]

_INT64_MAX = int(np.iinfo(np.int64).max)
BIG = _INT64_MAX // 4  # beyond any position: q_pos +/- BIG cannot wrap around


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


class MaskPiece:
    """One kind of mask: query position q sees key positions ``lo(q) .. hi(q)`` (inclusive, both non-decreasing
    in q). Subclasses define ``bounds``, ``allows`` and ``__repr__``; pieces are equal when their fields are.

    ``exact = False``: ``bounds`` is an envelope only, ``allows`` says which keys inside it are visible.
    ``batched = True``: ``allows`` depends on the batch entry too, and returns the batch axes first.
    ``headed = True``: it depends on the head too: ``allows`` returns (batch, heads, q, k) over every batch entry
    and head (the plan's union), ``allows_at`` those the kernel holds.
    ``sparse_keys = True``: the sparse movement sends only the keys a rank's queries see, not whole blocks.
    ``a & b``: keys both allow; ``a | b``: keys either allows.
    """

    exact = True
    batched = False
    headed = False
    sparse_keys = False  # under mode="sparse", send only the keys some query of the receiving rank sees

    def bounds(self, q_pos):
        """``(lo, hi)`` int64 arrays for the query positions ``q_pos`` (int64); +-``BIG``: unbounded."""
        return np.full(np.shape(q_pos), -BIG, np.int64), np.full(np.shape(q_pos), BIG, np.int64)

    def allows(self, q_pos, k_pos):
        """Whether query position q may see key position k, from the mask's definition (broadcasting)."""
        raise NotImplementedError

    def allows_at(self, batch, heads, q_pos, k_pos):
        """``allows`` for ``batch`` (flattened) batch entries and the global query heads ``heads`` (int64): a bool
        array that broadcasts to (batch, len(heads), q, k), its batch and head axes 1 where it does not depend
        on them."""
        ok = np.asarray(self.allows(q_pos, k_pos))
        return ok.reshape((-1, 1) + ok.shape[-2:]) if ok.ndim > 2 else ok[None, None]

    def counts(self):
        """``(batch, heads)``: the batch entries and heads a headed piece is defined over (None: not headed)."""
        return None

    def problem(self, seq_len):
        """Why this piece cannot mask a sequence of ``seq_len`` tokens, or None (documents: their ends)."""
        return None

    def leaves(self):
        """The pieces this one is made of (itself, or a combination's parts, all the way down)."""
        return (self,)

    def key(self):
        """What the piece is, comparable across processes: its class and the content of its fields (arrays by
        their bytes, functions by everything they read: ``plans.content``)."""
        return type(self).__qualname__, content(vars(self), type(self).__qualname__).digest

    def __eq__(self, other):
        return isinstance(other, MaskPiece) and other.key() == self.key()

    def __hash__(self):
        return hash(self.key())

    def __and__(self, other):
        return And(self, _piece(other, "&"))

    def __or__(self, other):
        return Or(self, _piece(other, "|"))


def _piece(other, op):
    if not isinstance(other, MaskPiece):
        raise TypeError(f"a mask combines with {op} only with another mask piece (mpiring.masks), "
                        f"not {type(other).__name__}")
    return other


class Causal(MaskPiece):
    """Key j visible to query i iff j <= i; ``frame=F``: iff j // F <= i // F (block-causal video frames)."""

    def __init__(self, frame=None):
        self.frame = frame

    def bounds(self, q_pos):  # the last key of the query's frame; a frame of 1 token: the query itself
        hi = q_pos if not self.frame else (q_pos // self.frame + 1) * self.frame - 1
        return np.full(q_pos.shape, -BIG, np.int64), hi

    def allows(self, q_pos, k_pos):
        return k_pos // self.frame <= q_pos // self.frame if self.frame else k_pos <= q_pos

    def __repr__(self):
        return f"Causal(frame={self.frame})"


class Window(MaskPiece):
    """Keys i - left .. i + right visible to query i (flash-attn's window; -1: that side unbounded)."""

    def __init__(self, left, right):
        self.left, self.right = left, right

    def bounds(self, q_pos):  # a window wider than any sequence is clipped: q_pos +/- w must not wrap around
        lo = q_pos - min(self.left, BIG) if self.left >= 0 else np.full(q_pos.shape, -BIG, np.int64)
        hi = q_pos + min(self.right, BIG) if self.right >= 0 else np.full(q_pos.shape, BIG, np.int64)
        return lo, hi

    def allows(self, q_pos, k_pos):
        ok = np.ones(np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos)), bool)
        if self.left >= 0:
            ok &= k_pos >= q_pos - self.left
        if self.right >= 0:
            ok &= k_pos <= q_pos + self.right
        return ok

    def __repr__(self):
        return f"Window({self.left}, {self.right})"


class Documents(MaskPiece):
    """Packed documents ``cu_seqlens = [0, e1, ..., S]``: query i sees the keys of its own document only."""

    def __init__(self, cu_seqlens):
        self.cu = np.asarray(cu_seqlens, np.int64)

    def problem(self, seq_len):
        try:
            check_cu_seqlens(self.cu, seq_len)
        except ValueError as exc:
            return f"mask {self!r}: {exc}"
        return None

    def bounds(self, q_pos):
        d = doc_ids(q_pos, self.cu)
        return self.cu[d], self.cu[d + 1] - 1

    def allows(self, q_pos, k_pos):  # the document of p: how many document ends cu[1:] are <= p
        ends = self.cu[1:]
        return np.searchsorted(ends, q_pos, side="right") == np.searchsorted(ends, k_pos, side="right")

    def __repr__(self):
        items = self.cu.tolist()
        return f"Documents({items if len(items) <= 8 else f'[{items[0]}, {items[1]}, ..., {items[-1]}]'})"


class Prefix(MaskPiece):
    """The first ``n`` tokens see each other (a bidirectional prefix); ``causal() | prefix(n)`` is a prefix LM."""

    def __init__(self, n):
        self.n = n

    def bounds(self, q_pos):  # past the prefix: the empty run n .. n - 1, so both bounds never decrease
        return np.where(q_pos < self.n, 0, self.n).astype(np.int64), np.full(q_pos.shape, self.n - 1, np.int64)

    def allows(self, q_pos, k_pos):
        return (q_pos < self.n) & (k_pos < self.n)

    def __repr__(self):
        return f"Prefix({self.n})"


class Padding(MaskPiece):
    """Batch entry b's keys at or past ``lengths[b]`` are hidden (a padded batch): ``allows`` is batched."""

    exact = property(lambda self: not self.batched)

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, np.int64)

    @property
    def batched(self):
        return self.lengths.ndim > 0 and bool(np.any(self.lengths != self.lengths.flat[0]))

    def bounds(self, q_pos):
        return (np.full(q_pos.shape, -BIG, np.int64),
                np.full(q_pos.shape, int(self.lengths.max(initial=0)) - 1, np.int64))

    def allows(self, q_pos, k_pos):
        shape = np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos))
        if not self.batched:
            return np.broadcast_to(k_pos < int(self.lengths.max(initial=0)), shape)
        lengths = self.lengths.reshape(self.lengths.shape + (1,) * len(shape))
        return np.broadcast_to(k_pos < lengths, self.lengths.shape + shape)

    def __repr__(self):
        items = self.lengths.tolist()
        return f"Padding({items if self.lengths.size <= 8 else f'{self.lengths.size} lengths'})"


class _Combination(MaskPiece):
    """Pieces joined by one rule: ``JOIN`` of their ``allows``, their bounds narrowed (``&``) or widened (``|``)
    from ``START``; nested combinations of the same kind are flattened."""

    JOIN = SYMBOL = None
    START = LO = HI = None  # the bounds before any part; how a part's first and last key combine into them

    def __init__(self, *parts):
        self.parts = tuple(q for p in parts for q in (p.parts if type(p) is type(self) else (p,)))

    batched = property(lambda self: any(p.batched for p in self.parts))
    headed = property(lambda self: any(p.headed for p in self.parts))
    sparse_keys = property(lambda self: any(p.sparse_keys for p in self.parts))

    def problem(self, seq_len):
        return next(filter(None, (part.problem(seq_len) for part in self.parts)), None)

    def leaves(self):
        return tuple(leaf for part in self.parts for leaf in part.leaves())

    def bounds(self, q_pos):  # never decreasing, as the parts'
        lo, hi = (np.full(q_pos.shape, edge, np.int64) for edge in self.START)
        for part in self.parts:
            first, last = part.bounds(q_pos)
            lo, hi = self.LO(lo, first), self.HI(hi, last)
        return lo, hi

    def counts(self):
        found = {c for c in (p.counts() for p in self.leaves()) if c is not None}
        if len(found) > 1:
            raise ValueError(f"the mask functions of {self!r} are over different (batch, heads): {sorted(found)}")
        return found.pop() if found else None

    def allows(self, q_pos, k_pos):
        counts = self.counts()
        if counts is not None:  # every part over the same batch entries and heads
            return self.allows_at(counts[0], np.arange(counts[1]), q_pos, k_pos)
        return functools.reduce(self.JOIN, (p.allows(q_pos, k_pos) for p in self.parts))

    def allows_at(self, batch, heads, q_pos, k_pos):
        return functools.reduce(self.JOIN, (p.allows_at(batch, heads, q_pos, k_pos) for p in self.parts))

    def __repr__(self):
        return f" {self.SYMBOL} ".join(f"({p!r})" if isinstance(p, _Combination) else repr(p) for p in self.parts)


class And(_Combination):
    """Keys every part allows."""

    JOIN, SYMBOL, START, LO, HI = np.logical_and, "&", (-BIG, BIG), np.maximum, np.minimum
    exact = property(lambda self: all(p.exact for p in self.parts))


class Or(_Combination):
    """Keys some part allows; its bounds are the parts' envelope, so it is never taken as exact."""

    JOIN, SYMBOL, START, LO, HI = np.logical_or, "|", (BIG, -BIG), np.minimum, np.maximum
    exact = False


def pieces(causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None, mask=()):
    """The mask pieces a call's options name, then those it is given (``mask``)."""
    named = [Causal(causal_block)] if causal else []
    if window[0] >= 0 or window[1] >= 0:
        named.append(Window(*window))
    if cu_seqlens is not None:
        named.append(Documents(cu_seqlens))
    return tuple(named) + tuple(mask)


def check_mask(mask, seq_len=None):
    """``mask`` (None, a piece, or pieces) as a tuple of ``MaskPiece``; ValueError otherwise, or if a piece cannot
    mask ``seq_len`` tokens (``MaskPiece.problem``)."""
    if mask is None:
        return ()
    found = (mask,) if isinstance(mask, MaskPiece) else mask
    try:
        found = tuple(found)
    except TypeError:
        found = (found,)
    bad = [m for m in found if not isinstance(m, MaskPiece)]
    if bad:
        raise ValueError(f"mask must be mask pieces (mpiring.plans.visibility.MaskPiece: Causal, Window, Documents, "
                         f"or a class of your own), got {bad[0]!r}")
    problem = next(filter(None, (piece.problem(seq_len) for piece in found)), None) if seq_len is not None else None
    if problem:
        raise ValueError(problem)
    return found


def visible_keys(q_pos, k_pos, *, causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None, mask=()):
    """Per-query half-open ranges [klo, khi) of visible local key indices.

    ``q_pos`` are the global positions of a query block, ``k_pos`` the sorted
    global positions of a key block. ``causal_block=F``: key j is visible to
    query i iff j // F <= i // F (frame-causal). ``mask``: more pieces, all of
    which must allow a key. Returns ``(None, None)`` when nothing is masked at all.
    """
    every = pieces(causal, window, cu_seqlens, causal_block, mask)
    if not every:
        return None, None
    q_pos = np.asarray(q_pos, dtype=np.int64)
    lo = np.full(q_pos.shape, -BIG, dtype=np.int64)  # first visible position (inclusive)
    hi = np.full(q_pos.shape, BIG, dtype=np.int64)  # last visible position (inclusive)
    for piece in every:
        first, last = piece.bounds(q_pos)
        np.maximum(lo, first, out=lo)
        np.minimum(hi, last, out=hi)
    klo = np.searchsorted(k_pos, lo, side="left")
    khi = np.searchsorted(k_pos, hi, side="right")
    return klo, np.maximum(khi, klo)


def combined(causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None, mask=()):
    """The one piece every option's piece must allow (``And`` of them), or None when nothing is masked."""
    every = pieces(causal, window, cu_seqlens, causal_block, mask)
    return None if not every else every[0] if len(every) == 1 else And(*every)


def is_exact(mask):
    """Whether ``visible_keys`` is the whole truth for these mask options: every piece one interval, unbatched."""
    return all(p.exact and not p.batched for p in pieces(**mask))


def count_visible(q_pos, k_pos, mask, klo=None, khi=None):
    """``(counts, full)``: the keys each query of ``q_pos`` sees among the sorted ``k_pos`` under the mask options
    (any batch entry: the union), and whether every batch entry sees every key. For an exact mask the counts
    are ``khi - klo``; otherwise ``allows`` is evaluated on the envelope (``visible_keys``), a chunk of rows at a
    time. ``klo, khi``: the envelope, when the caller has it."""
    q_pos, k_pos = np.asarray(q_pos, np.int64), np.asarray(k_pos, np.int64)
    if klo is None:
        klo, khi = visible_keys(q_pos, k_pos, **mask)
    if klo is None:
        return np.full(len(q_pos), len(k_pos), np.int64), True
    if is_exact(mask):
        counts = (khi - klo).astype(np.int64)
        return counts, bool(np.all(counts == len(k_pos)))
    return count_allowed(combined(**mask), q_pos, k_pos, klo, khi)


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


def row_work(seq_len, *, causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None, mask=()):
    """Visible keys of every query position 0 .. seq_len-1 against the whole sequence (int64)."""
    pos = np.arange(seq_len, dtype=np.int64)
    return count_visible(pos, pos, dict(causal=causal, window=check_window(window), cu_seqlens=cu_seqlens,
                                        causal_block=causal_block, mask=mask))[0]
