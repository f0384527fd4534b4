"""Correct, but turns q, k, v into plain arrays first: the grader cannot count its products.

    mpiexec -n 4 python -m mpiring grade --exercise causal tests/students/plain_arrays.py  # passes
"""

import numpy as np
from correct_sendrecv import ring_attention as correct_ring

EXERCISE = "causal"  # graded as this exercise unless --exercise says otherwise


def ring_attention(q, k, v, comm, causal=False):
    q, k, v = (np.array(x) for x in (q, k, v))  # np.array makes a plain ndarray of any subclass
    return correct_ring(q, k, v, comm, causal)
