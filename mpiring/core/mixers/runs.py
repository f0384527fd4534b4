"""One run of consecutive tokens of a recurrence: its local outputs, its affine map, and the correction. No MPI.

    local = run_forward(q, k, v, g, beta)          # zero incoming state
    out = corrected(local, S_in)                   # once the state the run starts from is known
    element = reverse_element(local, dout)         # the backward scan's map: (A^T, entry^T dout)
    grads = run_backward(dout, q, k, v, g, beta, S_in, dS_out)

A run's outputs are linear in the state S_in it starts from:
out = out_local + entry S_in (``entry``: (Z, n, dk)), and its final state is
A S_in + b. Decays give ``entry`` and ``A`` in closed form; the delta rule's
come from the same chunked kernel run on the state [0 | I] with values
[v | 0] (its dk extra columns carry the product of the transitions).
"""

from typing import NamedTuple

import numpy as np

from .affine import Affine, transposed
from .decay import decay_backward, decay_entry, decay_forward, decay_transition
from .delta import delta_backward, delta_forward

__all__ = ["Local", "run_forward", "corrected", "reverse_element", "run_backward"]


class Local(NamedTuple):
    """A run computed from a zero state: its outputs, its map S_in -> S_out, how its tokens read S_in."""

    out: np.ndarray  # (Z, n, dv)
    map: Affine
    entry: np.ndarray  # (Z, n, dk)


def run_forward(q, k, v, g=None, beta=None, block=None):
    """The run from a zero incoming state (``Local``)."""
    Z, n, dk = k.shape
    dv = v.shape[-1]
    if beta is None:
        out, b = decay_forward(q, k, v, g, None, block)
        return Local(out, Affine(decay_transition(g, Z, dk).astype(out.dtype), b), decay_entry(q, g))
    wide = np.concatenate([v, np.zeros((Z, n, dk), v.dtype)], axis=-1)
    start = np.zeros((Z, dk, dv + dk), v.dtype)
    start[:, :, dv:] = np.eye(dk)
    out, final = delta_forward(q, k, wide, beta, g, start, block)
    return Local(out[..., :dv], Affine(final[..., dv:], final[..., :dv]), out[..., dv:])


def corrected(local, incoming):
    """The run's outputs given the state it starts from."""
    return local.out + local.entry @ incoming


def reverse_element(A, entry, dout):
    """What the run adds to the backward's state chain: dS_in = A^T dS_out + entry^T dout."""
    return Affine(transposed(A), np.swapaxes(entry, -1, -2) @ dout)


def run_backward(dout, q, k, v, g, beta, incoming, doutgoing, block=None):
    """Gradients ``(dq, dk, dv, dg, dbeta)`` of the run started from ``incoming``, its final state's gradient
    ``doutgoing`` (dg, dbeta None when g, beta are)."""
    if beta is None:
        dq, dk, dv, dg, _ = decay_backward(dout, q, k, v, g, incoming, doutgoing, block)
        return dq, dk, dv, dg, None
    dq, dk, dv, dg, dbeta, _ = delta_backward(dout, q, k, v, beta, g, incoming, doutgoing, block)
    return dq, dk, dv, dg, dbeta
