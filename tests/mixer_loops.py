"""The sequence mixers as plain float64 loops over the whole sequence, written from their definitions (torch ops,
so autograd differentiates them): the one-process references of tests/test_mixers_torch_mpi.py and hf_models.py.

``starts``: a boolean per token, True where a document starts (the state and the convolution restart there).
"""

import numpy as np
import torch


def loop_conv(x, w, b, starts):
    """(B, C, S) causal depthwise convolution, zero before each document."""
    S, K = x.shape[-1], w.shape[1]
    first = np.maximum.accumulate(np.where(starts, np.arange(S), 0))
    cols = []
    for t in range(S):
        acc = b[None].expand(x.shape[0], -1)
        for j in range(K):
            s = t - (K - 1) + j
            if s >= first[t]:
                acc = acc + w[:, j] * x[:, :, s]
        cols.append(acc)
    return torch.stack(cols, -1)


def loop_linear(q, k, v, g, beta, starts, scale):
    """(B, S, H, d): S_t = a_t (I - beta k k^T) S + beta k v^T (or a_t S + k v^T), o_t = S_t^T scale q_t."""
    B, S, H, dk = q.shape
    state, outs = torch.zeros(B, H, dk, v.shape[-1]), []
    for t in range(S):
        if starts[t]:
            state = torch.zeros_like(state)
        if g is not None:
            a = g[:, t].exp()
            state = state * (a[..., None, None] if g.ndim == 3 else a[..., :, None])
        kt, vt = k[:, t], v[:, t]
        if beta is not None:
            vt = (vt - (state * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + kt[..., None] * vt[..., None, :]
        outs.append((state * (scale * q[:, t])[..., None]).sum(-2))
    return torch.stack(outs, 1)


def loop_ssd(x, dt, A, Bm, Cm, D, dt_bias, starts):
    dt = torch.nn.functional.softplus(dt + dt_bias)
    B, S, H, P = x.shape
    rep, N = H // Bm.shape[2], Bm.shape[-1]
    h, ys = torch.zeros(B, H, N, P), []
    for t in range(S):
        if starts[t]:
            h = torch.zeros_like(h)
        bt, ct = Bm[:, t].repeat_interleave(rep, 1), Cm[:, t].repeat_interleave(rep, 1)
        h = torch.exp(dt[:, t] * A)[..., None, None] * h + dt[:, t, :, None, None] * bt[..., None] * x[:, t, :, None, :]
        ys.append(torch.einsum("bhnp,bhn->bhp", h, ct) + D[:, None] * x[:, t])
    return torch.stack(ys, 1)


def loop_scan(x, dt, A, Bm, Cm, D, z, bias, starts):
    dt = torch.nn.functional.softplus(dt + bias[..., None])
    h, ys = torch.zeros(x.shape[0], x.shape[1], A.shape[1]), []
    for t in range(x.shape[-1]):
        if starts[t]:
            h = torch.zeros_like(h)
        h = torch.exp(dt[:, :, t, None] * A) * h + dt[:, :, t, None] * Bm[:, None, :, t] * x[:, :, t, None]
        ys.append((h * Cm[:, None, :, t]).sum(-1) + D * x[:, :, t])
    return torch.stack(ys, -1) * torch.nn.functional.silu(z)
