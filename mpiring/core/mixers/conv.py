"""The causal short convolution over rows gathered by index: every layout and document in one form. No MPI.

    y = conv_rows(src, taps, weight, bias)            # src (Z, rows, C), taps (n, w) row indices
    dsrc, dweight, dbias = conv_rows_backward(dy, src, taps, weight, bias)

Output token i is ``bias + sum_j weight[:, j] * src[taps[i, j]]``: tap j is
the token w-1-j places before it. ``src`` holds this rank's own rows, then
the halo rows other ranks sent, then one row of zeros that every tap before a
document's start (or the sequence's) points at. For fixed j the taps of
different tokens are different rows, or the zero row.
"""

import numpy as np

__all__ = ["conv_rows", "conv_rows_backward"]


def conv_rows(src, taps, weight, bias=None):
    """y (Z, n, C) of the gathered causal convolution (weight (C, w), bias (C,) or None)."""
    y = np.zeros(src.shape[:1] + (taps.shape[0], src.shape[-1]), src.dtype)
    if bias is not None:
        y += bias
    for j in range(weight.shape[1]):
        y += weight[:, j] * src[:, taps[:, j]]
    return y


def conv_rows_backward(dy, src, taps, weight, bias=None):
    """``(dsrc, dweight, dbias)``: the zero row's gradient is left in dsrc's last row (nobody owns it)."""
    dsrc = np.zeros_like(src)
    dweight = np.zeros(weight.shape, src.dtype)
    zero = src.shape[1] - 1
    for j in range(weight.shape[1]):
        rows = taps[:, j]
        real = rows != zero  # distinct rows: no two tokens read the same row with the same tap
        dsrc[:, rows[real]] += weight[:, j] * dy[:, real]
        dweight[:, j] = np.einsum("znc,znc->c", dy[:, real], src[:, rows[real]])
    return dsrc, dweight, None if bias is None else dy.sum(axis=(0, 1))
