"""Planted wrong (lab 0): the all-gather starts from chunk r, which holds only this rank's part, not from r + 1.

    python -m mpiring grade tests/students/labs/allreduce_gather_early.py --ranks 4     # fails: chunk hint
"""

import numpy as np

EXERCISE = "allreduce"


def ring_allreduce(x, comm):
    rank, P = comm.Get_rank(), comm.Get_size()
    out = np.array(x, copy=True)
    parts = np.array_split(out, P)
    for t in range(P - 1):
        send, add = (rank - t) % P, (rank - t - 1) % P
        incoming = np.empty_like(parts[add])
        comm.Sendrecv(parts[send], dest=(rank + 1) % P, sendtag=t, recvbuf=incoming, source=(rank - 1) % P, recvtag=t)
        parts[add] += incoming
    for t in range(P - 1):
        send, put = (rank - t) % P, (rank - t - 1) % P  # the bug: one chunk early
        comm.Sendrecv(parts[send].copy(), dest=(rank + 1) % P, sendtag=P + t, recvbuf=parts[put],
                      source=(rank - 1) % P, recvtag=P + t)
    return out
