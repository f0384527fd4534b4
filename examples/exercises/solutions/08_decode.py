"""Lab 8, solution: decoding against a sharded KV cache, the partials merged as a binary tree.

    mpiexec -n 4 python -m mpiring grade examples/exercises/solutions/08_decode.py
"""

import numpy as np

from mpiring import merge  # the log-sum-exp merge of two (out, lse) (lab 1), NaN-free when both lse are -inf
from mpiring.testing import reference  # one block's attention (out, lse) in float64 (no keys: out 0, lse -inf)

EXERCISE = "decode"


def decode_attention(q, k_cache, v_cache, comm):
    """Attention of q over every rank's cache shard: (out (H, m, D), lse (H, m)) on rank 0."""
    rank, P = comm.Get_rank(), comm.Get_size()
    out, lse = reference(q, k_cache, v_cache)  # this rank's partial
    d = 1
    while d < P:
        if rank % (2 * d) == d:  # hand the merged partial to the left and leave the tree
            comm.Send(np.ascontiguousarray(out), dest=rank - d, tag=0)
            comm.Send(np.ascontiguousarray(lse), dest=rank - d, tag=1)
            break
        if rank + d < P:
            other_out, other_lse = np.empty_like(out), np.empty_like(lse)
            comm.Recv(other_out, source=rank + d, tag=0)
            comm.Recv(other_lse, source=rank + d, tag=1)
            out, lse = merge(out, lse, other_out, other_lse)
        d *= 2
    return out, lse
