"""Lab 7: Ulysses, attention parallel over heads: an all-to-all there, attend, an all-to-all back.

    mpiexec -n 4 python -m mpiring grade examples/exercises/07_ulysses.py

q, k, v are this rank's contiguous sequence shard (H, n, D), H a multiple of P. The first
all-to-all gives each rank H/P heads of the whole sequence (n * P tokens, in rank order); it
attends them with an ordinary (causal) attention; the second all-to-all sends each rank its rows
back for every head. Each rank sends (P - 1)/P of q, k, v and of the output: 4 (P - 1)/P shards,
against 2 (P - 1) for the K/V ring. Fill in the TODOs (docs/course.md).
"""

# ruff: noqa: F841  (a skeleton: incomplete until its TODOs are done)

import numpy as np

from mpiring.testing import reference  # one block's attention (out, lse) in float64, masks by global positions

EXERCISE = "ulysses"


def ulysses_attention(q, k, v, comm, causal=False):
    """This rank's output rows (H, n, D): q, k, v are its contiguous shard, H a multiple of P."""
    P = comm.Get_size()
    H, n, D = q.shape
    h = H // P

    def to_heads(x):
        """(H, n, D) rows of this rank -> (h, n * P, D): this rank's h heads, every token in order."""
        send = np.ascontiguousarray(x.reshape(P, h, n, D))  # block d (heads d*h .. d*h + h - 1) goes to rank d
        # TODO: recv[s] must hold rank s's rows of this rank's heads (comm.Alltoall); then put the token axis
        #       in rank order: (P, h, n, D) -> (h, P * n, D)
        raise NotImplementedError("lab 7: the all-to-all to head shards")

    qh, kh, vh = (to_heads(x) for x in (q, k, v))
    out, _ = reference(qh, kh, vh, causal=causal)  # positions 0 .. n * P - 1: the whole sequence
    # TODO: send every rank its n rows of these h heads (block s: tokens s*n .. s*n + n - 1), receive this
    #       rank's rows of every rank's heads, and return them as (H, n, D) with head s*h + j from rank s
    raise NotImplementedError("lab 7: the all-to-all back")
