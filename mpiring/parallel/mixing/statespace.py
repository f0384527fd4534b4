"""State-space mixers' entry points: Mamba-2's SSD and Mamba-1's selective scan, as linear attention with a decay.

    y, carry = ssd(x, dt, A, B, C, D, comm, seq_len=S, layout="zigzag")      # x (..., H, n, P)
    dx, ddt, dA, dB, dC, dD = ssd_backward(dy, x, dt, A, B, C, D, carry, comm, seq_len=S, layout="zigzag")
    y, carry = selective_scan(x, dt, A, B, C, D, comm, seq_len=S)            # x (..., channels, n)

``dt`` is the time step after its bias, softplus and limits (the PyTorch
adapters apply those; ``mpiring.torch``). The recurrence and its state
passing are ``entry.scan_forward`` / ``scan_backward``; the mapping of the
arguments and the gradients back is ``core.mixers.ssm``. dA and dD are this
rank's share (sum them over the ranks). Collective, as every mixer call.
"""

import numpy as np

from ...core.mixers.ssm import RecurrenceGrads, scan_grads, scan_inputs, ssd_grads, ssd_inputs
from ...core.precision import compute_dtype
from .entry import carry_problem, gradient_problem, made_by, merged, run_entry, scan_backward, scan_forward

__all__ = ["ssd", "ssd_backward", "selective_scan", "selective_scan_backward"]


def _ssd_problem(x, dt, A, B, C, D):
    if x.ndim < 3 or dt.shape != x.shape[:-1]:
        return f"x must have shape (..., heads, seq, head dim) and dt (..., heads, seq), got {x.shape}, {dt.shape}"
    heads = x.shape[-3]
    if A.shape != (heads,) or (D is not None and D.shape != (heads,)):
        return f"A and D must have shape ({heads},), one per head, got {A.shape}, {None if D is None else D.shape}"
    if B.shape != C.shape or B.ndim != x.ndim or B.shape[:-3] != x.shape[:-3] or B.shape[-2] != x.shape[-2]:
        return f"B and C must have shape (..., groups, seq, state) matching x {x.shape}, got {B.shape}, {C.shape}"
    if heads % B.shape[-3]:
        return f"the {heads} heads must be a multiple of the {B.shape[-3]} groups of B and C"
    return None


def _scan_problem(x, dt, A, B, C, D):
    if x.ndim < 2 or dt.shape != x.shape:
        return f"x and dt must have one shape (..., channels, seq), got {x.shape}, {dt.shape}"
    channels = x.shape[-2]
    if A.ndim != 2 or A.shape[0] != channels or (D is not None and D.shape != (channels,)):
        return (f"A must have shape ({channels}, state) and D ({channels},), got {A.shape}, "
                f"{None if D is None else D.shape}")
    want = x.shape[:-2] + (x.shape[-1], A.shape[1])
    if B.shape != want or C.shape != want:
        return f"B and C must have shape {want} (..., seq, state), got {B.shape}, {C.shape}"
    return None


def _flat(q, k, v, g):
    """The recurrence's arrays with their leading axes merged (Z, n, ...)."""
    return merged(q, 2), merged(k, 2), merged(v, 2), merged(g, g.ndim - v.ndim + 2)


NAMES = ("x", "dt", "A", "B", "C", "D")


class _Mixer:
    """SSD or the selective scan: its checks, its rows' sequence axes, its mapping to the recurrence."""

    def __init__(self, name, problem, inputs, grads, axes):
        self.name, self.problem, self.inputs, self.grads, self.axes = name, problem, inputs, grads, axes

    def rows(self, given, names=NAMES):
        return {name: (a, self.axes.get(name)) for name, a in zip(names, given)}

    def recurrence(self, x, dt, A, B, C):
        work = compute_dtype(x.dtype)
        x, dt, A, B, C = (a.astype(work, copy=False) for a in (x, dt, A, B, C))
        return (x, dt, A, B, C), self.inputs(x, dt, A, B, C)

    def forward(self, comm, options, *given):
        def body(call, x, dt, A, B, C, D):
            (xw, dtw, Aw, Bw, Cw), parts = self.recurrence(x, dt, A, B, C)
            out, carry = scan_forward(call, *_flat(*parts), None, made_by(call.spec, x.shape, B.shape))
            y = out.reshape(parts[2].shape)[..., 0] if self.name == "selective_scan" else out.reshape(x.shape)
            if D is not None:
                y = y + (D[:, None] if self.name == "selective_scan" else D[:, None, None]) * xw
            return [(y.astype(x.dtype, copy=False), self.axes["x"]), (carry, None)]

        return run_entry(comm, self.rows(given), lambda spec: self.problem(*given), body, options,
                         work=_work(*given))

    def backward(self, comm, options, carry, dy, *given):
        def check(spec):
            return (self.problem(*given) or gradient_problem("dy", dy, given[0], "x")
                    or carry_problem(carry, spec, given[0].shape, given[3].shape))

        def body(call, dy, x, dt, A, B, C, D):
            given = (x, dt, A, B, C, D)
            (xw, dtw, Aw, Bw, Cw), parts = self.recurrence(x, dt, A, B, C)
            dyw = dy.astype(xw.dtype, copy=False)
            flat = _flat(*parts)
            dout = (dyw[..., None] if self.name == "selective_scan" else dyw).reshape(flat[2].shape)
            dq, dk, dv, dg, _ = scan_backward(call, dout, *flat, None, carry)
            back = RecurrenceGrads(*(a.reshape(p.shape) for a, p in zip((dq, dk, dv, dg), parts)))
            grads = self.grads(back, dyw, xw, dtw, Aw, Bw, None if D is None else D.astype(xw.dtype))
            return [(None if g is None else g.astype(a.dtype, copy=False), self.axes.get(name))
                    for g, a, name in zip(grads, given, NAMES)]

        return run_entry(comm, self.rows((dy, *given), ("dy",) + NAMES), check, body, options, work=3 * _work(*given))


def _work(x, dt, A, B, *_):
    """Floating-point operations of the recurrence over this rank's rows, generously (for timeout="auto")."""
    return 16.0 * 64 * np.size(x) * max(np.shape(A)[-1] if np.ndim(A) > 1 else np.shape(B)[-1], 1)


SSD = _Mixer("ssd", _ssd_problem, ssd_inputs, ssd_grads, {"dy": -2, "x": -2, "dt": -1, "B": -2, "C": -2})
SCAN = _Mixer("selective_scan", _scan_problem, scan_inputs, scan_grads, {"dy": -1, "x": -1, "dt": -1, "B": -2,
                                                                           "C": -2})


def ssd(x, dt, A, B, C, D=None, comm=None, **options):
    """This rank's ``(y, carry)`` of Mamba-2's SSD: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = h_t^T C_t + D x_t.

    x (..., H, n, P), dt (..., H, n) (after bias, softplus, limits), A (H,), B and C (..., G, n, N) (G groups
    of consecutive heads), D (H,) or None. Options as ``linear_attention``'s. Collective.
    """
    return SSD.forward(comm, options, x, dt, A, B, C, D)


def ssd_backward(dy, x, dt, A, B, C, D=None, carry=None, comm=None, **options):
    """``(dx, ddt, dA, dB, dC, dD)`` of ``ssd`` (dA, dD: this rank's share; dD None without D). Collective."""
    return SSD.backward(comm, options, carry, dy, x, dt, A, B, C, D)


def selective_scan(x, dt, A, B, C, D=None, comm=None, **options):
    """This rank's ``(y, carry)`` of Mamba-1's selective scan: per channel d,
    h_t = exp(dt_t A[d]) * h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t + D[d] x_t.

    x and dt (..., channels, n) (dt after bias and softplus), A (channels, N), B and C (..., n, N), D
    (channels,) or None. Collective.
    """
    return SCAN.forward(comm, options, x, dt, A, B, C, D)


def selective_scan_backward(dy, x, dt, A, B, C, D=None, carry=None, comm=None, **options):
    """``(dx, ddt, dA, dB, dC, dD)`` of ``selective_scan`` (dA, dD: this rank's share). Collective."""
    return SCAN.backward(comm, options, carry, dy, x, dt, A, B, C, D)
