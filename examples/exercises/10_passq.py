"""Lab 10: pass-Q: the query blocks travel the ring, K/V stay; the partial results go home at the end.

    mpiexec -n 4 python -m mpiring grade examples/exercises/10_passq.py

Each rank holds m queries q (H, m, D) and a shard of n keys and values k, v (H, n, D), with m
smaller than n (new tokens against a long cache: every key is visible). Passing K/V would send
2 (P - 1) shards of n rows; passing Q sends (P - 1) blocks of m rows, then each rank sends every
other rank the partial (out, lse) it computed for that rank's queries (float64), once. At step t
rank r holds the queries of rank (r - t) mod P. Fill in the TODOs (docs/course.md).
"""

# ruff: noqa: F401, F841  (a skeleton: incomplete until its TODOs are done)

import numpy as np
from mpi4py import MPI

from mpiring import merge  # the log-sum-exp merge of two (out, lse) (lab 1)
from mpiring.testing import reference  # one block's attention (out, lse) in float64

EXERCISE = "passq"


def passq_attention(q, k, v, comm):
    """This rank's queries' output (H, m, D) over every rank's keys."""
    rank, P = comm.Get_rank(), comm.Get_size()
    held = np.ascontiguousarray(q)
    partials = {}  # rank s -> (out, lse) of rank s's queries against this rank's K/V
    for step in range(P):
        source = (rank - step) % P  # whose queries this rank holds
        # TODO: unless this is the last step, start passing held on to rank + 1 and receiving the next query
        #       block from rank - 1 (comm.Isend, comm.Irecv)
        partials[source] = reference(held, k, v)
        # TODO: wait for the transfers and hold the block that arrived
        raise NotImplementedError("lab 10: pass the query blocks round the ring")
    # TODO: send partials[s] (out and lse, float64) to each rank s != rank, receive this rank's partials from
    #       the others, and merge them all into this rank's (out, lse)
    raise NotImplementedError("lab 10: send the partials home and merge them")
