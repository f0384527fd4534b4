"""A run of tokens as an affine map of the state, and the combine of two: the merge of every state-passing scan.

    S_out = A S_in + b        (A: (Z,) one decay per head, (Z, dk) one per key dimension, (Z, dk, dk) the delta rule)
    compose(later, earlier) = (A2 A1, A2 b1 + b2)

``compose`` is associative (not commutative): the state after runs 1..m is
the composition of their maps in sequence order applied to a zero state, in
any bracketing; this is what lets a prefix scan over ranks replace the
token-by-token loop, as the log-sum-exp merge lets blocks of keys combine in
any order. A document boundary is a zero transition: nothing before it
reaches past it. No MPI.
"""

from typing import NamedTuple

import numpy as np

__all__ = ["Affine", "compose", "apply", "cut", "transposed", "pack", "unpack"]


class Affine(NamedTuple):
    """S -> A S + b over Z states of shape (dk, dv)."""

    A: np.ndarray  # (Z,), (Z, dk) or (Z, dk, dk)
    b: np.ndarray  # (Z, dk, dv)


def apply(A, S):
    """A S for a transition of any of the three kinds."""
    if A.ndim == 3:
        return A @ S
    return (A[:, None, None] if A.ndim == 1 else A[:, :, None]) * S


def compose(later, earlier):
    """``later`` after ``earlier``: (A2 A1, A2 b1 + b2)."""
    A = later.A @ earlier.A if later.A.ndim == 3 else later.A * earlier.A
    return Affine(A, apply(later.A, earlier.b) + later.b)


def cut(m):
    """``m`` with a zero transition: what comes before it does not reach past it (a document starts here)."""
    return Affine(np.zeros_like(m.A), m.b)


def transposed(A):
    """A^T, what the backward scan carries (the gradient of S_in is A^T times that of S_out)."""
    return np.swapaxes(A, -1, -2) if A.ndim == 3 else A


def pack(maps, dtype):
    """Maps as one flat array (every A, then every b, in order): one message."""
    return np.concatenate([m.A.ravel() for m in maps] + [m.b.ravel() for m in maps]).astype(dtype, copy=False)


def unpack(flat, count, A_shape, b_shape):
    """Inverse of ``pack``: ``count`` maps of these shapes."""
    na, nb = int(np.prod(A_shape)), int(np.prod(b_shape))
    As = flat[:count * na].reshape((count,) + tuple(A_shape))
    bs = flat[count * na:count * (na + nb)].reshape((count,) + tuple(b_shape))
    return [Affine(As[i], bs[i]) for i in range(count)]
