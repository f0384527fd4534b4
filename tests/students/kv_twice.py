"""Defective: right answers, but every K/V block is sent twice (a second, stacked copy per step).

    mpiexec -n 4 python -m mpiring grade tests/students/kv_twice.py     # fails: traffic
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
            k_next, v_next = np.empty_like(k), np.empty_like(v)
            comm.Sendrecv(k, dest=(rank + 1) % size, sendtag=0, recvbuf=k_next, source=(rank - 1) % size, recvtag=0)
            comm.Sendrecv(v, dest=(rank + 1) % size, sendtag=1, recvbuf=v_next, source=(rank - 1) % size, recvtag=1)
            k, v = k_next, v_next
            stacked = np.stack([k, v])  # the waste: K/V sent a second time, stacked, and thrown away
            comm.Sendrecv(stacked.copy(), dest=(rank + 1) % size, sendtag=2, recvbuf=stacked,
                          source=(rank - 1) % size, recvtag=2)
    return out.astype(q.dtype)
