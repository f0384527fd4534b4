"""Exercise 3, solution: causal ring attention that skips the blocks a rank cannot see.

    mpiexec -n 4 python -m mpiring grade --exercise causal examples/exercises/solutions/03_causal.py
    mpiexec -n 4 python -m mpiring grade examples/exercises/solutions/03_causal.py   # the full grade

With contiguous shards, at step t rank r holds the block of rank s = (r - t) mod P. Causal:
s < r is visible in full, s == r (step 0) with the triangle j <= i, s > r not at all: skip it
(but still pass it on: later ranks need it).
"""

import numpy as np
from mpi4py import MPI

EXERCISE = "causal"


def block_attention(q, k, v, scale, mask=None):
    """Softmax attention of q against one K/V block: (out, lse), in float64. mask: (nq, nk) bool or None."""
    s = (q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64)) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    out = (p @ v.astype(np.float64)) / safe
    lse = np.where(total > 0, m + np.log(safe), -np.inf)[..., 0]
    return out, lse


def merge(out1, lse1, out2, lse2):
    """The log-sum-exp merge of two blocks' (out, lse) (exercise 1)."""
    m = np.maximum(lse1, lse2)
    m = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
    total = w1 + w2
    safe = np.where(total > 0, total, 1.0)
    out = (w1[..., None] * out1 + w2[..., None] * out2) / safe[..., None]
    return out, np.where(total > 0, m + np.log(safe), -np.inf)


def ring_attention(q, k, v, comm, causal=False):
    """This rank's attention output (H, n, D) over the whole sequence; q, k, v are its contiguous shard."""
    rank, P = comm.Get_rank(), comm.Get_size()
    scale = 1.0 / np.sqrt(q.shape[-1])
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full(q.shape[:-1], -np.inf)
    k_cur, v_cur = np.ascontiguousarray(k), np.ascontiguousarray(v)
    for step in range(P):
        if step < P - 1:  # start passing the held block on before computing with it
            k_next, v_next = np.empty_like(k_cur), np.empty_like(v_cur)
            requests = [comm.Irecv(k_next, source=recv_from, tag=0), comm.Irecv(v_next, source=recv_from, tag=1),
                        comm.Isend(k_cur, dest=send_to, tag=0), comm.Isend(v_cur, dest=send_to, tag=1)]
        source = (rank - step) % P
        if not causal or source < rank:
            block_out, block_lse = block_attention(q, k_cur, v_cur, scale)
            out, lse = merge(out, lse, block_out, block_lse)
        elif source == rank:  # the diagonal block: query i sees key j <= i (same offsets in both shards)
            n = q.shape[-2]
            block_out, block_lse = block_attention(q, k_cur, v_cur, scale, np.tril(np.ones((n, n), bool)))
            out, lse = merge(out, lse, block_out, block_lse)
        # source > rank: every key of the block comes after every query here: nothing to compute
        if step < P - 1:
            MPI.Request.Waitall(requests)
            k_cur, v_cur = k_next, v_next
    return out.astype(q.dtype)
