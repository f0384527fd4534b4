"""Exercise 4, solution: zigzag shards, so every rank has the same causal work.

    mpiexec -n 4 python -m mpiring grade --exercise zigzag examples/exercises/solutions/04_zigzag.py

The sequence is cut into 2P chunks of c = n/2 tokens; rank r holds chunks r ("early") and
2P-1-r ("late"). For the block of rank s (its chunks s and 2P-1-s), causal:
s == r: the triangle of local offsets (np.tril) is exactly the causal mask;
s < r: both my chunks come after chunk s and before chunk 2P-1-s: all my queries see the
       early half of the block, none sees its late half;
s > r: my early chunk sees nothing of it, my late chunk sees all of it.
So every off-diagonal block costs half a block, on every rank.
"""

import numpy as np
from mpi4py import MPI

EXERCISE = "zigzag"


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
    """This rank's output (H, n, D); q, k, v are its zigzag shard (chunks r and 2P-1-r, n/2 tokens each)."""
    rank, P = comm.Get_rank(), comm.Get_size()
    n = q.shape[-2]
    c = n // 2
    scale = 1.0 / np.sqrt(q.shape[-1])
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full(q.shape[:-1], -np.inf)
    k_cur, v_cur = np.ascontiguousarray(k), np.ascontiguousarray(v)
    for step in range(P):
        if step < P - 1:
            k_next, v_next = np.empty_like(k_cur), np.empty_like(v_cur)
            requests = [comm.Irecv(k_next, source=recv_from, tag=0), comm.Irecv(v_next, source=recv_from, tag=1),
                        comm.Isend(k_cur, dest=send_to, tag=0), comm.Isend(v_cur, dest=send_to, tag=1)]
        source = (rank - step) % P
        if not causal:
            o, lb = block_attention(q, k_cur, v_cur, scale)
            out, lse = merge(out, lse, o, lb)
        elif source == rank:
            o, lb = block_attention(q, k_cur, v_cur, scale, np.tril(np.ones((n, n), bool)))
            out, lse = merge(out, lse, o, lb)
        elif source < rank:  # all queries, the early half of the keys
            o, lb = block_attention(q, k_cur[..., :c, :], v_cur[..., :c, :], scale)
            out, lse = merge(out, lse, o, lb)
        else:  # the late half of the queries, all keys
            o, lb = block_attention(q[..., c:, :], k_cur, v_cur, scale)
            out[..., c:, :], lse[..., c:] = merge(out[..., c:, :], lse[..., c:], o, lb)
        if step < P - 1:
            MPI.Request.Waitall(requests)
            k_cur, v_cur = k_next, v_next
    return out.astype(q.dtype)
