"""What the chunked kernels share: blocks of a run of tokens, masks within a block, sums of the decay. No MPI."""

import numpy as np

__all__ = ["split", "join", "lower", "pair_decay", "log_decay", "reverse_cumsum", "unit_lower_inverse", "T_"]


def split(a, size):
    """(Z, n, ...) -> (Z, blocks, size, ...), the tail zero-padded (a padded token changes no state)."""
    Z, n = a.shape[:2]
    blocks = -(-n // size)
    pad = blocks * size - n
    if pad:
        a = np.concatenate([a, np.zeros((Z, pad) + a.shape[2:], a.dtype)], axis=1)
    return a.reshape((Z, blocks, size) + a.shape[2:])


def join(a, n):
    """Inverse of ``split``: (Z, blocks, size, ...) -> (Z, n, ...)."""
    return a.reshape((a.shape[0], -1) + a.shape[3:])[:, :n]


def lower(size, strict=False):
    """The (size, size) mask of key s visible to query t within a block: s <= t (s < t if ``strict``)."""
    return np.tri(size, size, -1 if strict else 0, dtype=bool)


def pair_decay(G, strict=False):
    """exp(G_t - G_s) for s <= t (s < t if ``strict``), 0 elsewhere: G (..., size) cumulative log decays."""
    mask = lower(G.shape[-1], strict)
    with np.errstate(invalid="ignore"):
        D = np.where(mask, G[..., :, None] - G[..., None, :], -np.inf)
    return np.exp(D)


def log_decay(g, like):
    """The log decay as (Z, n, 1) (none, or one per head) or (Z, n, dk) (one per key dimension)."""
    if g is None:
        return np.zeros(like.shape[:2] + (1,), like.dtype)
    return g[..., None] if g.ndim == 2 else g


def reverse_cumsum(a, axis):
    """sum over s >= t along ``axis``: the gradient of a cumulative sum."""
    return np.flip(np.cumsum(np.flip(a, axis), axis), axis)


def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L (..., T, T), by forward substitution row by row."""
    T = L.shape[-1]
    X = np.zeros_like(L)
    X[..., np.arange(T), np.arange(T)] = 1.0
    for i in range(1, T):
        X[..., i, :i] = -(L[..., i:i + 1, :i] @ X[..., :i, :i])[..., 0, :]
    return X


def T_(a):
    """The last two axes swapped."""
    return np.swapaxes(a, -1, -2)
