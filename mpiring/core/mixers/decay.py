"""Linear attention with a decay, chunked: S_t = a_t S_{t-1} + k_t v_t^T, o_t = S_t^T q_t. No MPI.

    out, final = decay_forward(q, k, v, g, state)          # q, k (Z, n, dk), v (Z, n, dv)
    dq, dk, dv, dg, dstate = decay_backward(dout, q, k, v, g, state, dfinal)

``g``: None (a_t = 1), (Z, n) (a_t = exp(g_t), one per head: lightning
attention, Mamba-2) or (Z, n, dk) (a_t = diag(exp(g_t)), GLA, Mamba-1). The
run is cut into blocks of ``block`` tokens: within a block the outputs are
masked products (the decay between two tokens is exp(G_t - G_s) of the
cumulative log decays, never a ratio of two exponentials, so nothing
overflows), across blocks the state is carried block by block.
"""

import numpy as np

from .chunking import T_, join, log_decay, lower, pair_decay, reverse_cumsum, split

__all__ = ["decay_forward", "decay_backward", "decay_transition", "decay_entry", "BLOCK"]

BLOCK = {"scalar": 64, "diagonal": 16}  # tokens per block (the default; ``block=`` chooses)


def _block(g, block, dv):
    """A diagonal decay's block costs T exponentials per key dimension and token against dv for the state's
    products: with one value per head (Mamba-1) two tokens a block are fastest, with dv >= 16 sixteen."""
    if block:
        return block
    if g is not None and g.ndim == 3:
        return int(min(BLOCK["diagonal"], max(2, dv)))
    return BLOCK["scalar"]


def _intra(q, k, G):
    """Within each block, P[t, s] = sum_i q_ti k_si exp(G_ti - G_si) for s <= t: (Z, blocks, T, T)."""
    if G.shape[-1] == 1:  # one decay for every key dimension: one (T, T) matrix
        return (q @ T_(k)) * pair_decay(G[..., 0])
    T = q.shape[2]
    P = np.zeros(q.shape[:3] + (T,), q.dtype)
    for d in range(T):  # the d-th diagonal below the main one: (t, t - d)
        e = np.exp(G[:, :, d:] - G[:, :, :T - d])
        P[:, :, np.arange(d, T), np.arange(T - d)] = np.sum(q[:, :, d:] * k[:, :, :T - d] * e, axis=-1)
    return P


def _intra_grads(dP, q, k, G):
    """Gradients of q and k through ``_intra``, given dP (masked to s <= t)."""
    if G.shape[-1] == 1:
        W = dP * pair_decay(G[..., 0])
        return W @ k, T_(W) @ q
    T = q.shape[2]
    dq, dk = np.zeros_like(q), np.zeros_like(k)
    for d in range(T):
        e = np.exp(G[:, :, d:] - G[:, :, :T - d])
        w = dP[:, :, np.arange(d, T), np.arange(T - d)][..., None] * e
        dq[:, :, d:] += w * k[:, :, :T - d]
        dk[:, :, :T - d] += w * q[:, :, d:]
    return dq, dk


def _parts(q, k, v, g, block):
    """The blocks and what within them does not depend on the carried state."""
    T = _block(g, block, v.shape[-1])
    qb, kb, vb, gb = (split(a, T) for a in (q, k, v, log_decay(g, q)))
    G = np.cumsum(gb, axis=2)  # (Z, blocks, T, 1 | dk)
    last = G[:, :, -1:]
    kt = kb * np.exp(last - G)  # keys decayed to their block's end
    return qb, kb, vb, G, kt, np.exp(last[:, :, 0]), T_(kt) @ vb


def _sweep(A, B, state):
    """The state at the start of every block and the final one: S <- A S + B block by block."""
    S = np.zeros(B.shape[:1] + B.shape[2:], B.dtype) if state is None else np.asarray(state, B.dtype)
    starts = np.empty_like(B)
    for b in range(B.shape[1]):
        starts[:, b] = S
        S = A[:, b, :, None] * S + B[:, b]
    return starts, S


def decay_forward(q, k, v, g=None, state=None, block=None):
    """``(out, final state)``: out (Z, n, dv), the state (Z, dk, dv) after the last token (``state``: before it)."""
    n = q.shape[1]
    qb, kb, vb, G, kt, A, B = _parts(q, k, v, g, block)
    starts, final = _sweep(A, B, state)
    out = _intra(qb, kb, G) @ vb + (qb * np.exp(G)) @ starts
    return join(out, n), final


def decay_backward(dout, q, k, v, g=None, state=None, dfinal=None, block=None):
    """Gradients ``(dq, dk, dv, dg, dstate)`` of ``decay_forward`` (dg None when g is), ``dfinal`` that of its final
    state (None: zero)."""
    n = q.shape[1]
    qb, kb, vb, G, kt, A, B = _parts(q, k, v, g, block)
    starts, final = _sweep(A, B, state)
    do = split(dout, qb.shape[2])
    eG = np.exp(G)
    QdO = T_(qb * eG) @ do  # what each block's outputs ask of its start state
    ends = np.empty_like(starts)  # the gradient of each block's end state
    dS = np.zeros_like(final) if dfinal is None else np.asarray(dfinal, final.dtype)
    for b in reversed(range(B.shape[1])):
        ends[:, b] = dS
        dS = A[:, b, :, None] * dS + QdO[:, b]
    P = _intra(qb, kb, G)
    dP = (do @ T_(vb)) * lower(qb.shape[2])
    dq_intra, dk_intra = _intra_grads(dP, qb, kb, G)
    dq = dq_intra + eG * (do @ T_(starts))
    dk = dk_intra + np.exp(G[:, :, -1:] - G) * (vb @ T_(ends))
    dv = T_(P) @ do + kt @ ends
    dG = qb * dq - kb * dk
    end_states = np.concatenate([starts[:, 1:], final[:, None]], axis=1)
    dG[:, :, -1] += np.sum(end_states * ends, axis=-1)  # each row of the end state scales with exp(G_last)
    dG = reverse_cumsum(dG.sum(axis=-1, keepdims=True) if G.shape[-1] == 1 else dG, axis=2)
    dg = None if g is None else join(dG, n).reshape(g.shape)
    return join(dq, n), join(dk, n), join(dv, n), dg, dS


def decay_transition(g, Z, dk):
    """The run's transition: the product of its decays, (Z,) (none or one per head) or (Z, dk)."""
    if g is None:
        return np.ones(Z)
    return np.exp(g.sum(axis=1))


def decay_entry(q, g):
    """How each token reads the run's incoming state: o_t += entry_t^T S_in, entry_t = q_t * exp(sum_{s<=t} g_s)."""
    if g is None:
        return q
    G = np.cumsum(g, axis=1)
    return q * np.exp(G[..., None] if g.ndim == 2 else G)
