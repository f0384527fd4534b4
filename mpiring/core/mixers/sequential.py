"""The sequence mixers token by token, in float64: what the chunked kernels and the rings are checked against. No MPI.

    out, final = recurrence(q, k, v, g=g, beta=beta)              # (Z, n, dk), (Z, n, dk), (Z, n, dv)
    dq, dk, dv, dg, dbeta, dstate = recurrence_backward(dout, q, k, v, g=g, beta=beta)
    y = conv(x, weight, bias)                                     # (Z, n, C), (C, w), (C,)

The recurrence, per row z of the leading axis and token t (``starts[t]``: a
document begins at t, the state restarts from zero):

    S_t = a_t S_{t-1} + k_t v_t^T                          (no beta)
    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T   (the gated delta rule)
    o_t = S_t^T q_t

with ``a_t`` 1 (``g`` None), ``exp(g_t)`` (``g`` of shape (Z, n): one decay per
head) or ``diag(exp(g_t))`` (``g`` (Z, n, dk): one per key dimension, GLA and
Mamba-1). The backward is back-propagation through the same loop, written out
by hand; it shares no code with the chunked kernels.
"""

import numpy as np

__all__ = ["recurrence", "recurrence_backward", "conv", "conv_backward"]


def _decay(g, t, dk):
    """The decay of token t as an array that scales the state's rows: (Z, 1, 1) or (Z, dk, 1)."""
    if g is None:
        return None
    a = np.exp(g[:, t])
    return a[:, None, None] if a.ndim == 1 else a[:, :, None]


def _steps(q, k, v, g, beta, state, starts):
    """Every state S_t (and the decayed S_{t-1} the delta rule reads), token by token."""
    Z, n, dk = k.shape
    S = np.zeros((Z, dk, v.shape[-1])) if state is None else np.array(state, np.float64)
    states, decayed = [], []
    for t in range(n):
        if starts is not None and starts[t]:
            S = np.zeros_like(S)
        a = _decay(g, t, dk)
        Sd = S if a is None else a * S
        kt, vt = k[:, t], v[:, t]
        if beta is None:
            S = Sd + kt[:, :, None] * vt[:, None, :]
        else:
            r = vt - np.einsum("zi,zij->zj", kt, Sd)
            S = Sd + beta[:, t, None, None] * kt[:, :, None] * r[:, None, :]
        states.append(S)
        decayed.append(Sd)
    return states, decayed


def _as64(*arrays):
    return [None if a is None else np.asarray(a, np.float64) for a in arrays]


def recurrence(q, k, v, g=None, beta=None, state=None, starts=None):
    """``(out, final state)`` of the recurrence above in float64; ``state``: the initial (Z, dk, dv) one."""
    q, k, v, g, beta = _as64(q, k, v, g, beta)
    states, _ = _steps(q, k, v, g, beta, state, starts)
    out = np.stack([np.einsum("zi,zij->zj", q[:, t], S) for t, S in enumerate(states)], axis=1)
    return out, states[-1]


def recurrence_backward(dout, q, k, v, g=None, beta=None, state=None, starts=None, dfinal=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dstate)`` of ``recurrence`` by back-propagation through its loop.

    ``dfinal``: the gradient of the final state (None: zero); dg, dbeta None when g, beta are.
    """
    dout, q, k, v, g, beta = _as64(dout, q, k, v, g, beta)
    Z, n, dk = k.shape
    states, decayed = _steps(q, k, v, g, beta, state, starts)
    S0 = np.zeros((Z, dk, v.shape[-1])) if state is None else np.asarray(state, np.float64)
    dq, dk_, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg = None if g is None else np.zeros_like(g)
    dbeta = None if beta is None else np.zeros_like(beta)
    dS = np.zeros_like(S0) if dfinal is None else np.array(dfinal, np.float64)
    for t in reversed(range(n)):
        S, Sd = states[t], decayed[t]
        prev = S0 if t == 0 else states[t - 1]
        if starts is not None and starts[t]:
            prev = np.zeros_like(S0)
        dq[:, t] = np.einsum("zij,zj->zi", S, dout[:, t])
        dS = dS + q[:, t, :, None] * dout[:, t, None, :]
        kt, vt = k[:, t], v[:, t]
        if beta is None:
            dk_[:, t] = np.einsum("zij,zj->zi", dS, vt)
            dv[:, t] = np.einsum("zij,zi->zj", dS, kt)
            dSd = dS
        else:
            b = beta[:, t]
            r = vt - np.einsum("zi,zij->zj", kt, Sd)
            kdS = np.einsum("zi,zij->zj", kt, dS)  # k^T dS
            dbeta[:, t] = np.einsum("zj,zj->z", kdS, r)
            dv[:, t] = b[:, None] * kdS
            dk_[:, t] = b[:, None] * (np.einsum("zij,zj->zi", dS, r) - np.einsum("zij,zj->zi", Sd, kdS))
            dSd = dS - b[:, None, None] * kt[:, :, None] * kdS[:, None, :]
        a = _decay(g, t, dk)
        if a is None:
            dS = dSd
        else:
            rows = np.einsum("zij,zij->zi", dSd, prev) * a[:, :, 0]  # d/dg of each row's scale
            dg[:, t] = rows.sum(axis=1) if g.ndim == 2 else rows
            dS = a * dSd
        if starts is not None and starts[t]:
            dS = np.zeros_like(dS)
    return dq, dk_, dv, dg, dbeta, dS


def conv(x, weight, bias=None, starts=None):
    """Causal depthwise convolution in float64: y_t = bias + sum_j weight[:, j] * x_{t - (w-1) + j}, zero before
    the sequence or the document (``starts``) begins. x (Z, n, C), weight (C, w), bias (C,) or None."""
    x, weight = _as64(x, weight)
    w = weight.shape[1]
    first = _document_starts(x.shape[1], starts)
    y = np.zeros_like(x) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), x.shape).copy()
    for t in range(x.shape[1]):
        for j in range(w):
            s = t - (w - 1) + j
            if s >= first[t]:
                y[:, t] += weight[:, j] * x[:, s]
    return y


def conv_backward(dy, x, weight, bias=None, starts=None):
    """Gradients ``(dx, dweight, dbias)`` of ``conv`` (dbias None without a bias), by the same double loop."""
    dy, x, weight = _as64(dy, x, weight)
    w = weight.shape[1]
    first = _document_starts(x.shape[1], starts)
    dx, dweight = np.zeros_like(x), np.zeros_like(weight)
    for t in range(x.shape[1]):
        for j in range(w):
            s = t - (w - 1) + j
            if s >= first[t]:
                dx[:, s] += weight[:, j] * dy[:, t]
                dweight[:, j] += np.einsum("zc,zc->c", dy[:, t], x[:, s])
    return dx, dweight, None if bias is None else dy.sum(axis=(0, 1))


def _document_starts(n, starts):
    """For each token, the first token of its document (0 without ``starts``)."""
    if starts is None:
        return np.zeros(n, np.int64)
    flags = np.asarray(starts, bool).copy()
    flags[0] = True
    return np.maximum.accumulate(np.where(flags, np.arange(n), 0))
