"""Lab 10, solution: pass-Q, the query blocks travel and the partials go home.

    mpiexec -n 4 python -m mpiring grade examples/exercises/solutions/10_passq.py
"""

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
        if step < P - 1:
            incoming = np.empty_like(held)
            requests = [comm.Irecv(incoming, source=(rank - 1) % P, tag=0),
                        comm.Isend(held, dest=(rank + 1) % P, tag=0)]
        partials[source] = reference(held, k, v)
        if step < P - 1:
            MPI.Request.Waitall(requests)
            held = incoming
    requests, home = [], {}
    for s in range(P):
        if s != rank:  # rank s's partial of this rank's queries comes here; this rank's of rank s's goes there
            home[s] = (np.empty(q.shape), np.empty(q.shape[:-1]))
            requests += [comm.Irecv(home[s][0], source=s, tag=1), comm.Irecv(home[s][1], source=s, tag=2),
                         comm.Isend(partials[s][0], dest=s, tag=1), comm.Isend(partials[s][1], dest=s, tag=2)]
    MPI.Request.Waitall(requests)
    out, lse = partials[rank]
    for s in sorted(home):
        out, lse = merge(out, lse, *home[s])
    return out.astype(q.dtype)
