"""Exercise 2: the ring loop (non-causal).

    mpiexec -n 4 python -m mpiring grade --exercise ring examples/exercises/02_ring.py

Every rank keeps its queries; the K/V blocks travel the ring, one hop per step, while each
rank computes on the block it holds. Fill in the TODOs (docs/exercises.md).
"""

# ruff: noqa: B007, F401, F841  (a skeleton: incomplete until its TODOs are done)

import numpy as np
from mpi4py import MPI

EXERCISE = "ring"


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
    """The log-sum-exp merge of two blocks' (out, lse) (exercise 1's solution)."""
    m = np.maximum(lse1, lse2)
    m = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
    total = w1 + w2
    safe = np.where(total > 0, total, 1.0)
    out = (w1[..., None] * out1 + w2[..., None] * out2) / safe[..., None]
    return out, np.where(total > 0, m + np.log(safe), -np.inf)


def ring_attention(q, k, v, comm, causal=False):
    """This rank's attention output (H, n, D) over the whole sequence; q, k, v are its contiguous shard."""
    if causal:
        raise NotImplementedError("causal attention is exercise 3")
    rank, P = comm.Get_rank(), comm.Get_size()
    scale = 1.0 / np.sqrt(q.shape[-1])
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full(q.shape[:-1], -np.inf)
    k_cur, v_cur = np.ascontiguousarray(k), np.ascontiguousarray(v)
    for step in range(P):
        # TODO: unless this is the last step, start sending k_cur, v_cur to send_to and receiving the next
        #       block from recv_from into new buffers, without blocking (comm.Isend, comm.Irecv)
        block_out, block_lse = block_attention(q, k_cur, v_cur, scale)
        out, lse = merge(out, lse, block_out, block_lse)
        # TODO: wait for the transfers (MPI.Request.Waitall) and hold the block that arrived
        raise NotImplementedError("exercise 2: pass the K/V blocks around the ring")
    return out.astype(q.dtype)
