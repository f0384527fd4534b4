"""Mamba-2's SSD and Mamba-1's selective scan as linear attention with a decay, and their gradients back. No MPI.

SSD (one decay per head; B and C shared by the heads of a group, consecutive
heads in a group):

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,   y_t = h_t^T C_t + D x_t
    = the recurrence with q = C, k = B, v = dt x, g = dt A

Selective scan (Mamba-1: one state of N per channel, a decay per channel and
state dimension; B and C shared by every channel):

    h_t[d] = exp(dt_t[d] A[d]) * h_{t-1}[d] + dt_t[d] B_t x_t[d],   y_t[d] = C_t . h_t[d] + D[d] x_t[d]
    = the recurrence with heads = channels, q = C, k = dt B, v = x (dv = 1), g = dt A (per state dimension)

Shapes: SSD x (..., H, n, P), dt (..., H, n), A (H,), B and C (..., G, n, N),
D (H,); selective scan x and dt (..., Dn, n), A (Dn, N), B and C (..., n, N),
D (Dn,). dt is the time step after its bias, softplus and limits.
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["RecurrenceGrads", "ssd_inputs", "ssd_grads", "scan_inputs", "scan_grads"]


@dataclass(frozen=True)
class RecurrenceGrads:
    """The recurrence's gradients, shaped as the mapping's (q, k, v, g)."""
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dg: np.ndarray


def ssd_inputs(x, dt, A, B, C):
    """(q, k, v, g) of the recurrence for SSD, the heads of a group sharing its B and C."""
    rep = x.shape[-3] // B.shape[-3]
    q, k = (np.repeat(a, rep, axis=-3) for a in (C, B))
    return q, k, x * dt[..., None], dt * A[:, None]


def _batch_sum(a, keep):
    """``a`` summed over every leading axis but the last ``keep``."""
    return a.sum(axis=tuple(range(a.ndim - keep))) if a.ndim > keep else a


def ssd_grads(back, dy, x, dt, A, B, D):
    """(dx, ddt, dA, dB, dC, dD) from the recurrence's gradients ``back`` (``RecurrenceGrads``; dD None without
    D; dA, dD: this rank's share)."""
    dq, dk, dv, dg = back.dq, back.dk, back.dv, back.dg
    G, rep = B.shape[-3], x.shape[-3] // B.shape[-3]
    group = lambda a: a.reshape(a.shape[:-3] + (G, rep) + a.shape[-2:]).sum(axis=-3)  # noqa: E731
    dx = dv * dt[..., None]
    ddt = np.sum(dv * x, axis=-1) + dg * A[:, None]
    dA = _batch_sum(np.sum(dg * dt, axis=-1), 1)
    dD = None
    if D is not None:
        dx = dx + D[:, None, None] * dy
        dD = _batch_sum(np.sum(dy * x, axis=(-2, -1)), 1)
    return dx, ddt, dA, group(dk), group(dq), dD


def scan_inputs(x, dt, A, B, C):
    """(q, k, v, g) of the recurrence for the selective scan: one head per channel."""
    channels = x.shape[-2]
    q = np.broadcast_to(C[..., None, :, :], C.shape[:-2] + (channels,) + C.shape[-2:])
    k = dt[..., None] * B[..., None, :, :]
    return q, k, x[..., None], dt[..., None] * A[:, None, :]


def scan_grads(back, dy, x, dt, A, B, D):
    """(dx, ddt, dA, dB, dC, dD) from the recurrence's gradients ``back`` (``RecurrenceGrads``; dD None without
    D; dA, dD: this rank's share)."""
    dq, dk, dv, dg = back.dq, back.dk, back.dv, back.dg
    dx = dv[..., 0]
    ddt = np.sum(dk * B[..., None, :, :], axis=-1) + np.sum(dg * A[:, None, :], axis=-1)
    dB = np.sum(dk * dt[..., None], axis=-3)
    dA = _batch_sum(np.sum(dg * dt[..., None], axis=-2), 2)
    dD = None
    if D is not None:
        dx = dx + D[:, None] * dy
        dD = _batch_sum(np.sum(dy * x, axis=-1), 1)
    return dx, ddt, dA, dB, dq.sum(axis=-3), dD
