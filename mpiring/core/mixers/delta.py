"""The gated delta rule, chunked: S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t. No MPI.

    out, final = delta_forward(q, k, v, beta, g, state)
    dq, dk, dv, dg, dbeta, dstate = delta_backward(dout, q, k, v, beta, g, state, dfinal)

Within a block of T tokens (gamma_t = exp(G_t), G the cumulative log decay
from the block's start, D_ts = exp(G_t - G_s) for s <= t), the updates
u_t = beta_t (v_t - a_t S_{t-1}^T k_t) written to the state solve one unit
lower-triangular system (the WY/UT form of DeltaNet):

    (I + L) U = beta V - beta gamma K S0,   L_ts = beta_t D_ts k_t.k_s (s < t)
    O = gamma Q S0 + (Q K^T * D) U,   S_T = gamma_T S0 + sum_s (gamma_T / gamma_s) k_s u_s^T

so everything but the two state products is computed for every block at once.
"""

import numpy as np

from .chunking import T_, join, lower, pair_decay, reverse_cumsum, split, unit_lower_inverse

__all__ = ["delta_forward", "delta_backward", "BLOCK"]

BLOCK = 64


def _parts(q, k, v, beta, g, T):
    """The blocks and every product within them that does not depend on the carried state."""
    qb, kb, vb = (split(a, T) for a in (q, k, v))
    bb = split(beta, T)
    G = np.cumsum(split(np.zeros(beta.shape, q.dtype) if g is None else g, T), axis=2)  # (Z, blocks, T)
    gam = np.exp(G)
    D = pair_decay(G)
    KK = kb @ T_(kb)
    L = bb[..., :, None] * KK * D * lower(T, strict=True)
    inv = unit_lower_inverse(L)
    p = dict(qb=qb, kb=kb, vb=vb, bb=bb, G=G, gam=gam, D=D, KK=KK, inv=inv, QK=qb @ T_(kb))
    p.update(Wv=inv @ (bb[..., None] * vb), Wk=inv @ ((bb * gam)[..., None] * kb),
             kt=kb * np.exp(G[..., -1:] - G)[..., None], gT=np.exp(G[..., -1]), qg=qb * gam[..., None])
    return p


def _sweep(p, state):
    """Block by block: the start states, the updates U of every block, and the final state."""
    Wv, Wk, kt, gT = p["Wv"], p["Wk"], p["kt"], p["gT"]
    Z, blocks, T, dv = Wv.shape
    S = np.zeros((Z, Wk.shape[-1], dv), Wv.dtype) if state is None else np.asarray(state, Wv.dtype)
    starts, U = np.empty((Z, blocks) + S.shape[1:], Wv.dtype), np.empty_like(Wv)
    for b in range(blocks):
        starts[:, b] = S
        U[:, b] = Wv[:, b] - Wk[:, b] @ S
        S = gT[:, b, None, None] * S + T_(kt[:, b]) @ U[:, b]
    return starts, U, S


def delta_forward(q, k, v, beta, g=None, state=None, block=None):
    """``(out, final state)``: q, k (Z, n, dk), v (Z, n, dv), beta (Z, n), g (Z, n) or None, state (Z, dk, dv)."""
    p = _parts(q, k, v, beta, g, block or BLOCK)
    starts, U, final = _sweep(p, state)
    out = p["qg"] @ starts + (p["QK"] * p["D"]) @ U
    return join(out, q.shape[1]), final


def delta_backward(dout, q, k, v, beta, g=None, state=None, dfinal=None, block=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dstate)`` of ``delta_forward`` (dg None when g is); ``dfinal``: the
    gradient of the final state (None: zero)."""
    n, T = q.shape[1], block or BLOCK
    p = _parts(q, k, v, beta, g, T)
    qb, kb, vb, bb, G, gam, D, KK, inv, QK = (p[name] for name in ("qb", "kb", "vb", "bb", "G", "gam", "D", "KK",
                                                                      "inv", "QK"))
    Wv, Wk, kt, gT, qg = p["Wv"], p["Wk"], p["kt"], p["gT"], p["qg"]
    starts, U, final = _sweep(p, state)
    do = split(dout, T)
    Aqk = QK * D
    AtdO, QdO = T_(Aqk) @ do, T_(qg) @ do
    ends, dU = np.empty_like(starts), np.empty_like(U)
    dS = np.zeros_like(final) if dfinal is None else np.asarray(dfinal, final.dtype)
    for b in reversed(range(U.shape[1])):  # the gradient of every block's end state and of its updates
        ends[:, b] = dS
        dU[:, b] = AtdO[:, b] + kt[:, b] @ dS
        dS = gT[:, b, None, None] * dS + QdO[:, b] - T_(Wk[:, b]) @ dU[:, b]
    dA = (do @ T_(U)) * lower(T)
    dq_inter = gam[..., None] * (do @ T_(starts))
    dq = (dA * D) @ kb + dq_inter
    dk = T_(dA * D) @ qb
    dkt = U @ T_(ends)
    dk += np.exp(G[..., -1:] - G)[..., None] * dkt
    dVb, dKbg = T_(inv) @ dU, -(T_(inv) @ (dU @ T_(starts)))  # through U = Wv - Wk S
    dL = -(dVb @ T_(Wv) + dKbg @ T_(Wk)) * lower(T, strict=True)  # through the inverse of I + L
    w = dL * D
    dbeta = np.sum(w * KK, axis=-1) + np.sum(vb * dVb, axis=-1)
    dKK = w * bb[..., :, None]
    dk += (dKK + T_(dKK)) @ kb + (bb * gam)[..., None] * dKbg
    kdK = np.sum(kb * dKbg, axis=-1)
    dbeta += gam * kdK
    dv = bb[..., None] * dVb
    W = D * (dA * QK + dL * bb[..., :, None] * KK)  # D_ts dD_ts, where D_ts = exp(G_t - G_s)
    ktk = np.sum(kt * dkt, axis=-1)
    dG = gam * bb * kdK + np.sum(qb * dq_inter, axis=-1) + W.sum(axis=-1) - W.sum(axis=-2) - ktk
    dG[..., -1] += ktk.sum(axis=-1) + gT * np.sum(starts * ends, axis=(-2, -1))
    dg = None if g is None else join(reverse_cumsum(dG, axis=2), n)
    return join(dq, n), join(dk, n), join(dv, n), dg, join(dbeta, n), dS
