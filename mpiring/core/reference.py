"""Plain references to verify against: masks written from their definitions, softmax in float64.

Nothing here shares code with the masks, plans or kernels that the ring runs,
so a bug there cannot verify itself: the mask is the definition applied to
every (query, key) pair, and attention is the textbook softmax.
"""

import numpy as np

__all__ = ["definition_mask", "dense_attention", "dense_attention_backward", "reference_attention",
           "reference_attention_backward"]


def definition_mask(q_pos, k_pos, *, causal=False, window=None, cu_seqlens=None, causal_block=None, mask=()):
    """Boolean (len(q_pos), len(k_pos)): may query position i see key position j?

    causal: j <= i; with causal_block F: j // F <= i // F (j's frame is not after i's).
    window (left, right), -1 or None unbounded: i - left <= j <= i + right
    (j - i is compared with the window as a Python integer: nothing wraps around).
    cu_seqlens [0, e1, ..., S]: i and j in the same document, document d holding
    positions cu[d] <= p < cu[d + 1]. ``mask``: more pieces (``plans.masks.MaskPiece``), each by its own
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
