"""Blockwise attention with the log-sum-exp merge (NumPy, one process).

Arrays follow torch SDPA's convention ``(..., seq, dim)``: leading axes are
batch and heads. Grouped-query attention: q has ``Hq = g * Hk`` heads on
axis -3 and k, v have ``Hk``; query head h uses kv head ``h // g``.

A block mask is two integer arrays ``klo, khi`` of shape ``(Sq,)``: query row
i sees exactly the keys ``klo[i] <= j < khi[i]`` (see ``mpiring.masks``).
``None`` means every key is visible.
"""

import numpy as np

__all__ = ["attention_block", "merge", "reference_attention", "default_scale",
           "attention_block_backward", "reference_attention_backward"]


def default_scale(dim):
    """Softmax scale 1/sqrt(dim), as in torch SDPA."""
    return 1.0 / np.sqrt(dim)


def _group(q, k):
    """View q as (..., Hk, g, Sq, D) so that it broadcasts against k's heads."""
    if q.ndim < 3 or q.shape[-3] == k.shape[-3]:
        return q, 1
    g = q.shape[-3] // k.shape[-3]
    return q.reshape(q.shape[:-3] + (k.shape[-3], g) + q.shape[-2:]), g


def _visible(klo, khi, sk):
    """Dense boolean mask (Sq, Sk) from per-row key ranges."""
    cols = np.arange(sk)
    return (cols >= klo[:, None]) & (cols < khi[:, None])


def attention_block(q, k, v, scale=None, klo=None, khi=None, *, progress=None):
    """Attention of a query block against one key/value block.

    Returns ``(out, lse)``: the normalized output ``(..., Hq, Sq, Dv)`` and the
    log-sum-exp of the scaled scores over the visible keys ``(..., Hq, Sq)``.
    A row that sees no key is the neutral element: out 0, lse -inf.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    hq = q.shape[-3] if q.ndim >= 3 else None
    qg, g = _group(q, k)
    if g > 1:
        k, v = k[..., None, :, :], v[..., None, :, :]
    s = np.matmul(qg * q.dtype.type(scale), np.swapaxes(k, -1, -2))
    if klo is not None:
        s[..., ~_visible(klo, khi, k.shape[-2])] = -np.inf
    m = s.max(axis=-1, keepdims=True)
    m[np.isneginf(m)] = 0  # rows that see nothing: exp(-inf - 0) = 0
    np.subtract(s, m, out=s)
    np.exp(s, out=s)
    l = s.sum(axis=-1, keepdims=True)
    out = np.matmul(s, v)
    seen = l > 0
    np.divide(out, l, out=out, where=seen)
    lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    if g > 1:
        out = out.reshape(out.shape[:-4] + (hq,) + out.shape[-2:])
        lse = lse.reshape(lse.shape[:-3] + (hq,) + lse.shape[-1:])
    return out, lse


def merge(out, lse, block_out, block_lse):
    """Combine two partial attentions over disjoint key sets (log-sum-exp rule)."""
    # naive: new_lse = log(exp(lse) + exp(block_lse))
    #        out = (exp(lse) * out + exp(block_lse) * block_out) / exp(new_lse)
    new_lse = np.logaddexp(lse, block_lse)  # -inf when both are -inf, never NaN
    base = np.where(np.isneginf(new_lse), 0, new_lse)[..., None]
    out = np.exp(lse[..., None] - base) * out + np.exp(block_lse[..., None] - base) * block_out
    return out, new_lse


def reference_attention(q, k, v, scale=None, klo=None, khi=None, *, row_chunk=1024):
    """Plain softmax(q k^T * scale) v in float64, one dense row chunk at a time.

    Returns ``(out, lse)`` in float64. Rows that see no key give out 0, lse -inf.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scale = default_scale(q.shape[-1]) if scale is None else scale
    qg, g = _group(q, k)
    if g > 1:
        k, v = k[..., None, :, :], v[..., None, :, :]
    sq = q.shape[-2]
    outs, lses = [], []
    for a in range(0, sq, row_chunk):
        b = min(a + row_chunk, sq)
        s = np.matmul(qg[..., a:b, :], np.swapaxes(k, -1, -2)) * scale
        if klo is not None:
            s = np.where(_visible(klo[a:b], khi[a:b], k.shape[-2]), s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        outs.append(np.matmul(p, v) / np.where(l > 0, l, 1))
        lses.append(np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0])
    out, lse = np.concatenate(outs, axis=-2), np.concatenate(lses, axis=-1)
    if g > 1:
        hq = q.shape[-3]
        out = out.reshape(out.shape[:-4] + (hq,) + out.shape[-2:])
        lse = lse.reshape(lse.shape[:-3] + (hq,) + lse.shape[-1:])
    return out, lse


def attention_block_backward(dout, q, k, v, out, lse, scale=None, klo=None, khi=None, *, delta=None, progress=None):
    """Gradients of one query block's attention to one key/value block: ``(dq, dk, dv)``.

    ``out`` and ``lse`` are the forward results of the query rows over *all*
    their keys, so ``exp(s - lse)`` recomputes this block's slice of the full
    softmax and the gradients of all blocks simply add up. ``delta`` is
    ``rowsum(dout * out)`` (computed here when not given). Grouped-query: dk
    and dv are summed over the query heads of each group. Rows with lse -inf
    (they saw no key) contribute 0. Results have the input dtype.
    """
    # P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q
    scale = default_scale(q.shape[-1]) if scale is None else scale
    progress = progress or (lambda: None)
    if delta is None:
        delta = np.sum(dout * out, axis=-1)
    qg, g = _group(q, k)
    dog = _group(dout, k)[0]
    lse_g, delta_g = (_group(a[..., None], k)[0] for a in (lse, delta))  # (..., Sq, 1)
    if g > 1:
        k, v = k[..., None, :, :], v[..., None, :, :]
    p = np.matmul(qg, np.swapaxes(k, -1, -2))
    p *= q.dtype.type(scale)
    if klo is not None:
        p[..., ~_visible(klo, khi, k.shape[-2])] = -np.inf
    p -= np.where(np.isneginf(lse_g), np.inf, lse_g)  # rows with lse -inf: exp(-inf) = 0
    np.exp(p, out=p)
    progress()
    dv = np.matmul(np.swapaxes(p, -1, -2), dog)
    ds = np.matmul(dog, np.swapaxes(v, -1, -2))
    ds -= delta_g
    ds *= p
    ds *= q.dtype.type(scale)
    progress()
    dq = np.matmul(ds, k).reshape(q.shape)
    dk = np.matmul(np.swapaxes(ds, -1, -2), qg)
    if g > 1:
        dk, dv = dk.sum(axis=-3), dv.sum(axis=-3)
    return dq, dk, dv


def reference_attention_backward(dout, q, k, v, scale=None, klo=None, khi=None, *, row_chunk=256):
    """Plain dense gradients of softmax(q k^T * scale) v in float64: ``(dq, dk, dv)``.

    Independent of the forward pass: the probabilities are built from scratch,
    one row chunk at a time; grouped-query K/V heads are repeated, then their
    gradients are summed back. Rows that see no key contribute nothing.
    """
    dout, q, k, v = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    scale = default_scale(q.shape[-1]) if scale is None else scale
    g = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    kr, vr = (np.repeat(a, g, axis=-3) if g > 1 else a for a in (k, v))
    dq = np.zeros(q.shape)
    dk, dv = np.zeros(kr.shape), np.zeros(vr.shape)
    for a in range(0, q.shape[-2], row_chunk):
        b = min(a + row_chunk, q.shape[-2])
        s = np.matmul(q[..., a:b, :], np.swapaxes(kr, -1, -2)) * scale
        if klo is not None:
            s = np.where(_visible(klo[a:b], khi[a:b], k.shape[-2]), s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(m), m, 0))
        den = e.sum(axis=-1, keepdims=True)
        p = e / np.where(den > 0, den, 1)  # softmax; all-zero rows for rows that see nothing
        do = dout[..., a:b, :]
        o = np.matmul(p, vr)
        dv += np.matmul(np.swapaxes(p, -1, -2), do)
        dp = np.matmul(do, np.swapaxes(vr, -1, -2))
        ds = p * (dp - np.sum(do * o, axis=-1, keepdims=True))
        dq[..., a:b, :] = np.matmul(ds, kr) * scale
        dk += np.matmul(np.swapaxes(ds, -1, -2), q[..., a:b, :]) * scale
    if g > 1:
        dk = dk.reshape(k.shape[:-2] + (g,) + k.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(v.shape[:-2] + (g,) + v.shape[-2:]).sum(axis=-3)
    return dq, dk, dv
