"""Lab 7, solution: Ulysses, an all-to-all to head shards, attention, an all-to-all back.

    mpiexec -n 4 python -m mpiring grade examples/exercises/solutions/07_ulysses.py
"""

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
        recv = np.empty_like(send)
        comm.Alltoall(send, recv)  # recv[s]: rank s's rows of this rank's heads
        return recv.transpose(1, 0, 2, 3).reshape(h, P * n, D)

    qh, kh, vh = (to_heads(x) for x in (q, k, v))
    out, _ = reference(qh, kh, vh, causal=causal)  # positions 0 .. n * P - 1: the whole sequence
    back = np.ascontiguousarray(out.astype(q.dtype).reshape(h, P, n, D).transpose(1, 0, 2, 3))  # block s: rank s's rows
    recv = np.empty_like(back)
    comm.Alltoall(back, recv)  # recv[s]: this rank's rows of rank s's heads
    return recv.reshape(H, n, D).astype(q.dtype)
