"""Scores beyond ``scale * q.k``, and masks with holes: the general block kernel, forward and backward. No MPI.

For a tile of a rank's queries (global positions ``q_pos``) against a tile of
a block's keys (``k_pos``), with ``heads`` the query heads' global indices:

    r = scale * q @ k.T                     # the logit: max_logit is its largest visible value
    s = softcap * tanh(r / softcap)         # softcap=c (Gemma 2, Grok)
    s = s + bias(heads, q_pos, k_pos)       # bias=fn: ALiBi (``alibi``), relative positions, a ``TableBias``
    s = score_mod(s, batch, head, q_pos, k_pos)   # any elementwise function (flex_attention's score_mod)
    s = -inf where the mask hides the key   # the piece's interval, and the mask's holes (``Where``)
    p = softmax(s) over the row             # online: a running max per row, merged by log-sum-exp
    out = sum over keys of keep * p / (1 - dropout) * v

``keep`` is a counter-based hash of (seed, batch entry, head, query position,
key position): the same entries are dropped whatever the ranks, layout or
strategy, and the backward finds them again without storing them. Sinks are
not here: a sink is one more logit per head in each row's denominator, so it
joins the final lse once, after every block (``with_sinks``), and its
gradient is a sum over rows (``sink_grads``). The backward multiplies by
``score_mod_grad`` (d score_mod / d s, the user's) where there is a score_mod,
and sums a ``TableBias``'s gradient bucket by bucket into ``Score.dtable``
(``core.modifiers``).

This kernel is plain NumPy, tile by tile, for clarity; the fast kernel
(``kernels.attention_block``) serves every call with no modifier and an
exact interval mask, bit for bit as before.
"""

import math

import numpy as np

from .kernels import empty_or_nan, merge
from .modifiers import NO_MODIFIERS, Modifiers, TableBias, mod_values, tile_indices
from .tiles import kernel_dtype

__all__ = ["Score", "attend_general", "grads_general", "alibi_slopes", "alibi", "with_sinks", "sink_grads",
           "dropout_keep", "count_allowed", "allowed_rows", "FunctionFailed", "evaluated", "bias_probe", "mod_probe",
           "finite_bias"]

TILE_Q, TILE_K = 128, 512


class Score:
    """A call's scores: ``scale`` and its ``modifiers`` (``core.modifiers.Modifiers``; their sinks join after the
    blocks, ``with_sinks``); ``heads``: the global indices of the query heads a rank holds (None: all, in order;
    Ulysses holds a slice); ``max_logit``: where the forward keeps its largest visible logit per batch entry and
    global head (None: not asked); ``dtable``: where a backward sums the gradient of a ``TableBias`` bias (None:
    not asked). ``mods``: ``(score_mod, score_mod_grad)``."""

    def __init__(self, scale, modifiers=NO_MODIFIERS, heads=None, max_logit=None, finite=False, dtable=None):
        self.scale, self.modifiers, self.finite = float(scale), modifiers, finite
        self.softcap, self.bias = modifiers.softcap, modifiers.bias
        self.mods = (modifiers.score_mod, modifiers.score_mod_grad)
        self.dropout, self.seed = float(modifiers.dropout or 0.0), int(modifiers.seed or 0)
        self.heads, self.max_logit, self.dtable = heads, max_logit, dtable

    @classmethod
    def of(cls, spec, scale, q=None, finite=False, backward=False):
        """The spec's score at ``scale`` (``plain`` when it has no modifier: the fast kernel's call);
        ``q``: this rank's queries, for the max-logit statistic's shape (batch entries, heads); without it
        (a backward pass) no statistic is kept; ``finite``: a bias value that is NaN or +Inf raises
        ``FunctionFailed`` (``check_finite=True``; -Inf hides a key, as a mask does); ``backward``: a table
        bias's gradient is summed in ``dtable``."""
        stat = None
        if spec.return_max_logit and q is not None:
            stat = np.full(q.shape[:-2] if q.ndim > 2 else (1,), -np.inf)
        dtable = np.zeros(spec.bias.shape) if backward and isinstance(spec.bias, TableBias) else None
        bias = spec.bias.read() if isinstance(spec.bias, TableBias) else spec.bias  # its table read once per call
        modifiers = Modifiers(softcap=spec.softcap, bias=bias, score_mod=spec.score_mod,
                              score_mod_grad=spec.score_mod_grad, dropout=spec.dropout, seed=spec.seed)
        return cls(scale, modifiers, None, stat, finite, dtable)

    @property
    def plain(self):
        """No modifier and no statistic: the scale alone (the fast kernel's case)."""
        return (self.softcap is None and self.bias is None and not self.dropout and self.max_logit is None
                and self.mods[0] is None)

    def for_heads(self, heads):
        """The same score for a rank that holds the query heads ``heads`` (a slice of the global heads)."""
        return Score(self.scale, self.modifiers, heads, self.max_logit, self.finite, self.dtable)


class FunctionFailed(ValueError):
    """A user's mask, bias or score function raised: which one, on which positions, and what it raised."""


def evaluated(what, q_pos, k_pos, fn, *args):
    """``fn(*args)``: the user's function ``what`` (e.g. "the mask Function(f)") on query positions ``q_pos`` and key
    positions ``k_pos``; whatever it raises comes back as ``FunctionFailed`` naming the function and the positions."""
    try:
        return fn(*args)
    except FunctionFailed:
        raise
    except Exception as exc:  # noqa: BLE001 (a user's function: anything it raises is reported, with where)
        raise FunctionFailed(f"{what} fails on query positions {_span(q_pos)} and key positions {_span(k_pos)}: "
                             f"{type(exc).__name__}: {exc}") from exc


def finite_bias(values):
    """Raise ValueError if bias ``values`` hold NaN or +Inf (``check_finite=True``)."""
    bad = np.isnan(values) | np.isposinf(values)
    if bad.any():
        raise ValueError(f"it returned {int(bad.sum())} NaN/+Inf values (check_finite=True; -Inf hides a key)")


def bias_probe(bias, heads, q_pos, seq_len, finite=False):
    """Try ``bias`` on a rank's query positions ``q_pos`` against the sequence's first and last key, and on its
    first and last query against every key (``heads`` query heads): O(heads x seq_len) work that finds a function
    failing at some positions (an index past an array's end) before any data moves. ``FunctionFailed`` if it fails."""
    q_pos, h = np.asarray(q_pos, np.int64), np.arange(heads)[:, None, None]
    every = np.arange(seq_len, dtype=np.int64)
    for qp, kp in ((q_pos, every[[0, -1]]), (q_pos[[0, -1]], every)):
        values = evaluated(f"the bias function {getattr(bias, '__qualname__', type(bias).__qualname__)}", qp, kp,
                           bias, h, qp[None, :, None], kp[None, None, :])
        if finite:
            evaluated(f"the bias function {getattr(bias, '__qualname__', type(bias).__qualname__)}", qp, kp,
                      finite_bias, np.asarray(values))


def mod_probe(fn, what, heads, q_pos, seq_len, finite=False):
    """``bias_probe`` for a score_mod (``what``: "score_mod" or "score_mod_grad") on zero scores of one batch entry."""
    q_pos, every = np.asarray(q_pos, np.int64), np.arange(seq_len, dtype=np.int64)
    for qp, kp in ((q_pos, every[[0, -1]]), (q_pos[[0, -1]], every)):
        evaluated(f"the {what} {getattr(fn, '__qualname__', type(fn).__qualname__)}", qp, kp, mod_values, fn,
                  np.zeros((1, heads, len(qp), len(kp))), tile_indices(1, np.arange(heads), qp, kp), finite)


def _span(pos):
    pos = np.asarray(pos).reshape(-1)
    return "(none)" if not pos.size else str(int(pos[0])) if pos.size == 1 else f"{int(pos.min())}..{int(pos.max())}"


# ---------------------------------------------------------------- visible pairs of a mask with holes

_CHUNK = 1 << 22  # (query, key) entries evaluated at once


def count_allowed(mask, q_pos, k_pos, klo, khi):
    """``(counts, full)``: per query of ``q_pos``, the keys of the sorted ``k_pos`` inside its envelope
    ``klo:khi`` (indices) that ``mask.allows`` (any batch entry: the union), and whether every batch entry sees
    every key; ``allows`` is evaluated a chunk of rows at a time (``allowed_rows``)."""
    counts, full = np.zeros(len(q_pos), np.int64), bool(np.all(khi - klo == len(k_pos)))
    if len(q_pos) == 0 or int(khi.max()) <= int(klo.min()):  # no query's envelope holds a key
        return counts, len(k_pos) == 0 or len(q_pos) == 0
    for a, b, ok in allowed_rows(mask, q_pos, k_pos, klo, khi):
        if full:
            full = bool(np.all(ok))
        counts[a:b] = np.sum(ok.reshape((-1,) + ok.shape[-2:]).any(axis=0), axis=-1)
    return counts, full


def allowed_rows(mask, q_pos, k_pos, klo, khi):
    """Yield ``(a, b, ok)``: whether ``mask.allows`` query rows a:b to see the keys ``c:d`` of the sorted
    ``k_pos`` that some of their envelopes ``klo:khi`` hold (False outside a row's own), its batch and head axes
    first (as ``allows`` returns them); a chunk of rows at a time, never the whole (query, key) matrix. Chunks
    whose envelopes hold no key are left out."""
    c, d = (int(klo.min()), int(khi.max())) if len(q_pos) else (0, 0)
    if d <= c:
        return
    step = max(1, _CHUNK // max(1, (d - c) * math.prod(mask.counts() or (1,))))  # per batch entry and head
    for a in range(0, len(q_pos), step):
        b = min(a + step, len(q_pos))
        c, d = int(klo[a:b].min()), int(khi[a:b].max())  # the keys these rows' envelopes hold
        if d <= c:
            continue
        ok = evaluated(f"the mask {mask!r}", q_pos[a:b], k_pos[c:d], mask.allows, q_pos[a:b, None], k_pos[None, c:d])
        yield a, b, ok & (np.arange(c, d) >= klo[a:b, None]) & (np.arange(c, d) < khi[a:b, None])


# ---------------------------------------------------------------- ALiBi

def alibi_slopes(num_heads):
    """ALiBi's head slopes (Press et al.): 2^(-8 h / n) for n a power of two, else the nearest power's and every
    other one of the next (as the paper's code and transformers' ``build_alibi_tensor``)."""
    def powers(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(closest)
    if closest < num_heads:
        slopes += powers(2 * closest)[0::2][:num_heads - closest]
    return np.array(slopes)


def alibi(num_heads):
    """An ALiBi ``bias``: slope[h] * (k_pos - q_pos), for ``num_heads`` query heads."""
    slopes = alibi_slopes(num_heads)

    def alibi_bias(heads, q_pos, k_pos):
        return slopes[heads] * (k_pos - q_pos).astype(np.float64)
    return alibi_bias


# ---------------------------------------------------------------- dropout's counter-based generator

_K = [np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)]


def _mix(x):
    """splitmix64's finalizer, in place on a uint64 array (wrapping arithmetic)."""
    x ^= x >> np.uint64(30)
    x *= _K[1]
    x ^= x >> np.uint64(27)
    x *= _K[2]
    x ^= x >> np.uint64(31)
    return x


def dropout_keep(seed, p, batch, heads, q_pos, k_pos):
    """Which entries survive dropout ``p``: a bool array (batch, heads, q, k) from a hash of (seed, batch entry,
    global head, query position, key position). ``batch``: the number of batch entries (flattened)."""
    b = np.arange(batch, dtype=np.uint64)[:, None] * _K[3]
    b += np.uint64(int(seed) * 0x9E3779B97F4A7C15 % 2 ** 64)
    bh = _mix(_mix(b) + np.asarray(heads, np.uint64)[None, :] * _K[0])
    qh = _mix(np.asarray(q_pos, np.uint64) * _K[3] + _K[0])
    kh = _mix(np.asarray(k_pos, np.uint64) * _K[1] + _K[3])
    x = bh[:, :, None, None] ^ (qh[:, None] + (kh[None, :] ^ (qh[:, None] >> np.uint64(7))))
    x = _mix(_mix(x))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 >= p


# ---------------------------------------------------------------- the tiles

class _Block:
    """One piece of a block, grouped for GQA: q (B, hk, g, n, D), k (B, hk, 1, m, D), v (B, hk, 1, m, Dv)."""

    def __init__(self, q, k, v, piece, score, padded):
        a, b, c, d, where = piece.q0, piece.q1, piece.k0, piece.k1, piece.where
        self.klo, self.khi = piece.klo, piece.khi
        if padded:  # the ring's [k | 1]^T blocks: the keys as a transposed view
            k, v = np.swapaxes(k[..., :-1, :], -1, -2), np.swapaxes(v[..., :-1, :], -1, -2)
        if q.ndim == 2:
            q, k, v = q[None], k[None], v[None]
        self.lead = q.shape[:-3]
        hq, hk = q.shape[-3], k.shape[-3]
        self.g, self.hk, self.hq = hq // hk, hk, hq
        self.dt = kernel_dtype(q.dtype)
        batch = int(np.prod(self.lead, dtype=np.int64))
        self.batch = batch
        self.q = q[..., a:b, :].reshape((batch, hk, self.g, b - a, q.shape[-1]))
        self.k = k[..., c:d, :].reshape((batch, hk, 1, d - c, k.shape[-1]))
        self.v = v[..., c:d, :].reshape((batch, hk, 1, d - c, v.shape[-1]))
        self.n, self.m = b - a, d - c
        if where is None:
            raise ValueError("the general kernel needs the pieces' positions (plan.pieces gives them)")
        self.q_pos, self.k_pos, self.mask = where.q_pos[a:b], where.k_pos[c:d], where.mask
        self.score, self.ids = score, None  # ids: the last tile's bucket ids of a TableBias
        self.indices = (None, None)  # (tile, the score_mod's index arrays) of the last tile
        heads = self.score.heads
        if heads is None:
            self.heads = np.arange(hq)
        elif isinstance(heads, slice):
            self.heads = np.arange(heads.start or 0, heads.stop, heads.step or 1)
        else:
            self.heads = np.asarray(heads)

    def tile(self, i0, i1, j0, j1):
        """``(s, t, allowed, u)`` of rows i0:i1, keys j0:j1: the modified logits (-inf where hidden), tanh(r/c)
        when softcapped (for the backward), the visible entries (None: all) and the score before the score_mod
        (None without one); None when nothing is visible."""
        allowed = self._allowed(i0, i1, j0, j1)
        if allowed is not None and not allowed.any():
            return None
        sc = self.score
        qt = self.q[..., i0:i1, :].astype(self.dt, copy=False)
        kt = self.k[..., j0:j1, :].astype(self.dt, copy=False)
        s = np.matmul(qt, np.swapaxes(kt, -1, -2))
        s *= sc.scale
        if sc.max_logit is not None:
            self._note_max(s, allowed)
        t = None
        if sc.softcap is not None:
            t = np.tanh(s / sc.softcap)
            s = sc.softcap * t
        if sc.bias is not None:
            heads, qp, kp = self.heads[:, None, None], self.q_pos[i0:i1], self.k_pos[j0:j1]
            extra = evaluated(f"the bias function {getattr(sc.bias, '__qualname__', type(sc.bias).__qualname__)}",
                              qp, kp, self._bias, heads, qp, kp, sc.finite)
            s = s + extra.reshape(self.hk, self.g, i1 - i0, j1 - j0).astype(self.dt, copy=False)
        u = None
        if sc.mods[0] is not None:
            u, s = s, self.mod(0, s, i0, i1, j0, j1)
        if allowed is not None:
            s = np.where(allowed, s, -np.inf)
        return s, t, allowed, u

    def mod(self, which, s, i0, i1, j0, j1):
        """The score_mod (``which`` 0) or its derivative (1) on a tile's scores s (batch, hk, g, n, m)."""
        fn = self.score.mods[which]
        tile = np.broadcast_to(s, (self.batch, self.hk, self.g, i1 - i0, j1 - j0))
        tile = tile.reshape(self.batch, self.hq, i1 - i0, j1 - j0)
        if self.indices[0] != (i0, i1, j0, j1):  # the backward calls both on one tile: its indices made once
            self.indices = (i0, i1, j0, j1), tile_indices(self.batch, self.heads, self.q_pos[i0:i1], self.k_pos[j0:j1])
        indices = self.indices[1]
        what = "score_mod" if which == 0 else "score_mod_grad"
        got = evaluated(f"the {what} {getattr(fn, '__qualname__', type(fn).__qualname__)}", indices[2], indices[3],
                        mod_values, fn, tile, indices, self.score.finite)
        return got.reshape(tile.shape[:1] + (self.hk, self.g) + tile.shape[2:]).astype(self.dt, copy=False)

    def add_table_grad(self, ds, i0, i1, j0, j1):
        """Sum d loss / d bias of a tile (ds: batch, hk, g, n, m) into the score's ``dtable``."""
        dbias = ds.sum(axis=0).reshape(self.hq, i1 - i0, j1 - j0)
        qp, kp = self.q_pos[i0:i1], self.k_pos[j0:j1]
        evaluated(f"the bias {self.score.bias!r}", qp, kp, self.score.bias.add_grad, self.score.dtable, dbias,
                  self.heads, qp, kp, self.ids)

    def _bias(self, heads, q_pos, k_pos, finite=False):
        """The bias of a tile; a ``TableBias``'s bucket ids kept in ``ids`` for the tile's table gradient."""
        bias, q_pos, k_pos = self.score.bias, q_pos[None, :, None], k_pos[None, None, :]
        if isinstance(bias, TableBias):
            self.ids = bias.buckets(q_pos, k_pos)
            extra = bias.values()[heads, self.ids]
        else:
            extra = np.asarray(bias(heads, q_pos, k_pos))
        if finite:
            finite_bias(extra)
        shape = (self.hq, q_pos.shape[1], k_pos.shape[2])
        try:
            return np.broadcast_to(extra, shape)
        except ValueError:
            raise ValueError(f"bias returned shape {extra.shape}, which does not broadcast to (heads, queries, "
                             f"keys) = {shape}") from None

    def _allowed(self, i0, i1, j0, j1):
        ok = None
        if self.klo is not None:
            j = np.arange(j0, j1)
            ok = (j >= self.klo[i0:i1, None]) & (j < self.khi[i0:i1, None])
        if self.mask is not None:
            qp, kp = self.q_pos[i0:i1], self.k_pos[j0:j1]
            holes = evaluated(f"the mask {self.mask!r}", qp, kp, self.mask.allows_at, self.batch, self.heads,
                              qp[:, None], kp[None, :])
            ok = holes if ok is None else holes & ok
        if ok is None or ok.ndim == 2:
            return ok
        b, h = ok.shape[:2]  # (batch entries, heads, rows, keys), each 1 where the mask does not depend on it
        if b not in (1, self.batch) or h not in (1, self.hq):
            raise ValueError(f"the mask is per batch entry and head over {ok.shape[:2]}, but q holds {self.batch} "
                             f"batch entries (shape {self.lead}) and {self.hq} heads")
        return ok.reshape((b,) + ((self.hk, self.g) if h > 1 else (1, 1)) + ok.shape[-2:])

    def _note_max(self, r, allowed):
        shown = r if allowed is None else np.where(allowed, r, -np.inf)
        top = shown.max(axis=(-2, -1)).reshape(self.lead + (self.hq,))
        stat = self.score.max_logit
        np.maximum(stat[..., self.heads], top, out=top)
        stat[..., self.heads] = top

    def keep(self, p, i0, i1, j0, j1):
        """``p`` with dropout applied (entries dropped, the rest scaled by 1 / (1 - dropout)); p unchanged if none."""
        sc = self.score
        if not sc.dropout:
            return p
        keep = dropout_keep(sc.seed, sc.dropout, self.batch, self.heads, self.q_pos[i0:i1], self.k_pos[j0:j1])
        return p * keep.reshape(p.shape) / (1.0 - sc.dropout)

    def tiles(self):
        for i0 in range(0, self.n, TILE_Q):
            yield i0, min(i0 + TILE_Q, self.n), [(j0, min(j0 + TILE_K, self.m)) for j0 in range(0, self.m, TILE_K)]


def attend_general(q, k, v, piece, score, into, padded=False):
    """One piece of a K/V block into ``into = (out, lse)``, the rank's running results (views of all its rows)."""
    blk = _Block(q, k, v, piece, score, padded)
    a = piece[0]
    out, lse = into
    if q.ndim == 2:
        out, lse = out[None], lse[None]
    dv = blk.v.shape[-1]
    shape = (blk.batch, blk.hk, blk.g)
    for i0, i1, keys in blk.tiles():
        m = np.full(shape + (i1 - i0,), -np.inf, blk.dt)
        total, acc = np.zeros(shape + (i1 - i0,), blk.dt), np.zeros(shape + (i1 - i0, dv), blk.dt)
        for j0, j1 in keys:
            found = blk.tile(i0, i1, j0, j1)
            if found is None:
                continue
            s = found[0]
            m_new = np.maximum(m, s.max(axis=-1))
            shift = np.where(np.isfinite(m_new), m_new, 0)
            p = np.exp(s - shift[..., None])
            alpha = np.exp(m - shift)
            total = total * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + np.matmul(blk.keep(p, i0, i1, j0, j1),
                                                     blk.v[..., j0:j1, :].astype(blk.dt, copy=False))
            m = m_new
        seen = total > 0
        block_lse = np.where(seen, np.where(np.isfinite(m), m, 0) + np.log(np.where(seen, total, 1)),
                             empty_or_nan(total))
        block_out = acc / np.where(seen, total, 1)[..., None]
        rows = np.s_[..., a + i0:a + i1, :]
        o, s_ = out[rows], lse[..., a + i0:a + i1]
        merged = merge(o.astype(np.float64), s_.astype(np.float64),
                       block_out.reshape(o.shape), block_lse.reshape(s_.shape))
        out[rows], lse[..., a + i0:a + i1] = merged


def grads_general(dout, q, k, v, out, lse, delta, piece, score):
    """The gradients of one piece (rows a:b, keys c:d): ``(dq, dk, dv)`` of those rows and keys, from the final
    (out, lse) and delta = rowsum(dout * out); shapes as q[..., a:b, :], k[..., c:d, :], v[..., c:d, :]."""
    blk = _Block(q, k, v, piece, score, False)
    a, b = piece[0], piece[1]
    lead = q.shape[:-2]
    grouped = (blk.batch, blk.hk, blk.g)
    do = dout[..., a:b, :].reshape(grouped + (blk.n, dout.shape[-1]))
    ls = np.asarray(lse[..., a:b], np.float64).reshape(grouped + (blk.n,))
    ls = np.where(np.isneginf(ls), np.inf, ls)  # a row that sees no key: p = 0
    dl = np.asarray(delta[..., a:b], np.float64).reshape(grouped + (blk.n,))
    dq = np.zeros(grouped + (blk.n, q.shape[-1]), blk.dt)
    dk = np.zeros((blk.batch, blk.hk, 1, blk.m, k.shape[-1]), blk.dt)
    dv = np.zeros((blk.batch, blk.hk, 1, blk.m, v.shape[-1]), blk.dt)
    sc = blk.score
    for i0, i1, keys in blk.tiles():
        dot = do[..., i0:i1, :].astype(blk.dt, copy=False)
        for j0, j1 in keys:
            found = blk.tile(i0, i1, j0, j1)
            if found is None:
                continue
            s, t, _, u = found
            p = np.exp(s - ls[..., i0:i1, None]).astype(blk.dt, copy=False)
            vt = blk.v[..., j0:j1, :].astype(blk.dt, copy=False)
            kept = blk.keep(p, i0, i1, j0, j1)
            dv[..., j0:j1, :] += np.matmul(np.swapaxes(kept, -1, -2), dot).sum(axis=2, keepdims=True)
            dp = np.matmul(dot, np.swapaxes(vt, -1, -2))
            if sc.dropout:
                dp = blk.keep(dp, i0, i1, j0, j1)
            ds = p * (dp - dl[..., i0:i1, None])
            if u is not None:  # through the score_mod: its derivative, where a key is seen (p > 0)
                ds = np.where(p > 0, ds * blk.mod(1, u, i0, i1, j0, j1), 0)
            if sc.dtable is not None:
                blk.add_table_grad(ds, i0, i1, j0, j1)
            if t is not None:
                ds *= 1.0 - t * t
            ds *= sc.scale
            dq[..., i0:i1, :] += np.matmul(ds, blk.k[..., j0:j1, :].astype(blk.dt, copy=False))
            dk[..., j0:j1, :] += np.matmul(np.swapaxes(ds, -1, -2),
                                           blk.q[..., i0:i1, :].astype(blk.dt, copy=False)).sum(axis=2, keepdims=True)
    kv_lead = k.shape[:-2]
    return (dq.reshape(lead + (blk.n, q.shape[-1])), dk.reshape(kv_lead + (blk.m, k.shape[-1])),
            dv.reshape(kv_lead + (blk.m, v.shape[-1])))


# ---------------------------------------------------------------- sinks: once per row, after every block

def _sink_rows(sinks, lse):
    """The sinks broadcast against lse (..., H, n): one logit per query head."""
    return np.asarray(sinks, np.float64)[:, None] * np.ones(lse.shape[-1:]) if lse.ndim >= 2 else \
        np.asarray(sinks, np.float64)


def with_sinks(out, lse, sinks):
    """``(out, lse)`` with each head's sink logit added once to every row's denominator (gpt-oss): the sink is a
    key of value 0, so out shrinks by exp(lse - new lse)."""
    merged, new = merge(out, np.asarray(lse, np.float64), None, _sink_rows(sinks, lse))  # the sink: a block of 0
    return merged.astype(out.dtype, copy=False), new.astype(lse.dtype, copy=False)


def sink_grads(lse, delta, sinks):
    """This rank's share of d loss / d sinks: -sum over its rows and batch of p_sink * delta, per head, where
    p_sink = exp(sink - lse) (lse with the sinks in) and delta = rowsum(dout * out)."""
    p = np.exp(_sink_rows(sinks, lse) - np.asarray(lse, np.float64))
    total = -(p * np.asarray(delta, np.float64))
    return total.reshape(-1, *total.shape[-2:]).sum(axis=(0, 2)) if total.ndim >= 2 else total.sum(keepdims=True)
