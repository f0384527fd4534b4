"""Defective: every rank does a blocking Send before its Recv (correct only while MPI buffers the messages).

    mpiexec -n 4 python -m mpiring grade tests/students/blocking_send.py     # fails: unsafe
"""

import numpy as np


def attend(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    return p @ v / total, (m + np.log(total))[..., 0]


def ring_attention(q, k, v, comm, causal=False):
    rank, size = comm.Get_rank(), comm.Get_size()
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    for step in range(size):
        source = (rank - step) % size
        if not causal or source <= rank:
            mask = np.tril(np.ones((q.shape[-2],) * 2, bool)) if causal and source == rank else None
            o, lb = attend(q, k, v, mask)
            new = np.logaddexp(lse, lb)
            out = np.exp(lse - new)[..., None] * out + np.exp(lb - new)[..., None] * o
            lse = new
        if step < size - 1:
            comm.Send(k, dest=(rank + 1) % size, tag=0)  # the bug: every rank sends first...
            comm.Send(v, dest=(rank + 1) % size, tag=1)
            k, v = np.empty_like(k), np.empty_like(v)
            comm.Recv(k, source=(rank - 1) % size, tag=0)  # ...and receives only after its send completed
            comm.Recv(v, source=(rank - 1) % size, tag=1)
    return out.astype(q.dtype)
