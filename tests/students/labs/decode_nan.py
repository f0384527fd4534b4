"""Planted wrong (lab 8): an empty cache shard gives a NaN partial (0/0), and the NaN survives every merge.

    python -m mpiring grade tests/students/labs/decode_nan.py --ranks 4     # fails: NaN hint
"""

import numpy as np
from _solution import solution

EXERCISE = "decode"
lab = solution("08_decode")


def attention(q, k, v):
    """(out, lse) without the guard for a shard with no keys: out = 0/0."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - m)
    with np.errstate(invalid="ignore", divide="ignore"):
        total = p.sum(axis=-1, keepdims=True)
        return p @ v / total, (m + np.log(total))[..., 0]


lab.reference = attention  # the solution's tree, with this block attention


def decode_attention(q, k_cache, v_cache, comm):
    return lab.decode_attention(q, k_cache, v_cache, comm)
