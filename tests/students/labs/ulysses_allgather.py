"""Planted wrong (lab 7): K/V all-gathered instead of one all-to-all of heads. Right output, more traffic.

    python -m mpiring grade tests/students/labs/ulysses_allgather.py --ranks 4     # fails: traffic (from P = 3)
"""

import numpy as np

from mpiring.testing import reference

EXERCISE = "ulysses"


def ulysses_attention(q, k, v, comm, causal=False):
    rank, P = comm.Get_rank(), comm.Get_size()
    H, n, D = q.shape
    whole = []
    for x in (k, v):
        got = np.empty((P,) + x.shape, x.dtype)
        comm.Allgather(np.ascontiguousarray(x), got)
        whole.append(got.transpose(1, 0, 2, 3).reshape(H, P * n, D))
    out, _ = reference(q, *whole, causal=causal, q_positions=np.arange(rank * n, (rank + 1) * n))
    return out.astype(q.dtype)
