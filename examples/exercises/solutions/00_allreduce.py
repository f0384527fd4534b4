"""Lab 0, solution: a ring all-reduce, reduce-scatter then all-gather.

    mpiexec -n 4 python -m mpiring grade examples/exercises/solutions/00_allreduce.py
"""

import numpy as np

EXERCISE = "allreduce"


def ring_allreduce(x, comm):
    """The sum of every rank's x, on every rank, by the ring: reduce-scatter, then all-gather."""
    rank, P = comm.Get_rank(), comm.Get_size()
    out = np.array(x, copy=True)
    parts = np.array_split(out, P)  # views of out: chunk c is parts[c]
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    for t in range(P - 1):  # after step t, chunk (rank - t - 1) % P holds the parts of t + 2 ranks
        send, add = (rank - t) % P, (rank - t - 1) % P
        incoming = np.empty_like(parts[add])
        comm.Sendrecv(parts[send], dest=send_to, sendtag=t, recvbuf=incoming, source=recv_from, recvtag=t)
        parts[add] += incoming
    for t in range(P - 1):  # rank r holds the complete chunk (r + 1) % P: pass the complete chunks on
        send, put = (rank + 1 - t) % P, (rank - t) % P
        comm.Sendrecv(parts[send], dest=send_to, sendtag=P + t, recvbuf=parts[put], source=recv_from,
                      recvtag=P + t)
    return out
