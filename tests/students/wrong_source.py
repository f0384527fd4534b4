"""Defective: receives from rank + 1, the rank it sends to, instead of rank - 1 (hangs in Waitall for P > 2).

    mpiexec -n 3 python -m mpiring grade tests/students/wrong_source.py     # fails: stuck
"""

import numpy as np
from mpi4py import MPI


def ring_attention(q, k, v, comm, causal=False):
    rank, size = comm.Get_rank(), comm.Get_size()
    scale = 1.0 / np.sqrt(q.shape[-1])
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    for step in range(size):
        s = q @ np.swapaxes(k, -1, -2) * scale
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        total = p.sum(axis=-1, keepdims=True)
        block_lse = (m + np.log(total))[..., 0]
        new = np.logaddexp(lse, block_lse)
        out = np.exp(lse - new)[..., None] * out + np.exp(block_lse - new)[..., None] * (p @ v / total)
        lse = new
        if step < size - 1:
            k_next, v_next = np.empty_like(k), np.empty_like(v)
            requests = [comm.Irecv(k_next, source=(rank + 1) % size, tag=0),  # the bug: should be rank - 1
                        comm.Irecv(v_next, source=(rank + 1) % size, tag=1),
                        comm.Isend(k, dest=(rank + 1) % size, tag=0), comm.Isend(v, dest=(rank + 1) % size, tag=1)]
            MPI.Request.Waitall(requests)
            k, v = k_next, v_next
    return out.astype(q.dtype)
