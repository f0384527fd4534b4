"""Lab 9, solution: grouped-query ring attention; the ring carries the Hkv K/V heads.

    mpiexec -n 4 python -m mpiring grade examples/exercises/solutions/09_gqa.py
"""

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
        if step < P - 1:
            incoming = np.empty_like(kv)
            requests = [comm.Irecv(incoming, source=(rank - 1) % P, tag=step),
                        comm.Isend(kv, dest=(rank + 1) % P, tag=step)]
        if not causal or source <= rank:
            kb, vb = (np.repeat(x, G, axis=0) for x in kv)  # query head h reads K/V head h // G
            out, lse = merge(out, lse, *attend(q, kb, vb, rows, np.arange(source * n, (source + 1) * n), causal))
        if step < P - 1:
            MPI.Request.Waitall(requests)
            kv = incoming
    return out.astype(q.dtype)
