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

from typing import NamedTuple

import numpy as np

__all__ = ["recurrence", "recurrence_backward", "conv", "conv_backward"]


def _decay(g, t, dk):
    """The decay of token t as an array that scales the state's rows: (Z, 1, 1) or (Z, dk, 1)."""
    if g is None:
        return None
    a = np.exp(g[:, t])
    return a[:, None, None] if a.ndim == 1 else a[:, :, None]


class _Inputs(NamedTuple):
    """The recurrence's inputs in float64 (g, beta, starts: None when not given)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray | None
    beta: np.ndarray | None
    starts: object


def _step(S, t, x):
    """The state after token t from the one before it, and that one decayed (what the delta rule reads)."""
    if x.starts is not None and x.starts[t]:
        S = np.zeros_like(S)
    a = _decay(x.g, t, x.k.shape[-1])
    Sd = S if a is None else a * S
    kt, vt = x.k[:, t], x.v[:, t]
    if x.beta is None:
        return Sd + kt[:, :, None] * vt[:, None, :], Sd
    r = vt - np.einsum("zi,zij->zj", kt, Sd)
    return Sd + x.beta[:, t, None, None] * kt[:, :, None] * r[:, None, :], Sd


def _as64(*arrays):
    return [None if a is None else np.asarray(a, np.float64) for a in arrays]


def _start(k, v, state):
    return np.zeros((k.shape[0], k.shape[-1], v.shape[-1])) if state is None else np.array(state, np.float64)


def recurrence(q, k, v, g=None, beta=None, state=None, starts=None):
    """``(out, final state)`` of the recurrence above in float64; ``state``: the initial (Z, dk, dv) one."""
    x = _Inputs(*_as64(q, k, v, g, beta), starts)
    S = _start(x.k, x.v, state)
    out = np.empty(x.q.shape[:2] + x.v.shape[-1:])
    for t in range(x.q.shape[1]):
        S, _ = _step(S, t, x)
        out[:, t] = np.einsum("zi,zij->zj", x.q[:, t], S)
    return out, S


def recurrence_backward(dout, q, k, v, g=None, beta=None, state=None, starts=None, dfinal=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dstate)`` of ``recurrence`` by back-propagation through its loop.

    ``dfinal``: the gradient of the final state (None: zero); dg, dbeta None when g, beta are. The states
    are kept every sqrt(n) tokens and recomputed in between (memory of O(sqrt(n)) states).
    """
    dout, q, k, v, g, beta = _as64(dout, q, k, v, g, beta)
    x = _Inputs(q, k, v, g, beta, starts)
    n = k.shape[1]
    stride = max(1, int(np.ceil(np.sqrt(n))))
    S0 = _start(k, v, state)
    marks, S = [], S0
    for t in range(n):
        if t % stride == 0:
            marks.append(S)
        S, _ = _step(S, t, x)
    dq, dk_, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg = None if g is None else np.zeros_like(g)
    dbeta = None if beta is None else np.zeros_like(beta)
    dS = np.zeros_like(S0) if dfinal is None else np.array(dfinal, np.float64)
    for first in reversed(range(0, n, stride)):
        S, before, states, decayed = marks[first // stride], [], [], []
        for t in range(first, min(first + stride, n)):
            before.append(np.zeros_like(S) if starts is not None and starts[t] else S)
            S, Sd = _step(S, t, x)
            states.append(S)
            decayed.append(Sd)
        for i in reversed(range(len(states))):
            dS = _back(first + i, dS, states[i], decayed[i], before[i], dout, x, (dq, dk_, dv, dg, dbeta))
    return dq, dk_, dv, dg, dbeta, dS


def _back(t, dS, S, Sd, prev, dout, x, grads):
    """One token of the backward (``x``: the ``_Inputs``): fills the gradients of token t, returns that of the
    state before it."""
    q, k, v, g, beta, starts = x.q, x.k, x.v, x.g, x.beta, x.starts
    dq, dk_, dv, dg, dbeta = grads
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
    a = _decay(g, t, k.shape[-1])
    if a is None:
        dS = dSd
    else:
        rows = np.einsum("zij,zij->zi", dSd, prev) * a[:, :, 0]  # d/dg of each row's scale
        dg[:, t] = rows.sum(axis=1) if g.ndim == 2 else rows
        dS = a * dSd
    if starts is not None and starts[t]:
        dS = np.zeros_like(dS)
    return dS


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
