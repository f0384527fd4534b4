"""Defective: right causal answers, but every block is computed in full and masked by global positions.

    mpiexec -n 4 python -m mpiring grade --exercise causal tests/students/no_skip.py    # fails: work

Nothing is skipped: rank 0 does the work of rank P - 1. ``masked_ring`` serves zigzag_no_skip.py too.
"""

import numpy as np
from mpi4py import MPI

import mpiring

EXERCISE = "causal"  # graded as this exercise unless --exercise says otherwise


def masked_ring(q, k, v, comm, causal, layout):
    rank, size = comm.Get_rank(), comm.Get_size()
    seq_len = q.shape[-2] * size
    mine = mpiring.shard_indices(seq_len, size, rank, layout)
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    for step in range(size):
        source = (rank - step) % size
        theirs = mpiring.shard_indices(seq_len, size, source, layout)
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        if causal:
            s = np.where(theirs[None, :] <= mine[:, None], s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)  # a row that sees nothing of this block
        p = np.exp(s - m)
        total = p.sum(axis=-1, keepdims=True)
        seen = total > 0
        block_out = p @ v / np.where(seen, total, 1.0)
        block_lse = np.where(seen, m + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
        new = np.logaddexp(lse, block_lse)
        safe = np.where(np.isfinite(new), new, 0.0)
        out = np.exp(lse - safe)[..., None] * out + np.exp(block_lse - safe)[..., None] * block_out
        lse = new
        if step < size - 1:
            k_next, v_next = np.empty_like(k), np.empty_like(v)
            ahead, behind = (rank + 1) % size, (rank - 1) % size
            MPI.Request.Waitall([comm.Irecv(k_next, behind, 0), comm.Irecv(v_next, behind, 1),
                                 comm.Isend(k, ahead, 0), comm.Isend(v, ahead, 1)])
            k, v = k_next, v_next
    return out.astype(q.dtype)


def ring_attention(q, k, v, comm, causal=False):
    return masked_ring(q, k, v, comm, causal, "contiguous")
