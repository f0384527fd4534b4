"""Planted wrong (lab 10): a K/V ring for the pass-Q contract: right output, K/V's bytes where Q's would do.

    python -m mpiring grade tests/students/labs/passq_kv.py --ranks 4     # fails: traffic (pass-Q hint)
"""

import numpy as np
from mpi4py import MPI

from mpiring import merge
from mpiring.testing import reference

EXERCISE = "passq"


def passq_attention(q, k, v, comm):
    rank, P = comm.Get_rank(), comm.Get_size()
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    kv = np.ascontiguousarray(np.stack([k, v]))
    for step in range(P):
        if step < P - 1:
            incoming = np.empty_like(kv)
            requests = [comm.Irecv(incoming, source=(rank - 1) % P), comm.Isend(kv, dest=(rank + 1) % P)]
        out, lse = merge(out, lse, *reference(q, kv[0], kv[1]))
        if step < P - 1:
            MPI.Request.Waitall(requests)
            kv = incoming
    return out.astype(q.dtype)
