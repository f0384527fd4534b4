"""Defective: the causal triangle is applied one step (one block) late: to the block of rank r - 1, not r.

    mpiexec -n 4 python -m mpiring grade tests/students/causal_off_by_one.py     # fails: causal mask
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
            mask = np.tril(np.ones((q.shape[-2],) * 2, bool)) if causal and step == 1 else None  # bug: step 1, not 0
            o, lb = attend(q, k, v, mask)
            new = np.logaddexp(lse, lb)
            out = np.exp(lse - new)[..., None] * out + np.exp(lb - new)[..., None] * o
            lse = new
        if step < size - 1:
            k_next, v_next = np.empty_like(k), np.empty_like(v)
            comm.Sendrecv(k, dest=(rank + 1) % size, sendtag=0, recvbuf=k_next, source=(rank - 1) % size, recvtag=0)
            comm.Sendrecv(v, dest=(rank + 1) % size, sendtag=1, recvbuf=v_next, source=(rank - 1) % size, recvtag=1)
            k, v = k_next, v_next
    return out.astype(q.dtype)
