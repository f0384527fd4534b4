"""Lab 8: decoding against a KV cache sharded over the ranks; the partial results merged as a tree.

    mpiexec -n 4 python -m mpiring grade examples/exercises/08_decode.py

Every rank has the same query rows q (H, m, D) (m = 1: one new token) and its own shard of the
cache, k_cache and v_cache (H, c_r, D), of any length (even 0). Each rank attends q to its shard:
a partial (out, lse). The partials combine with the log-sum-exp merge, which is associative: merge
them as a tree, so that rank 0 has the result after ceil(log2 P) rounds instead of P - 1. In
round d = 1, 2, 4, ...: rank r with r % 2d == d sends its (out, lse) to rank r - d and is done;
rank r with r % 2d == 0 receives from r + d (if there is one) and merges. Fill in the TODO.
"""

# ruff: noqa: F401, F841  (a skeleton: incomplete until its TODOs are done)

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
        # TODO: a sender (rank % (2 * d) == d) sends out and lse to rank - d (comm.Send) and stops;
        #       a receiver (rank % (2 * d) == 0 and rank + d < P) receives them from rank + d and merges
        raise NotImplementedError("lab 8: the merge tree")
    return out, lse
