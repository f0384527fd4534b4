"""Lab 9: grouped-query attention on the ring: fewer K/V heads than query heads, and the bytes that saves.

    mpiexec -n 4 python -m mpiring grade examples/exercises/09_gqa.py

q is (H, n, D), k and v (Hkv, n, D) with G = H / Hkv query heads per K/V head: query head h
reads K/V head h // G. The ring carries K/V as they are, Hkv heads: G times fewer bytes than
repeating them first. ``attend`` takes one K/V head per query head: repeat the heads of the block
you hold (np.repeat along the head axis) when you attend it, after it arrived. Causal or not,
contiguous shards, as in labs 2 and 3. Fill in the TODOs (docs/course.md).
"""

# ruff: noqa: F401, F841  (a skeleton: incomplete until its TODOs are done)

import numpy as np
from mpi4py import MPI

from mpiring import merge  # the log-sum-exp merge of two (out, lse) (lab 1)
from mpiring.testing import reference

EXERCISE = "gqa"


def attend(q, k, v, q_rows, k_rows, causal):
    """(out, lse) of q against one K/V block with as many heads as q; masks by global token positions."""
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"attend takes one K/V head per query head: {q.shape[0]} query heads, {k.shape[0]} K/V")
    return reference(q, k, v, causal=causal, q_positions=q_rows, k_positions=k_rows)


def ring_attention(q, k, v, comm, causal=False):
    """This rank's output (H, n, D); q is its shard (H, n, D), k and v (Hkv, n, D)."""
    rank, P = comm.Get_rank(), comm.Get_size()
    n, G = q.shape[1], q.shape[0] // k.shape[0]
    rows = np.arange(rank * n, (rank + 1) * n)
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    kv = np.ascontiguousarray(np.stack([k, v]))  # (2, Hkv, n, D): what travels
    for step in range(P):
        source = (rank - step) % P  # whose K/V this rank holds
        # TODO: unless this is the last step, start receiving the next block from rank - 1 into a new buffer
        #       and sending kv to rank + 1 (comm.Irecv, comm.Isend)
        if not causal or source <= rank:
            # TODO: the block's heads, repeated for the G query heads that read each one, attended, merged:
            #       out, lse = merge(out, lse, *attend(q, kb, vb, rows, source's rows, causal))
            raise NotImplementedError("lab 9: attend the block with its K/V heads repeated")
        # TODO: wait for the transfers (MPI.Request.Waitall) and hold the block that arrived
    return out.astype(q.dtype)
