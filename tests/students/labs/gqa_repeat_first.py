"""Planted wrong (lab 9): K/V heads repeated before the ring: right output, G times the bytes.

    python -m mpiring grade tests/students/labs/gqa_repeat_first.py --ranks 4     # fails: traffic (GQA hint)
"""

import numpy as np
from _solution import solution

EXERCISE = "gqa"
lab = solution("09_gqa")


def ring_attention(q, k, v, comm, causal=False):
    G = q.shape[0] // k.shape[0]
    return lab.ring_attention(q, np.repeat(k, G, axis=0), np.repeat(v, G, axis=0), comm, causal)
