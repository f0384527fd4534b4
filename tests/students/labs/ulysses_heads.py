"""Planted wrong (lab 7): after the all-to-all back the heads are put in the wrong order (j * P + s, not s * h + j).

    python -m mpiring grade tests/students/labs/ulysses_heads.py --ranks 4     # fails: heads hint
"""

import numpy as np
from _solution import solution

from mpiring.testing import reference

EXERCISE = "ulysses"
lab = solution("07_ulysses")


def ulysses_attention(q, k, v, comm, causal=False):
    P = comm.Get_size()
    H, n, D = q.shape
    h = H // P

    def to_heads(x):
        send = np.ascontiguousarray(x.reshape(P, h, n, D))
        recv = np.empty_like(send)
        comm.Alltoall(send, recv)
        return recv.transpose(1, 0, 2, 3).reshape(h, P * n, D)

    out, _ = reference(*(to_heads(x) for x in (q, k, v)), causal=causal)
    back = np.ascontiguousarray(out.astype(q.dtype).reshape(h, P, n, D).transpose(1, 0, 2, 3))
    recv = np.empty_like(back)
    comm.Alltoall(back, recv)
    return recv.transpose(1, 0, 2, 3).reshape(H, n, D)  # the bug: head j * P + s instead of s * h + j
