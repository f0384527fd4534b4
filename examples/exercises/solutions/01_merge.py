"""Exercise 1, solution: merge the softmax results of two key blocks (the log-sum-exp rule).

    mpiexec -n 1 python -m mpiring grade --exercise merge examples/exercises/solutions/01_merge.py
"""

import numpy as np

EXERCISE = "merge"


def merge(out1, lse1, out2, lse2):
    """Attention over the keys of two blocks, from each block's (out, lse): returns (out, lse).

    out_b (..., n, D) is softmax attention over block b alone, lse_b (..., n) its log-sum-exp
    log sum_j exp(s_j). A row's weight for block b is exp(lse_b - lse), lse the merged one.
    """
    m = np.maximum(lse1, lse2)
    m = np.where(np.isfinite(m), m, 0.0)  # a row neither block sees: keep exp(-inf - 0) = 0, not NaN
    w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)  # <= 1: no overflow however large the scores
    total = w1 + w2
    safe = np.where(total > 0, total, 1.0)
    out = (w1[..., None] * out1 + w2[..., None] * out2) / safe[..., None]
    lse = np.where(total > 0, m + np.log(safe), -np.inf)
    return out.astype(out1.dtype), lse.astype(lse1.dtype)
