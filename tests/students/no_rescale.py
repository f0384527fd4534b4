"""Defective: merges the blocks by averaging their outputs, without the log-sum-exp weights.

    mpiexec -n 4 python -m mpiring grade tests/students/no_rescale.py     # fails: wrong merge
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
            out = out + o  # the bug: block outputs added up as they are, no log-sum-exp weights
            lse = np.logaddexp(lse, lb)
        if step < size - 1:
            k_next, v_next = np.empty_like(k), np.empty_like(v)
            comm.Sendrecv(k, dest=(rank + 1) % size, sendtag=0, recvbuf=k_next, source=(rank - 1) % size, recvtag=0)
            comm.Sendrecv(v, dest=(rank + 1) % size, sendtag=1, recvbuf=v_next, source=(rank - 1) % size, recvtag=1)
            k, v = k_next, v_next
    return (out / (rank + 1 if causal else size)).astype(q.dtype)  # ...and averaged
