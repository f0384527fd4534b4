"""Plain references to verify against: masks written from their definitions, softmax in float64.

Nothing here shares code with the masks, plans or kernels that the ring runs,
so a bug there cannot verify itself: the mask is the definition applied to
every (query, key) pair, and attention is the textbook softmax.
"""

import numpy as np

from .modifiers import Modifiers

__all__ = ["definition_mask", "dense_attention", "dense_attention_backward", "reference_attention",
           "reference_attention_backward"]


def definition_mask(q_pos, k_pos, *, causal=False, window=None, cu_seqlens=None, causal_block=None, mask=()):
    """Boolean (len(q_pos), len(k_pos)): may query position i see key position j?

    causal: j <= i; with causal_block F: j // F <= i // F (j's frame is not after i's).
    window (left, right), -1 or None unbounded: i - left <= j <= i + right
    (j - i is compared with the window as a Python integer: nothing wraps around).
    cu_seqlens [0, e1, ..., S]: i and j in the same document, document d holding
    positions cu[d] <= p < cu[d + 1]. ``mask``: more pieces (``plans.visibility.MaskPiece``), each by its own
    definition (``allows``).
    """
    gap = np.asarray(k_pos, np.int64)[None, :] - np.asarray(q_pos, np.int64)[:, None]  # j - i
    ok = np.ones(gap.shape, bool)
    if causal and causal_block:
        frame_q, frame_k = (np.asarray(p, np.int64) // causal_block for p in (q_pos, k_pos))
        ok &= frame_k[None, :] <= frame_q[:, None]
    elif causal:
        ok &= gap <= 0
    left, right = (-1, -1) if window is None else (-1 if w is None else int(w) for w in window)
    if left >= 0:  # compared as Python ints: a window beyond 64 bits is still just a number
        ok &= gap >= -left
    if right >= 0:
        ok &= gap <= right
    if cu_seqlens is not None:  # the document of p: how many document ends cu[1:] are <= p
        ends = np.asarray(cu_seqlens, np.int64)[1:]
        doc_q = (np.asarray(q_pos, np.int64)[:, None] >= ends[None, :]).sum(axis=1)
        doc_k = (np.asarray(k_pos, np.int64)[:, None] >= ends[None, :]).sum(axis=1)
        ok &= doc_q[:, None] == doc_k[None, :]
    for piece in mask:
        ok &= piece.allows(np.asarray(q_pos, np.int64)[:, None], np.asarray(k_pos, np.int64)[None, :])
    return ok


def _exp_scores(s, mask, a, b):
    """exp(s - m) of masked scores for rows a:b, the row max m (0 where a row sees nothing) and row sums."""
    if mask is not None:
        s = np.where(mask(a, b), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    return e, m, e.sum(axis=-1, keepdims=True)


def dense_attention(q, k, v, scale=None, mask=None, *, row_chunk=512):
    """softmax(scale q k^T) v in float64, one dense row chunk at a time: ``(out, lse)``.

    ``mask(a, b)`` gives the boolean mask of query rows a:b against every key
    (or None: no mask). Grouped-query heads: query head h uses K/V head h // g.
    Rows that see no key give out 0, lse -inf.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    g = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if g > 1:
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    outs, lses = [], []
    for a in range(0, q.shape[-2], row_chunk):
        b = min(a + row_chunk, q.shape[-2])
        p, m, den = _exp_scores(q[..., a:b, :] @ np.swapaxes(k, -1, -2) * scale, mask, a, b)
        outs.append(p @ v / np.where(den > 0, den, 1))
        lses.append(np.where(den > 0, m + np.log(np.where(den > 0, den, 1)), -np.inf)[..., 0])
    return np.concatenate(outs, axis=-2), np.concatenate(lses, axis=-1)


def dense_attention_backward(dout, q, k, v, scale=None, mask=None, *, row_chunk=256):
    """Gradients ``(dq, dk, dv)`` of ``dense_attention`` in float64, from the textbook formulas.

    The probabilities are built from scratch one row chunk at a time;
    grouped-query K/V heads are repeated, then their gradients summed back.
    """
    dout, q, k, v = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    g = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    kr, vr = (np.repeat(a, g, axis=-3) if g > 1 else a for a in (k, v))
    dq, dk, dv = np.zeros(q.shape), np.zeros(kr.shape), np.zeros(vr.shape)
    for a in range(0, q.shape[-2], row_chunk):
        b = min(a + row_chunk, q.shape[-2])
        e, _, den = _exp_scores(q[..., a:b, :] @ np.swapaxes(kr, -1, -2) * scale, mask, a, b)
        p = e / np.where(den > 0, den, 1)  # all-zero rows for rows that see no key
        do = dout[..., a:b, :]
        dv += np.swapaxes(p, -1, -2) @ do
        dp = do @ np.swapaxes(vr, -1, -2)
        ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
        dq[..., a:b, :] = ds @ kr * scale
        dk += np.swapaxes(ds, -1, -2) @ q[..., a:b, :] * scale
    if g > 1:
        dk = dk.reshape(k.shape[:-3] + (k.shape[-3], g) + k.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(v.shape[:-3] + (v.shape[-3], g) + v.shape[-2:]).sum(axis=-3)
    return dq, dk, dv


def _ranges(klo, khi, sk):
    """A ``mask(a, b)`` from per-row key ranges klo <= j < khi (the kernels' form), or None."""
    if klo is None:
        return None
    cols = np.arange(sk)
    return lambda a, b: (cols >= klo[a:b, None]) & (cols < khi[a:b, None])


def reference_attention(q, k, v, scale=None, klo=None, khi=None, *, row_chunk=1024):
    """``dense_attention`` with the mask given as per-row key ranges: row i sees keys klo[i] <= j < khi[i]."""
    return dense_attention(q, k, v, scale, _ranges(klo, khi, np.shape(k)[-2]), row_chunk=row_chunk)


def reference_attention_backward(dout, q, k, v, scale=None, klo=None, khi=None, *, row_chunk=256):
    """``dense_attention_backward`` with the mask given as per-row key ranges, as ``reference_attention``."""
    return dense_attention_backward(dout, q, k, v, scale, _ranges(klo, khi, np.shape(k)[-2]), row_chunk=row_chunk)


def scored_attention(q, k, v, allowed, *, scale=None, q_pos=None, k_pos=None, dout=None, **modifiers):
    """Attention with every score modifier, dense in float64, from the definitions (no tiles, no online softmax).

    ``allowed``: bool, broadcastable to (..., Hq, Sq, Sk) (a batched mask: (B, 1, Sq, Sk)); ``modifiers``: the
    fields of ``core.modifiers.Modifiers``. The logit r = scale q.k becomes softcap * tanh(r / softcap), plus
    ``bias(heads, q_pos, k_pos)``, then ``score_mod(s, batch, head, q_pos, k_pos)`` (its derivative
    ``score_mod_grad``); hidden keys drop out; ``sinks`` (one logit per query head) join each row's denominator;
    dropout keeps the entries ``core.scores.dropout_keep`` draws and scales them by 1 / (1 - dropout). Returns
    ``(out, lse, max_logit)`` (max_logit: the largest visible r per batch entry and head), and with ``dout``
    also ``(dq, dk, dv, dsinks)`` of the loss sum(dout * out), and d table when ``bias`` is a ``TableBias``.
    """
    from .scores import dropout_keep  # the generator is the definition of the dropped entries
    mods = Modifiers(**modifiers)
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    flat = q.ndim == 2
    if flat:
        q, k, v = q[None], k[None], v[None]
        allowed = None if allowed is None else np.asarray(allowed)[None] if np.ndim(allowed) == 2 else allowed
    hq, hk, n, m = q.shape[-3], k.shape[-3], q.shape[-2], k.shape[-2]
    g = hq // hk
    kk, vv = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    q_pos = np.arange(n) if q_pos is None else np.asarray(q_pos, np.int64)
    k_pos = np.arange(m) if k_pos is None else np.asarray(k_pos, np.int64)
    r = scale * (q @ np.swapaxes(kk, -1, -2))
    ok = np.ones(r.shape, bool) if allowed is None else np.broadcast_to(allowed, r.shape)
    max_logit = np.where(ok, r, -np.inf).max(axis=(-2, -1))
    t = np.tanh(r / mods.softcap) if mods.softcap is not None else None
    s = mods.softcap * t if mods.softcap is not None else r.copy()
    if mods.bias is not None:
        s = s + np.asarray(mods.bias(np.arange(hq)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]),
                           np.float64)
    u, where = s, None
    if mods.score_mod is not None:  # written here, not taken from the kernel; a result broadcasts as the kernel's
        tiled = u.reshape(-1, hq, n, m)
        where = (np.arange(tiled.shape[0])[:, None, None, None], np.arange(hq)[None, :, None, None],
                 q_pos[None, None, :, None], k_pos[None, None, None, :])
        s = np.broadcast_to(mods.score_mod(tiled, *where), tiled.shape).reshape(u.shape)
    s = np.where(ok, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    sink = None if mods.sinks is None else np.asarray(mods.sinks, np.float64)[:, None, None] * np.ones((n, 1))
    if sink is not None:
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, 0)
    e = np.exp(s - top)
    den = e.sum(axis=-1, keepdims=True) + (0 if sink is None else np.exp(sink - top))
    lse = np.where(den > 0, top + np.log(np.where(den > 0, den, 1)), -np.inf)
    p = np.where(den > 0, e / np.where(den > 0, den, 1), 0)
    z = 1.0
    if mods.dropout:
        z = dropout_keep(mods.seed, mods.dropout, int(np.prod(q.shape[:-3], dtype=np.int64)), np.arange(hq), q_pos,
                         k_pos).reshape(r.shape) / (1.0 - mods.dropout)
    out = (p * z) @ vv
    if dout is None:
        return (out[0], lse[0, ..., 0], max_logit[0]) if flat else (out, lse[..., 0], max_logit)
    do = np.asarray(dout, np.float64)
    do = do[None] if flat else do
    dv = np.swapaxes(p * z, -1, -2) @ do
    dp = z * (do @ np.swapaxes(vv, -1, -2))
    delta = np.sum(do * out, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dsinks = None
    if mods.sinks is not None:
        p_sink = np.where(den > 0, np.exp(sink - lse), 0)
        dsinks = -(p_sink * delta).reshape(-1, hq, n).sum(axis=(0, 2))
    if mods.score_mod is not None:  # tiled: u as the score_mod saw it
        ds = np.where(p > 0, ds * np.broadcast_to(mods.score_mod_grad(tiled, *where), tiled.shape).reshape(u.shape), 0)
    dtable = None
    if hasattr(mods.bias, "add_grad"):  # a TableBias: d table[h, bucket] sums d loss / d bias over its entries
        dtable = np.zeros(mods.bias.shape)
        mods.bias.add_grad(dtable, ds.reshape(-1, hq, n, m).sum(axis=0), np.arange(hq), q_pos, k_pos)
    if mods.softcap is not None:
        ds = ds * (1 - t * t)
    dq = scale * ds @ kk
    dk = scale * np.swapaxes(ds, -1, -2) @ q
    dk = dk.reshape(dk.shape[:-3] + (hk, g) + dk.shape[-2:]).sum(axis=-3)
    dv = dv.reshape(dv.shape[:-3] + (hk, g) + dv.shape[-2:]).sum(axis=-3)
    grads = (dq, dk, dv) if not flat else (dq[0], dk[0], dv[0])
    return grads + (dsinks,) + (() if dtable is None else (dtable,))
